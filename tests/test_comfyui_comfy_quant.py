"""ComfyUI's own quantized files (nvfp4, mxfp8, int8_tensorwise, convrot_w4a4, asym_w4a8_int8, written by
comfy-kitchen's quantizers in ComfyUI's layout: tests/comfy_quant_files.py) in a real ComfyUI 0.3.75 server (one server for the module). ComfyUI 0.3.75
itself reads none of these formats; the SGLDiffusion Model Loader does, and both its outputs run them: SGLD_MODEL
through SGLDiffusion KSampler and comfy_model through ComfyUI's KSampler give the latent of the same weights
dequantized by comfy-kitchen and saved as a dense file (tolerances as tests/test_comfyui_gguf.py); a LoRA is a
side path on the quantized layers, and the cached engine without it gives the base latent again."""
from __future__ import annotations

import dataclasses
import os
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import comfy_server as cs  # noqa: E402
import lora_files  # noqa: E402
from comfy_quant_files import write_comfy  # noqa: E402
from test_comfyui_gguf import close  # noqa: E402

from engine.models.random_weights import SIZES, random_state_dict  # noqa: E402

# ComfyUI's Flux2 latent has 128 channels
CFG = dataclasses.replace(SIZES["tiny"], in_channels=128, out_channels=128)
SD = random_state_dict(CFG, 0)
# format -> where its tags are (two of the 4-bit ones: each format costs two sampling runs; the others load through
# the same node code, tests/quant/test_comfy_int4_formats.py checks them)
FILES = {"nvfp4": "tensor", "mxfp8": "header", "int8_tensorwise": "tensor", "convrot_w4a4": "tensor",
         "asym_w4a8_int8": "header"}
LORA = "comfy-quant-lora.safetensors"


def write_lora(path: str) -> None:
    """A LoRA in ComfyUI's key format on three quantized block linears."""
    lora_files.write_comfy_lora(path, SD)


def comfy_files(base):
    models = os.path.join(base, "models", "diffusion_models")
    for fmt, tags in FILES.items():
        dense = write_comfy(os.path.join(models, f"ernie-{fmt}.safetensors"), SD, fmt, tags)
        save_file(dense, os.path.join(models, f"ernie-{fmt}-ref.safetensors"))
    os.makedirs(os.path.join(base, "models", "loras"), exist_ok=True)
    write_lora(os.path.join(base, "models", "loras", LORA))


def latents(server, model: str, lora: bool = False):
    dim = CFG.text_in_dim
    g = cs.tiny_graph(model, seed=4, steps=3, cfg=2.0, weight_dtype="fp32", pos=(1, 7, dim), neg=(2, 5, dim),
                      width=64, height=64)
    theirs = ["1", 1]
    if lora:
        g["20"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["1", 0], "lora_name": LORA, "strength": 0.7}}
        g["5"]["inputs"]["model"] = ["20", 0]
        g["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 1], "lora_name": LORA, "strength_model": 0.7}}
        theirs = ["21", 0]
    g["7"] = {"class_type": "KSampler", "inputs": {
        "model": theirs, "seed": 4, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    g["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "sgld/comfy"}}
    entry = server.run(g, timeout=300)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{server.log()[-3000:]}"
    return cs.saved_latent(server, entry, "6"), cs.saved_latent(server, entry, "8")


def test_the_loader_runs_comfyuis_quantized_files_through_both_outputs(comfy):
    info = comfy.get("/object_info/SGLDiffusionModelLoader").json()["SGLDiffusionModelLoader"]
    choices = info["input"]["required"]["unet_name"][0]
    for fmt in FILES:
        name = f"ernie-{fmt}.safetensors"
        assert name in choices
        ref_ours, ref_theirs = latents(comfy, f"ernie-{fmt}-ref.safetensors")
        ours, theirs = latents(comfy, name)
        assert float(ref_ours.std()) > 0.1
        assert close(ours, ref_ours), f"{fmt}: {float((ours - ref_ours).abs().max()):.3g}"
        assert close(theirs, ours, 1e-4) and close(theirs, ref_theirs), fmt


def test_lora_on_comfyuis_nvfp4_weights_through_both_outputs(comfy):
    base, _ = latents(comfy, "ernie-nvfp4.safetensors")
    ours, theirs = latents(comfy, "ernie-nvfp4.safetensors", lora=True)
    ref_ours, _ = latents(comfy, "ernie-nvfp4-ref.safetensors", lora=True)
    assert float((ours - base).abs().max()) > 1e-3  # the LoRA changed the picture
    assert close(ours, ref_ours, 1e-4) and close(theirs, ours, 1e-4)
    again, _ = latents(comfy, "ernie-nvfp4.safetensors")
    assert close(again, base, 0)
