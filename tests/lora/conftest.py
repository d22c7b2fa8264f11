"""The LoRA tests' shared fixture: the pack's LoRA node in-process (tests/lora/test_lora.py, test_lora_errors.py)."""
import os
import sys

import pack_modules
import pytest
import torch
from lora_files import CFG

# -- ComfyUI node: the handle carries the LoRAs, the base engine is shared ------------------------------------
PACK = "sgld_lora_test_pack"


@pytest.fixture
def pack(monkeypatch, tmp_path):
    """nodes/model_cache.py and nodes/lora.py in-process, with stand-ins for comfy.model_management and folder_paths."""
    import importlib
    import types

    mm = types.ModuleType("comfy.model_management")
    mm.free_memory = lambda memory_required, device, keep_loaded=[]: []
    mm.unload_all_models = lambda: None
    mm.get_free_memory = lambda dev=None, torch_free_too=False: 10**12
    mm.minimum_inference_memory = lambda: 0
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    comfy.model_management = mm
    loras = tmp_path / "loras"
    loras.mkdir()
    fp = types.ModuleType("folder_paths")
    fp.get_filename_list = lambda name: sorted(os.listdir(loras)) if name == "loras" else []
    fp.get_full_path = lambda name, f: str(loras / f) if name == "loras" and (loras / f).exists() else None
    fp.get_folder_paths = lambda name: [str(loras)]
    for name, mod in (("comfy", comfy), ("comfy.model_management", mm), ("folder_paths", fp)):
        monkeypatch.setitem(sys.modules, name, mod)
    pack_modules.install_pack(monkeypatch, PACK)
    # the LoRA Loader's MODEL output needs ComfyUI's model classes, absent here: a stand-in that keeps the handle
    # (tests/test_comfyui_lora_node.py checks the real one in ComfyUI)
    comfy_model = types.ModuleType(PACK + ".nodes.comfy_model")
    comfy_model.comfy_model = lambda handle, engine: types.SimpleNamespace(stand_in_for="MODEL", handle=handle)
    monkeypatch.setitem(sys.modules, comfy_model.__name__, comfy_model)
    mc = importlib.import_module(PACK + ".nodes.model_cache")
    lora_node = importlib.import_module(PACK + ".nodes.lora")
    from engine.models.random_weights import save_random_checkpoint

    path = str(tmp_path / "tiny.safetensors")
    save_random_checkpoint(path, CFG, seed=0, dtype=torch.bfloat16)
    yield types.SimpleNamespace(mc=mc, node=lora_node, path=path, loras=loras,
                                EngineConfig=sys.modules[PACK + ".engine"].EngineConfig)
    mc.release_all("test teardown")
    for k in [k for k in sys.modules if k.startswith(PACK)]:
        sys.modules.pop(k)

