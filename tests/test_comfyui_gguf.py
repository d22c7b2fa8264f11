"""GGUF files in a real ComfyUI 0.3.75 server (one server for the module): SGLDiffusion Model Loader lists the
.gguf files of models/diffusion_models and models/unet, and both its outputs run them: SGLD_MODEL through
SGLDiffusion KSampler and comfy_model through ComfyUI's KSampler give the latent of the same weights
dequantized by gguf's numpy code and loaded as safetensors (every listed type in one file, unsloth's layout
in diffusion_models, ComfyUI-GGUF's in unet). Tolerances: against the reference 1e-5 of the largest value
(the same float32 weights, tests/checkpoints/test_gguf_loading.py; not exact here because the dense reference fuses
q/k/v into one matmul while parts of different GGUF types stay three: float32 rounding, measured 1.9e-6 of
3.0); ComfyUI's sampler against ours 1e-4, as tests/test_comfyui_model.py (its own sigma arithmetic)."""
from __future__ import annotations

import dataclasses
import os
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import comfy_server as cs  # noqa: E402
import lora_files  # noqa: E402
from gguf_files import ALL_TYPES, CFG, mixed_types, reference_state, write_gguf  # noqa: E402

from engine.models.random_weights import random_state_dict  # noqa: E402

# ComfyUI's Flux2 latent has 128 channels; rows of 256 keep every type (K types: blocks of 256) in the file
COMFY_CFG = dataclasses.replace(CFG, in_channels=128, out_channels=128)
SD = random_state_dict(COMFY_CFG, 0)
TYPES = mixed_types(SD)
UNSLOTH, COMFY, REF = "ernie-mixed-unsloth.gguf", "ernie-mixed-comfy.gguf", "ernie-mixed-ref.safetensors"
LORA = "gguf-lora.safetensors"


def write_lora(path: str) -> None:
    """A LoRA in ComfyUI's key format on block linears of two GGUF types and on a dense one."""
    lora_files.write_comfy_lora(path, SD)


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder; this adds
# the module's own files to it (for this module's tests only).
def comfy_files(base):
    models = os.path.join(base, "models")
    write_gguf(os.path.join(models, "diffusion_models", UNSLOTH), SD, TYPES, "unsloth")
    write_gguf(os.path.join(models, "unet", COMFY), SD, TYPES, "comfy")
    save_file(reference_state(os.path.join(models, "diffusion_models", UNSLOTH)),
              os.path.join(models, "diffusion_models", REF))
    os.makedirs(os.path.join(models, "loras"), exist_ok=True)
    write_lora(os.path.join(models, "loras", LORA))


def graph(model: str, lora: bool = False) -> dict:
    """Our KSampler on SGLD_MODEL (-> SaveLatent 6), ComfyUI's on comfy_model (-> 8); ``lora``: SGLDiffusion
    LoRA Loader on ours, ComfyUI's LoraLoaderModelOnly on comfy_model."""
    dim = COMFY_CFG.text_in_dim
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
    return g


def close(a, b, tol=1e-5) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * float(b.abs().max())


def latents(server, model: str, lora: bool = False):
    entry = server.run(graph(model, lora), timeout=300)
    assert entry["status"]["status_str"] == "success", f"{cs.error_message(entry)}\n{server.log()[-3000:]}"
    return cs.saved_latent(server, entry, "6"), cs.saved_latent(server, entry, "8")


def test_the_loader_lists_gguf_files_and_both_outputs_run_them(comfy):
    assert set(TYPES.values()) == set(ALL_TYPES)
    info = comfy.get("/object_info/SGLDiffusionModelLoader").json()["SGLDiffusionModelLoader"]
    choices = info["input"]["required"]["unet_name"][0]
    assert UNSLOTH in choices and COMFY in choices and REF in choices
    ref_ours, ref_theirs = latents(comfy, REF)
    assert float(ref_ours.std()) > 0.1
    for name in (UNSLOTH, COMFY):
        ours, theirs = latents(comfy, name)
        assert close(ours, ref_ours), f"{name}: {float((ours - ref_ours).abs().max()):.3g}"
        assert close(theirs, ours, 1e-4) and close(theirs, ref_theirs), name
    loaded = comfy.get("/sgldiffusion/models").json()["loaded"]
    assert any(d.get("name", d.get("model", "")).endswith(".gguf") or ".gguf" in str(d) for d in loaded), loaded


def test_lora_on_gguf_weights_through_both_outputs(comfy):
    """SGLDiffusion LoRA Loader on SGLD_MODEL and ComfyUI's LoraLoaderModelOnly on comfy_model, on the GGUF file
    and on the reference: the same LoRA gives the same latent within 1e-4 (GGUF layers add it as a side path,
    W x + B (A x); the dense reference merges it, (W + B A) x: float32 rounding apart)."""
    base, _ = latents(comfy, UNSLOTH)
    ours, theirs = latents(comfy, UNSLOTH, lora=True)
    ref_ours, _ = latents(comfy, REF, lora=True)
    assert float((ours - base).abs().max()) > 1e-3  # the LoRA changed the picture
    assert close(ours, ref_ours, 1e-4) and close(theirs, ours, 1e-4)
    again, _ = latents(comfy, UNSLOTH)  # the cached engine without the LoRA again: the base, exactly
    assert close(again, base, 0)
