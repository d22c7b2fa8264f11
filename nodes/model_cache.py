"""Loaded engines, cached between runs and released when ComfyUI frees memory.

An ``SGLD_MODEL`` value (:class:`SGLDModel`) is a small handle: file path + ``EngineConfig``. The
``engine.Engine`` it stands for lives here, keyed by (file, mtime, size, options):

- a second run with the same loader inputs finds the engine here (no reload);
- when a loader node's inputs change, the engine it loaded before is dropped (a new key replaces
  the old one for that node), unless another loader node still uses it;
- when ComfyUI frees memory (``POST /free`` with ``unload_models`` or ``free_memory``, an OOM, or a
  model load that needs more memory than is free on the engine's device), every engine on that
  device is dropped. The handle stays valid: the next run loads the file again.

ComfyUI never sees these engines in ``comfy.model_management.current_loaded_models``, so the hook
is a wrapper around ``comfy.model_management.free_memory`` and ``unload_all_models``
(:func:`install_memory_hooks`), which ComfyUI calls through the module attribute.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Dict, Optional

import torch

from ..engine import CheckpointError, Engine, EngineConfig, open_engine

log = logging.getLogger("sgldiffusion")

_lock = threading.RLock()
_engines: Dict[tuple, Engine] = {}
_owners: Dict[str, tuple] = {}  # loader node id -> key of the engine it loaded last
FULL_UNLOAD = 1e29  # unload_all_models() asks free_memory() for 1e30 bytes


class SGLDModel:
    """The SGLD_MODEL type: which file, with which engine options, and which LoRAs. Cheap to copy and to cache.

    ``loras`` ((path, strength), ...) is part of the handle but not of the engine's cache key: handles
    of the same base with different LoRAs share one engine (one copy of the base weights), and
    ``engine()`` makes the handle's LoRA set the active one before it returns (``Engine.set_loras``:
    a no-op when it already is, an exact restore for a handle without LoRAs)."""

    def __init__(self, path: str, config: EngineConfig, name: str = "", owner: Optional[str] = None, loras=()):
        self.path = path
        self.config = config
        self.name = name or os.path.basename(path)
        self.owner = owner
        self.loras = tuple(loras)

    def with_lora(self, path: str, strength: float) -> "SGLDModel":
        """A new handle: this one plus a LoRA (this handle is not changed)."""
        return SGLDModel(self.path, self.config, self.name, self.owner, self.loras + ((path, float(strength)),))

    def engine(self) -> Engine:
        engine = get_engine(self)
        with _lock:
            if self.loras or engine.loras:
                engine.set_loras(list(self.loras))
        return engine

    def __repr__(self) -> str:
        extra = "".join(f", lora {os.path.basename(getattr(p, 'name', p))} x{s:g}" for p, s in self.loras)
        return f"SGLDModel({self.name!r}, {self.config}{extra})"


def cache_key(path: str, config: EngineConfig) -> tuple:
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the model file ({e.strerror}); was it moved or deleted?") from None
    return (os.path.realpath(path), st.st_mtime_ns, st.st_size, config.key())


def _drop(key: tuple, reason: str) -> None:
    for owner in [o for o, k in _owners.items() if k == key]:  # a loader that held it holds nothing now
        del _owners[owner]
    engine = _engines.pop(key, None)
    if engine is not None:
        engine.release()  # offload buffers, worker processes, CUDA cache: gone now, not at garbage collection
        log.info("SGLDiffusion: released %s (%s)", os.path.basename(key[0]), reason)


def drop_engine(handle: SGLDModel, reason: str) -> None:
    """Release the engine of ``handle``'s file and options if it is loaded (the next use reloads it)."""
    try:
        key = cache_key(handle.path, handle.config)
    except CheckpointError:
        return
    with _lock:
        if key in _engines:
            _drop(key, reason)
    gc.collect()


