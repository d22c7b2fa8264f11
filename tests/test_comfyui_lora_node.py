"""SGLDiffusion LoRA Loader's two typed outputs in a real ComfyUI 0.3.75 (and a real `sgld serve` for the
remote case): ``model`` (SGLD_MODEL) wired into ComfyUI's KSampler is refused when the prompt is queued,
naming the types (it used to pass and fail at run time on 'get_model_object'); the loader takes either
output of the Model Loader and gives both, the same LoRA'd model; on a Server model the node builds the chain its
runs send (issue 37), and a server that loads no LoRA files refuses the run in one line saying why."""
from __future__ import annotations

import os

import comfy_server as cs
import torch
from lora_files import BLOCK_LINEARS, make_pairs, write_lora
from test_serve import Server

LORA = "style.safetensors"


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder; this adds
# the module's own files to it (for this module's tests only).
def comfy_files(base):
    write_lora(os.path.join(base, "models", "loras", LORA), make_pairs(BLOCK_LINEARS, seed=21), "ai_toolkit")


def lora_graph(source, into_comfy_ksampler=False, output=0, prefix="lora-node"):
    """Model Loader output ``source`` -> LoRA Loader -> its output ``output`` -> SGLDiffusion KSampler, or
    ComfyUI's KSampler (same settings)."""
    g = cs.tiny_graph(cs.TINY, seed=3, steps=2, width=64, height=64, prefix=prefix)
    g["10"] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["1", source], "lora_name": LORA, "strength": 0.8}}
    g["5"]["inputs"]["model"] = ["10", output]
    if into_comfy_ksampler:
        g["5"]["class_type"] = "KSampler"
    return g


def test_the_outputs_are_typed_as_the_model_loaders(comfy):
    info = comfy.get("/object_info/SGLDiffusionLoraLoader").json()["SGLDiffusionLoraLoader"]
    loader = comfy.get("/object_info/SGLDiffusionModelLoader").json()["SGLDiffusionModelLoader"]
    assert info["output"] == loader["output"] == ["SGLD_MODEL", "MODEL"]
    assert info["output_name"] == loader["output_name"] == ["model", "comfy_model"]
    assert info["input"]["required"]["model"][0] == "SGLD_MODEL,MODEL"  # either output, chainable


def test_sgld_output_into_comfyuis_ksampler_is_refused_when_queued(comfy):
    r = comfy.post("/prompt", {"prompt": lora_graph(0, into_comfy_ksampler=True), "client_id": comfy.client_id})
    assert r.status_code == 400, r.text[:500]
    errors = r.json()["node_errors"]["5"]["errors"]
    assert errors[0]["type"] == "return_type_mismatch", errors
    assert "SGLD_MODEL" in errors[0]["details"] and "MODEL" in errors[0]["details"], errors


def test_either_input_gives_both_outputs_with_the_lora(comfy):
    runs = {}
    for key, source, comfy_ks, output in (("sgld_in", 0, False, 0), ("comfy_in", 1, False, 0), ("plain", None, False, 0),
                                          ("comfy_out", 0, True, 1)):
        g = lora_graph(source if source is not None else 0, comfy_ks, output, prefix=f"lora-node-{key}")
        if source is None:  # the same graph without the LoRA
            g["5"]["inputs"]["model"] = ["1", 0]
            del g["10"]
        entry = comfy.run(g)
        assert entry["status"]["status_str"] == "success", cs.error_message(entry)
        runs[key] = cs.saved_latent(comfy, entry)
        if not comfy_ks:  # the run panel says which LoRAs ran, by file name with their strengths (issue 49 item 2)
            assert entry["outputs"]["5"]["sgld_stats"][0]["loras"] == ([] if source is None else [[LORA, 0.8]])
    assert torch.equal(runs["sgld_in"], runs["comfy_in"])  # the comfy_model input: the same LoRA'd model
    assert not torch.equal(runs["sgld_in"], runs["plain"])
    # ComfyUI's KSampler on the comfy_model output samples the same LoRA'd model (its own sampler loop)
    assert torch.allclose(runs["comfy_out"], runs["sgld_in"], atol=1e-3, rtol=1e-3), \
        (runs["comfy_out"] - runs["sgld_in"]).abs().max()


def test_a_server_models_chain_goes_to_its_server_which_says_why_it_cannot_load_it(comfy, tmp_path):
    """The LoRA node passes a Server model on with the LoRA in its chain; the run sends it, and a server started
    without --lora-dir answers a 400 naming the entry and the flag: a one-line error on the KSampler."""
    sgld = Server(tmp_path / "serve.log").wait_ready()
    try:
        entry = comfy.run({
            "1": {"class_type": "SGLDiffusionServer", "inputs": {"base_url": sgld.url, "api_key": ""}},
            "10": {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": ["1", 0], "lora_name": LORA, "strength": 0.8}},
            "2": {"class_type": "SGLDiffusionDemoTextEncode", "inputs": {"text": "a red circle"}},
            "4": {"class_type": "SGLDiffusionDemoEmptyLatent", "inputs": {"batch_size": 1}},
            "5": {"class_type": "SGLDiffusionKSampler", "inputs": {
                "model": ["10", 0], "seed": 1, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["4", 0], "denoise": 1.0}},
            "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "chain"}}})
    finally:
        sgld.stop()
    err = cs.error_message(entry)
    assert err is not None and err["node_type"] == "SGLDiffusionKSampler", err
    message = err["exception_message"]
    assert "loras[0].name" in message and "--lora-dir" in message and LORA in message, message
    assert "\n" not in message.strip() and "Traceback" not in message
