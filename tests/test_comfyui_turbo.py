"""Issue 45 item 4 in a real ComfyUI 0.3.75: the demo-turbo picked in SGLDiffusion Model Loader runs 8 steps at cfg 1
with SGLDiffusion Cache-DiT (balanced) through SGLDiffusion KSampler, whose run panel statistics say 4 of 8 calls
computed and the measured speedup, and through ComfyUI's own KSampler on `comfy_model` with SGLDiffusion Apply
Cache-DiT: the same picture, and the judge passes it."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import comfy_server as cs  # noqa: E402

from engine.models import demo as demo_model  # noqa: E402
from engine.models.demo import EXAMPLE_PROMPT  # noqa: E402
from tools.demo import judge  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isfile(demo_model.DEMO_TURBO_WEIGHTS),
                                reason="the demo-turbo weights are not shipped yet")
SEED = 4
DEMO_TURBO_CHOICE = "sgld-demo-turbo (embedded, 64x64, 8 steps at cfg 1)"  # nodes/demo.py, as the loader lists it


def graph() -> dict:
    sampling = {"seed": SEED, "steps": 8, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}
    return {
        "1": {"class_type": "SGLDiffusionModelLoader", "inputs": {"unet_name": DEMO_TURBO_CHOICE, "weight_dtype": "default"}},
        "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": EXAMPLE_PROMPT}},
        "3": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": ""}},
        "4": {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
        "10": {"class_type": "SGLDiffusionCacheDiT", "inputs": {"enabled": True, "preset": "balanced", "advanced": False}},
        "5": {"class_type": "SGLDiffusionKSampler", "inputs": {"model": ["1", 0], "cache": ["10", 0], **sampling}},
        "6": {"class_type": "SGLDiffusionDemoDecode", "inputs": {"samples": ["5", 0]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "sgld/turbo"}},
        "11": {"class_type": "SGLDiffusionApplyCacheDiT", "inputs": {"model": ["1", 1], "cache": ["10", 0]}},
        "12": {"class_type": "KSampler", "inputs": {"model": ["11", 0], **sampling}},
        "13": {"class_type": "SGLDiffusionDemoDecode", "inputs": {"samples": ["12", 0]}},
        "14": {"class_type": "SaveImage", "inputs": {"images": ["13", 0], "filename_prefix": "sgld/turbo-comfy"}},
    }


def test_turbo_with_cache_dit_in_both_samplers(comfy):
    entry = comfy.run(graph(), timeout=300)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{comfy.log()[-3000:]}"
    stats = entry["outputs"]["5"]["sgld_stats"][0]
    assert (stats["model_calls"], stats["calls_computed"]) == (8, 4), stats
    assert stats["step_mask"].count("x") == 4 and stats["speedup"] is not None, stats  # what the run panel shows
    pictures = []
    for node in ("7", "14"):
        item = entry["outputs"][node]["images"][0]
        pictures.append(np.asarray(Image.open(comfy.output_path(item)).convert("RGB"), dtype=np.float64))
        assert judge.passes(pictures[-1].astype(np.uint8), EXAMPLE_PROMPT), (node, judge.judge(pictures[-1], EXAMPLE_PROMPT))
    assert np.abs(pictures[0] - pictures[1]).mean() < 2.0  # ComfyUI's KSampler caches the same calls
    # ComfyUI's KSampler's run, as the comfy_model path logs it: the same 4 of 8 calls computed
    assert f"demo-turbo.safetensors, 4/8 model calls computed, Cache-DiT {stats['step_mask']}" in comfy.log(), \
        comfy.log()[-2000:]
