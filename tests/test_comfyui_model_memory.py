"""What comfy_model tells ComfyUI's memory management, and the ComfyUI paths it cannot serve, in real ComfyUI 0.3.75
servers (issue 25 item 19; the newest ComfyUI's contract is in docs/comfyui_model.md, "Memory").

The test pack's SGLD Test Model Memory node reads what ComfyUI's load_models_gpu reads (model_size, loaded_size,
LoadedModel.model_memory_required, and the host memory a 2026 ComfyUI would pin for a non-dynamic patcher: its
whole model_size). An engine already open (the loader opens it) is not counted as still to load; after /free it
is. A 2026 ComfyUI cannot be installed here (no network): a second server gets its pin budget's name
(``comfy.model_management.ensure_pin_budget``, a recording stand-in from the test pack's prestartup script), and
the patcher then asks ComfyUI to pin nothing while sampling still equals SGLDiffusion KSampler. Model merging,
model saving, weight hooks and multi-GPU cloning are refused by name."""
from __future__ import annotations

import os
import time

import pytest

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
    from .test_comfyui_model import LORA, MODEL, close, ours_and_comfys, write_lora
except ImportError:
    import comfy_server as cs
    from test_comfyui_model import LORA, MODEL, close, ours_and_comfys, write_lora


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder; this adds
# the module's own files to it (for this module's tests only).
def comfy_files(base: str):  # the shared base folder has MODEL
    write_lora(os.path.join(base, "models", "loras", LORA))


def make_server(base: str, **env):
    cs.shared_base(base)
    comfy_files(base)
    return cs.start_server(base, extra_env=env)


def probe(server, action="memory", after=None, model=("1", 1)) -> dict:
    g = cs.tiny_graph(MODEL, weight_dtype="fp32")
    del g["5"], g["6"]
    g["50"] = {"class_type": "SGLDTestModelMemory", "inputs": {"model": list(model), "action": action}}
    if after:
        g.update(after)
        g["50"]["inputs"]["after"] = ["7", 0]
    entry = server.run(g, timeout=180)
    assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    return entry["outputs"]["50"]["memory"][0]


def unloaded(server) -> None:
    """/free with unload_models only: ComfyUI keeps its cached node outputs (the loader's too)."""
    assert server.post("/free", {"unload_models": True}).status_code == 200
    deadline = time.monotonic() + 30
    while server.get("/sgldiffusion/models").json()["loaded"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.get("/sgldiffusion/models").json()["loaded"] == []


def test_an_open_engine_is_not_counted_as_still_to_load(comfy):
    """The loader opened the engine: ComfyUI must not free the model's size again before the first sampling."""
    before = probe(comfy)
    assert before["model_size"] == before["loaded_size"] > 0 and before["memory_required"] == 0, before
    unloaded(comfy)
    after = probe(comfy)  # the loader's output is cached: nothing reopens the engine
    assert after["loaded_size"] == 0 and after["memory_required"] == after["model_size"] > 0, after


def failure(server, graph, node: str) -> str:
    entry = server.run(graph, timeout=180)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err["node_id"] == node, err
    message = err["exception_message"].strip()
    assert "Traceback" not in message and "\n" not in message, message
    assert message.startswith("SGLDiffusion comfy_model: "), message
    return message


def comfy_only(**kw) -> dict:
    g = ours_and_comfys(**kw)
    del g["5"], g["6"]
    return g


def test_model_merging_is_refused_by_name(comfy):
    g = comfy_only(seed=1)
    g["60"] = {"class_type": "ModelMergeSimple", "inputs": {"model1": ["1", 1], "model2": ["1", 1], "ratio": 0.5}}
    g["7"]["inputs"]["model"] = ["60", 0]
    assert "model merging" in failure(comfy, g, "60")


def test_model_saving_is_refused_by_name(comfy):
    g = cs.tiny_graph(MODEL)
    del g["5"], g["6"]
    g["61"] = {"class_type": "ModelSave", "inputs": {"model": ["1", 1], "filename_prefix": "diffusion_models/sgld"}}
    message = failure(comfy, g, "61")
    assert "saving the model" in message and MODEL in message, message
    assert not [f for _, _, files in os.walk(os.path.join(comfy.base, "output")) for f in files
                if f.endswith(".safetensors")]


def test_weight_hooks_are_refused_by_name(comfy):
    g = comfy_only(seed=1)
    g["62"] = {"class_type": "CreateHookLoraModelOnly", "inputs": {"lora_name": LORA, "strength_model": 1.0}}
    g["63"] = {"class_type": "ConditioningSetProperties", "inputs": {"cond_NEW": ["2", 0], "strength": 1.0,
                                                                    "set_cond_area": "default", "hooks": ["62", 0]}}
    g["7"]["inputs"]["positive"] = ["63", 0]
    message = failure(comfy, g, "7")
    assert "weight hook" in message and "LoraLoaderModelOnly" in message, message


def test_multigpu_cloning_is_refused_by_name(comfy):
    """The newest ComfyUI's MultiGPU nodes call deepclone_multigpu (the test pack's node calls it here)."""
    g = cs.tiny_graph(MODEL)
    del g["5"], g["6"]
    g["50"] = {"class_type": "SGLDTestModelMemory", "inputs": {"model": ["1", 1], "action": "deepclone_multigpu"}}
    assert "num_gpus" in failure(comfy, g, "50")


@pytest.mark.server
def test_under_a_pin_budget_the_patcher_asks_comfyui_to_pin_nothing(tmp_path):
    server = make_server(str(tmp_path / "comfy-pins"), SGLD_TEST_PIN_BUDGET="1")
    try:
        before = probe(server)
        assert before["pins_2026"] == 0 and before["model_size"] == before["loaded_size"] == 0, before
        assert before["memory_required"] == 0, before
        entry = server.run(ours_and_comfys(seed=3), timeout=240)
        assert entry["status"]["status_str"] == "success", cs.error_message(entry)
        assert close(cs.saved_latent(server, entry, "8"), cs.saved_latent(server, entry, "6"))
        unloaded(server)  # /free still releases the engine (ComfyUI unloads it; the memory hooks too)
        entry = server.run(ours_and_comfys(seed=3), timeout=240)  # and the next run reopens it
        assert entry["status"]["status_str"] == "success", cs.error_message(entry)
    finally:
        server.stop()
