"""The MODEL path (comfy_model under ComfyUI's own samplers) in a real ComfyUI 0.3.75 server, hardening of
issue 25: ComfyUI's LoRA patches reach the engine in memory (no file in the shared temp folder, which the
server here gets a private one of: TMPDIR) and errors name the user's file and keys; PEFT keys ComfyUI
cannot map are refused with advice; the engine's input checks run on this path too (text width, latent
channels, NaN latent / noise mask, a sigma of 0) and name the input; runs report their stats and warnings
as SGLDiffusion KSampler does (log, last runs, the web panel's run events). One server for the module."""
from __future__ import annotations

import json
import os
import time

import torch
from safetensors.torch import save_file

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
    from .test_comfyui_model import MODEL, close, ours_and_comfys, write_lora
except ImportError:
    import comfy_server as cs
    from test_comfyui_model import MODEL, close, ours_and_comfys, write_lora

LORA = "hardening-lora.safetensors"
NAN_LORA = "nan-lora.safetensors"
PEFT_LORA = "peft-lora.safetensors"
NAN_KEY = "diffusion_model.layers.0.self_attention.to_q.lora_up.weight"


def comfy_base(base):
    cs.make_base_dir(base)
    models = os.path.join(base, "models")
    cs.write_tiny_checkpoint(os.path.join(models, "diffusion_models", MODEL))
    loras = os.path.join(models, "loras")
    os.makedirs(loras, exist_ok=True)
    write_lora(os.path.join(loras, LORA))
    write_lora(os.path.join(loras, NAN_LORA))
    from safetensors.torch import load_file

    sd = load_file(os.path.join(loras, NAN_LORA))
    sd[NAN_KEY][0, 0] = float("nan")
    save_file(sd, os.path.join(loras, NAN_LORA))
    h = cs.tiny_config().hidden_size
    save_file({"transformer.layers.0.self_attention.to_q.lora_A.weight": torch.randn(2, h),
               "transformer.layers.0.self_attention.to_q.lora_B.weight": torch.randn(h, 2)}, os.path.join(loras, PEFT_LORA))
    os.makedirs(os.path.join(base, "tmp"))


def COMFY_ENV(base):  # noqa: N802 (tests/conftest.py's comfy fixture reads it by this name)
    """The server's shared temp folder, where the old code wrote LoRA files: a folder of this test's own."""
    return {"TMPDIR": os.path.join(base, "tmp")}


def failed(server, graph, node: str) -> str:
    entry = server.run(graph, timeout=240)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err["node_id"] == node, err
    message = err["exception_message"].strip()
    assert "Traceback" not in message and "\n" not in message, message
    return message


def comfy_only(**kw) -> dict:
    """ours_and_comfys without SGLDiffusion KSampler: only ComfyUI's KSampler (node 7) on comfy_model."""
    g = ours_and_comfys(**kw)
    del g["5"], g["6"]
    return g


def loaded_latent(server, name: str, tensor: torch.Tensor) -> dict:
    """A LoadLatent node for ``tensor`` (written to input/; LoadLatent takes a non-empty latent as it is)."""
    save_file({"latent_tensor": tensor, "latent_format_version_0": torch.tensor([])}, os.path.join(server.base, "input", name))
    return {"class_type": "LoadLatent", "inputs": {"latent": name}}


# -- item 1 / 10: ComfyUI's LoRA patches ----------------------------------------------------------------------

