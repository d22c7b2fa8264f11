"""Issue 49 item 1 in a real ComfyUI 0.3.75: `sgld quantize demo demo-fp8.safetensors --format fp8` in
models/diffusion_models, picked in SGLDiffusion Model Loader with weight_dtype "default", runs the demo through
both outputs, SGLDiffusion KSampler and ComfyUI's KSampler on `comfy_model`, and the judge passes the picture
(before: its F16 tensors made the default fp16, NaN at step 1 in both). The rule itself: tests/test_compute_dtype.py."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import comfy_server as cs  # noqa: E402

from engine.features.quant import writer_for  # noqa: E402
from engine.models import demo as demo_model  # noqa: E402
from engine.models.demo import EXAMPLE_PROMPT  # noqa: E402
from tools.demo import judge  # noqa: E402

COPY = "demo-fp8.safetensors"
SEED = 4  # its float32 picture passes the judge (tests/test_compute_dtype.py)


def comfy_files(base):
    writer_for("fp8").write(demo_model.DEMO_WEIGHTS, os.path.join(base, "models", "diffusion_models", COPY), "fp8")


def graph(sampler: str) -> dict:
    """The fp8 copy with the loader's defaults, the demo's text, latent and decode, 30 steps at cfg 3 (its defaults)."""
    model = ["1", 0] if sampler == "SGLDiffusionKSampler" else ["1", 1]
    return {
        "1": {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": COPY, "weight_dtype": "default"}},
        "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": EXAMPLE_PROMPT}},
        "3": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": ""}},
        "4": {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
        "5": {"class_type": sampler, "inputs": {
            "model": model, "seed": SEED, "steps": 30, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SGLDiffusionDemoDecode", "inputs": {"samples": ["5", 0]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "sgld/fp8"}},
    }


@pytest.mark.parametrize("sampler", ["SGLDiffusionKSampler", "KSampler"])
def test_an_fp8_copy_runs_with_the_loaders_defaults(comfy, sampler):
    entry = comfy.run(graph(sampler), timeout=300)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{comfy.log()[-3000:]}"
    item = entry["outputs"]["7"]["images"][0]
    image = np.asarray(Image.open(comfy.output_path(item)).convert("RGB"))
    assert judge.passes(image, EXAMPLE_PROMPT), judge.judge(image, EXAMPLE_PROMPT)
