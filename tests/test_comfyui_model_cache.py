"""nodes/model_cache.py in-process, with a stand-in for comfy.model_management (no ComfyUI needed):
engines cached per (file, mtime, options), replaced per loader node, released by ComfyUI's memory calls."""
import importlib
import os
import sys
import types

import pytest

try:
    from . import pack_modules
except ImportError:
    import pack_modules

PACK = "sgld_model_cache_pack"


class FakeMM(types.ModuleType):
    """The parts of comfy.model_management that the hooks use."""

    def __init__(self):
        super().__init__("comfy.model_management")
        self.free = 10**12
        self.calls = []

        def free_memory(memory_required, device, keep_loaded=()):
            self.calls.append(("free_memory", memory_required, str(device)))
            return []

        def unload_all_models():
            self.calls.append(("unload_all_models",))
            self.free_memory(1e30, "cpu")  # as ComfyUI does: through the module attribute

        self.free_memory = free_memory
        self.unload_all_models = unload_all_models
        self.get_free_memory = lambda dev=None, torch_free_too=False: self.free
        self.minimum_inference_memory = lambda: 0


@pytest.fixture
def mc(monkeypatch, tmp_path):
    mm = FakeMM()
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    pack_modules.install_pack(monkeypatch, PACK)
    sys.modules.pop(PACK + ".nodes.model_cache", None)
    mod = importlib.import_module(PACK + ".nodes.model_cache")
    assert mod.install_memory_hooks() is True
    assert mod.install_memory_hooks() is True  # idempotent: wrapped once
    assert mm.free_memory.__wrapped__.__name__ == "free_memory" and not hasattr(mm.free_memory.__wrapped__, "__wrapped__")

    from engine.models.random_weights import SIZES, save_random_checkpoint

    path = str(tmp_path / "tiny.safetensors")
    save_random_checkpoint(path, SIZES["tiny"], seed=0)
    mod.mm, mod.path = mm, path
    yield mod
    mod.release_all("test teardown")
    sys.modules.pop(PACK + ".nodes.model_cache", None)


def handle(mc, owner="1", dtype=None):
    config = sys.modules[PACK + ".engine"].EngineConfig(dtype=dtype)
    return mc.SGLDModel(mc.path, config, owner=owner)


def dtypes(mc):
    return sorted(str(m["options"]["dtype"]) for m in mc.loaded())


def test_cached_between_runs(mc):
    a = mc.get_engine(handle(mc))
    assert mc.get_engine(handle(mc)) is a
    assert dtypes(mc) == ["None"]


def test_new_loader_inputs_replace_old_engine(mc):
    mc.get_engine(handle(mc, "1"))
    mc.get_engine(handle(mc, "1", "fp32"))
    assert dtypes(mc) == ["fp32"]
    mc.get_engine(handle(mc, "2", "bf16"))  # another loader node: both stay
    assert dtypes(mc) == ["bf16", "fp32"]
    mc.get_engine(handle(mc, "2", "fp32"))  # node 2 now shares node 1's engine: bf16 is dropped
    assert dtypes(mc) == ["fp32"]


def test_file_change_reloads(mc):
    a = mc.get_engine(handle(mc))
    st = os.stat(mc.path)
    os.utime(mc.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = mc.get_engine(handle(mc))
    assert b is not a and len(mc.loaded()) == 1


def test_unload_all_models_releases(mc):
    mc.get_engine(handle(mc))
    mc.mm.unload_all_models()
    assert mc.loaded() == []
    assert mc.get_engine(handle(mc)) is not None  # the handle stays usable: loaded again
    assert len(mc.loaded()) == 1


def test_memory_pressure_releases_only_when_needed(mc):
    mc.get_engine(handle(mc))
    mc.mm.free = 10**9
    mc.mm.free_memory(10**6, "cpu")  # enough free memory: keep
    assert len(mc.loaded()) == 1
    mc.mm.free_memory(10**10, "cuda:0")  # another device: keep
    assert len(mc.loaded()) == 1
    mc.mm.free_memory(10**10, "cpu")  # not enough on our device: release
    assert mc.loaded() == []


def test_hook_errors_never_break_comfyui(mc):
    mc.get_engine(handle(mc))

    def boom(*a, **k):
        raise RuntimeError("boom")

    mc.mm.get_free_memory = boom
    assert mc.mm.free_memory(10**6, "cpu") == []  # ComfyUI's result, no exception
    assert len(mc.loaded()) == 1


def test_deleted_file_is_a_checkpoint_error(mc):
    h = handle(mc)
    mc.get_engine(h)
    os.remove(mc.path)
    with pytest.raises(sys.modules[PACK + ".engine"].CheckpointError, match="moved or deleted"):
        mc.get_engine(h)