def test_comfyuis_lora_patches_reach_the_engine_in_memory(comfy):
    """LoraLoaderModelOnly gives what the engine's LoRA gives, and nothing is written to the temp folder (the old
    code wrote <tmp>/sgld-comfy-loras/<hash>.safetensors and trusted any file of that name); the engine names
    the user's file and node."""
    entry = comfy.run(ours_and_comfys(comfy_lora=LORA, seed=6), timeout=240)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    assert close(cs.saved_latent(comfy, entry, "8"), cs.saved_latent(comfy, entry, "6"))
    assert not os.path.exists(os.path.join(os.path.join(comfy.base, "tmp"), "sgld-comfy-loras")), os.listdir(os.path.join(comfy.base, "tmp"))
    assert not [f for _, _, files in os.walk(os.path.join(comfy.base, "tmp")) for f in files if f.endswith(".safetensors")]
    assert comfy.run(comfy_only(comfy_lora=LORA, seed=16))["status"]["status_str"] == "success"  # its LoRA active last
    loras = [name for d in comfy.get("/sgldiffusion/models").json()["loaded"] for name, _ in d["loras"]]
    assert f"{LORA} (LoraLoaderModelOnly, node 21)" in loras, loras


def test_comfy_lora_patches_reach_worker_ranks_in_memory(comfy):
    """Two ranks (gloo): the in-memory LoRA crosses to the worker processes as plain arrays."""
    entry = comfy.run(ours_and_comfys(comfy_lora=LORA, seed=6, loader_options={"num_gpus": 2}), timeout=300)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    assert close(cs.saved_latent(comfy, entry, "8"), cs.saved_latent(comfy, entry, "6"))
    assert not os.path.exists(os.path.join(os.path.join(comfy.base, "tmp"), "sgld-comfy-loras"))


def test_a_bad_comfy_lora_is_named_by_the_users_file_and_key(comfy):
    message = failed(comfy, comfy_only(comfy_lora=NAN_LORA, seed=6), "7")
    assert f"{NAN_LORA} (LoraLoaderModelOnly, node 21)" in message and f"'{NAN_KEY}' holds NaN" in message, message
    assert "sgld-comfy-loras" not in message and "lora_B" not in message and "lora_A" not in message, message


def test_peft_keys_comfyui_cannot_map_point_to_the_sgldiffusion_lora_loader(comfy):
    """ComfyUI 0.3.75 maps no transformer.* key for ERNIE-Image: it would only log 'lora key not loaded'."""
    message = failed(comfy, comfy_only(comfy_lora=PEFT_LORA, seed=6), "21")
    assert PEFT_LORA in message and "transformer.layers.0.self_attention.to_q" in message, message
    assert "Use SGLDiffusion LoRA Loader" in message, message


# -- item 8 / 9: the engine's input checks on this path -----------------------------------------------------------

def test_text_features_of_the_wrong_width_are_named(comfy):
    g = comfy_only(seed=1)
    g["2"]["inputs"]["dim"] = cs.text_dim() + 16
    message = failed(comfy, g, "7")
    assert (f"positive conditioning #0 has {cs.text_dim() + 16} features per token but this model takes {cs.text_dim()}"
            in message), message


def test_a_latent_of_the_wrong_channel_count_is_named(comfy):
    g = comfy_only(seed=1)
    g["4"] = loaded_latent(comfy, "sixteen.latent", torch.randn(1, 16, 8, 8))
    message = failed(comfy, g, "7")
    assert "latent has 16 channels but this model takes 128" in message and "Flux2" in message, message


def test_a_nan_latent_is_named_not_blamed_on_the_weights(comfy):
    bad = torch.zeros(1, 128, 8, 8)
    bad[0, 3, 2, 2] = float("nan")
    g = comfy_only(seed=1, denoise=0.5)
    g["4"] = loaded_latent(comfy, "nan.latent", bad)
    message = failed(comfy, g, "7")
    assert "latent holds NaN or inf values" in message and "weights" not in message, message


def test_a_nan_noise_mask_is_named_not_blamed_on_the_weights(comfy):
    g = comfy_only(seed=1)
    g["40"] = {"class_type": "SGLDTestNoiseMask", "inputs": {"samples": ["4", 0], "value": float("nan"), "channels": 1}}
    g["7"]["inputs"]["latent_image"] = ["40", 0]
    message = failed(comfy, g, "7")
    assert "noise_mask holds NaN or inf values" in message and "weights" not in message, message


