"""An older ComfyUI (0.3.64: no Flux2 latent format, no Flux.2 VAE) in a real ComfyUI 0.3.75 server: 0.3.64 is
not installable here (no network), so the test pack's prestartup script removes ``comfy.latent_formats.Flux2``
and hides the Flux.2 VAE's batch-normed latent from ``AutoencodingEngineLegacy`` before the pack loads
(SGLD_TEST_REMOVE, tests/comfy_test_pack/prestartup_script.py). The start-up line says what does not work,
the Model Loader still gives SGLDiffusion KSampler its model, and only a graph that uses comfy_model fails,
on the node that uses it, with a message saying what to do. (Checked once by hand against the real 0.3.64 source
too, Comfy-Org/ComfyUI a125cd84 run from a local copy with SGLD_COMFYUI_DIR: the same start-up line, SGLDiffusion
KSampler runs, ComfyUI's KSampler on comfy_model fails with this message; the code before this fix failed the
Model Loader with ``module 'comfy.latent_formats' has no attribute 'Flux2'``.)"""
from __future__ import annotations

import os

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

MODEL = "tiny-ernie.safetensors"


COMFY_ENV = {"SGLD_TEST_REMOVE": "flux2_latent_format,flux2_vae"}  # read by the test pack's prestartup script


def comfy_base(base):
    cs.make_base_dir(base)
    cs.write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", MODEL))


def test_startup_line_says_what_does_not_work(comfy):
    lines = [line for line in comfy.log().splitlines() if "SGLDiffusion: this ComfyUI" in line]
    assert len(lines) == 1, comfy.log()[-3000:]
    line = lines[0]
    assert "the Flux2 latent format" in line and "the Flux.2 VAE" in line, line
    assert "Not working here: the Model Loader's comfy_model output" in line and "decoding ERNIE-Image latents" in line, line
    assert "work as they are" not in line, line
    assert "IMPORT FAILED" not in comfy.log()
    notice = line[line.index("SGLDiffusion: this ComfyUI"):]
    loader = comfy.get("/object_info/SGLDiffusionModelLoader").json()["SGLDiffusionModelLoader"]
    assert loader["description"].endswith(notice), loader["description"]  # said on the node too


def test_sgldiffusion_ksampler_works_without_the_flux2_latent_format(comfy):
    entry = comfy.run(cs.tiny_graph(MODEL, seed=3, steps=2), timeout=180)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    assert float(cs.saved_latent(comfy, entry).std()) > 0.1


def test_only_a_graph_using_comfy_model_fails_and_says_why(comfy):
    g = cs.tiny_graph(MODEL, seed=3, steps=2)
    del g["5"], g["6"]
    g["7"] = {"class_type": "KSampler", "inputs": {
        "model": ["1", 1], "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    g["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "sgld/old"}}
    entry = comfy.run(g, timeout=180)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    message = err["exception_message"].strip()
    assert err["node_id"] == "7", err
    assert "comfy_model output does not work in this ComfyUI" in message and "the Flux2 latent format" in message, message
    assert "SGLDiffusion KSampler" in message and "Traceback" not in message, message