def find_engine(handle: SGLDModel) -> Optional[Engine]:
    """The engine for ``handle`` if it is loaded now; None otherwise (never loads)."""
    try:
        key = cache_key(handle.path, handle.config)
    except CheckpointError:
        return None
    with _lock:
        return _engines.get(key)


def get_engine(handle: SGLDModel) -> Engine:
    """The engine for ``handle``: from the cache, or loaded now (errors: engine.CheckpointError)."""
    key = cache_key(handle.path, handle.config)
    with _lock:
        if handle.owner is not None:
            old = _owners.get(handle.owner)
            _owners[handle.owner] = key
            if old is not None and old != key and old not in _owners.values():
                _drop(old, "the loader's inputs changed")
                gc.collect()
        engine = _engines.get(key)
        if engine is None:
            _make_room(handle)
            log.info("SGLDiffusion: loading %s (%s)", handle.path, handle.config)
            engine = open_engine(handle.path, handle.config)
            _engines[key] = engine
        return engine


def _make_room(handle: SGLDModel) -> None:
    """Ask ComfyUI to free about the file's size on the target device first (as load_models_gpu does)."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return
    try:
        need = os.path.getsize(handle.path) * 1.2 + mm.minimum_inference_memory()
        mm.free_memory(need, torch.device(handle.config.device))
    except Exception:
        log.debug("SGLDiffusion: free_memory before loading failed", exc_info=True)


def loaded() -> list:
    """What is in memory now (for the status route and the tests)."""
    with _lock:
        return [_entry(k, e.describe()) for k, e in _engines.items()]


def _entry(key: tuple, described: dict) -> dict:
    parallel = described["parallel"]
    return {"file": key[0], "name": os.path.basename(key[0]), "options": {n: _plain(v) for n, v in key[3]},
            "device": described["device"], "attention": described["attention"],
            "loras": [[os.path.basename(p), s] for p, s in described["loras"]],
            "worker_pids": parallel["worker_pids"] if parallel else []}  # parallel: the rank processes


def _plain(v):
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def release_all(reason: str = "released", device=None) -> int:
    """Drop every cached engine (on ``device`` if given); returns how many were dropped."""
    with _lock:
        keys = [k for k, e in _engines.items() if device is None or _same_device(e.device, device)]
        for k in keys:
            _drop(k, reason)
    if keys:
        gc.collect()
    return len(keys)


def _same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def install_memory_hooks() -> bool:
    """Make ComfyUI's own memory release reach our engines. Idempotent; returns True if installed."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return False
    orig_free = getattr(mm, "free_memory", None)
    orig_unload = getattr(mm, "unload_all_models", None)
    if orig_free is None or orig_unload is None:
        log.warning("SGLDiffusion: comfy.model_management has no free_memory/unload_all_models; "
                    "cached engines are only released when the loader's inputs change")
        return False
    if getattr(orig_free, "_sgld_release", None) is release_all:
        return True

    def free_memory(memory_required, device, *args, **kwargs):
        result = orig_free(memory_required, device, *args, **kwargs)
        try:
            if _engines:
                if memory_required >= FULL_UNLOAD:
                    release_all("ComfyUI unloaded all models", device)
                elif mm.get_free_memory(device) < memory_required:
                    release_all("ComfyUI needs the memory", device)
        except Exception:  # never break ComfyUI's memory management
            log.exception("SGLDiffusion: releasing cached engines failed")
        return result

    def unload_all_models(*args, **kwargs):
        result = orig_unload(*args, **kwargs)
        try:
            release_all("ComfyUI unloaded all models")
        except Exception:
            log.exception("SGLDiffusion: releasing cached engines failed")
        return result

    for f, orig in ((free_memory, orig_free), (unload_all_models, orig_unload)):
        f.__wrapped__ = orig
        f.__doc__ = orig.__doc__
        f._sgld_release = release_all
    mm.free_memory = free_memory
    mm.unload_all_models = unload_all_models
    return True