def test_set_first_sigma_zero_is_named_not_blamed_on_the_weights(comfy):
    g = cs.tiny_graph(MODEL, seed=4, steps=3, weight_dtype="fp32")
    del g["5"], g["6"]
    g.update({
        "30": {"class_type": "BasicScheduler", "inputs": {"model": ["1", 1], "scheduler": "simple", "steps": 3, "denoise": 1.0}},
        "35": {"class_type": "SetFirstSigma", "inputs": {"sigmas": ["30", 0], "sigma": 0.0}},
        "31": {"class_type": "RandomNoise", "inputs": {"noise_seed": 4}},
        "32": {"class_type": "BasicGuider", "inputs": {"model": ["1", 1], "conditioning": ["2", 0]}},
        "33": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "34": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["31", 0], "guider": ["32", 0], "sampler": ["33", 0],
                                                                 "sigmas": ["35", 0], "latent_image": ["4", 0]}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["34", 0], "filename_prefix": "sgld/sigma0"}},
    })
    message = failed(comfy, g, "34")
    assert "sigma 1 of 4 is 0: only the last sigma may be 0" in message and "weights" not in message, message


# -- item 14: stats and warnings of MODEL-path runs ------------------------------------------------------------

def run_events(server, graph, timeout=240):
    """Queue ``graph`` with a workflow id; returns (history entry, the sgldiffusion.run events of its run)."""
    import websocket

    ws = server.websocket()
    try:
        r = server.post("/prompt", {"prompt": graph, "client_id": server.client_id,
                                    "extra_data": {"extra_pnginfo": {"workflow": {"id": "wf-hardening"}}}})
        assert r.status_code == 200, r.text
        prompt_id = r.json()["prompt_id"]
        events, deadline = [], time.monotonic() + timeout
        ws.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                msg = ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            if isinstance(msg, bytes):
                continue
            ev = json.loads(msg)
            if ev["type"] == "sgldiffusion.run":
                events.append(ev["data"])
            if ev["type"] in ("execution_success", "execution_error") and ev["data"].get("prompt_id") == prompt_id:
                break
    finally:
        ws.close()
    return server.wait(prompt_id, timeout), events


def test_model_path_runs_report_stats_and_warnings_like_sgldiffusion_ksampler(comfy):
    """Apply Cache-DiT + ComfyUI's KSampler with dpmpp_sde (a sampler the cache cannot count): the run says it
    ran uncached (log, the node's last run, the run event) and counts the calls it made (was '39/0')."""
    g = comfy_only(seed=2, steps=4, cache="fast", sampler="dpmpp_sde")
    entry, events = run_events(comfy, g)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    mine = [e for e in events if e.get("node") == "7"]
    assert [e["state"] for e in mine] == ["running", "done"], events
    done = mine[-1]
    assert any("Cache-DiT is off for this run" in w and "dpmpp_sde" in w for w in done["warnings"]), done
    assert done["model_calls"] == done["calls_computed"] == len(done["timeline"]) > 4, done
    assert done["steps"] == 4 and done["calls_cached"] == 0, done
    runs = comfy.get("/sgldiffusion/last_runs", params={"workflow": "wf-hardening"}).json()["runs"]
    assert runs["7"]["state"] == "done" and runs["7"]["warnings"] == done["warnings"], runs
    log = comfy.log()
    assert "Cache-DiT is off for this run" in log and "/0 model calls" not in log
    assert f"{done['model_calls']}/{done['model_calls']} model calls computed" in log


def test_a_failed_model_path_run_is_reported(comfy):
    g = comfy_only(seed=1)
    g["2"]["inputs"]["dim"] = cs.text_dim() + 8
    entry, events = run_events(comfy, g)
    assert entry["status"]["status_str"] == "error"
    mine = [e for e in events if e.get("node") == "7"]
    assert [e["state"] for e in mine] == ["running", "failed"] and "features per token" in mine[-1]["error"], events
