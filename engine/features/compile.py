"""Regional torch.compile: the repeated DiT block (its family's ``blocks``) is compiled once and reused by every
layer, attached as the "compile" Patch. The blocks share one code object and their parameters are graph
inputs, so ERNIE-Image's 36 layers use ONE graph; the block loop stays eager, so Cache-DiT skipping blocks, offload
and LoRA never recompile. Modes and shapes: docs/attention_compile_quant.md.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import List, Optional, Union

import torch
from torch import nn

from ..models.family import family_of
from . import patching

SHAPES = ("static", "dynamic")  # EngineConfig.compile: one graph per resolution, or one dynamic-shape graph
log = logging.getLogger("sgld.compile")

FEATURE = "compile"
RECOMPILE_LIMIT = 32  # a handful of resolutions stays compiled (torch's default of 8 falls back to eager)
GPU_MODE = "max-autotune-no-cudagraphs"


def default_mode(device) -> Optional[str]:
    env = os.environ.get("SGLD_COMPILE_MODE")
    if env:
        return None if env.lower() == "default" else env
    return GPU_MODE if torch.device(device).type == "cuda" else None


def _blocks(model: nn.Module) -> List[nn.Module]:
    """The blocks the loop runs (``Family.loop_names``: the main list, and the lists a family's loop runs after it)."""
    return [block for name in family_of(model).loop_names for block in getattr(model, name)]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class CompiledBlocks(patching.Patch):
    """The "compile" Patch: every block compiled with ``nn.Module.compile`` (torch's own per-module slot)."""

    name = FEATURE

    def __init__(self, model: nn.Module, shapes: str, mode: str, backend: str):
        super().__init__(model)
        self.shapes, self.mode, self.backend = shapes, mode, backend

    def remove(self) -> None:
        model = self.model
        for block in [] if model is None else _blocks(model):
            block._compiled_call_impl = None

    def describe(self) -> dict:
        model = self.model
        return {"mode": self.mode, "shapes": self.shapes, "backend": self.backend,
                "blocks": 0 if model is None else len(_blocks(model))}


def compile_blocks(model: nn.Module, shapes: Union[bool, str] = "static", mode: Optional[str] = "auto",
                   backend: str = "inductor", fullgraph: bool = False) -> List[str]:
    """Compile every block of ``model`` in place (one shared graph). Returns warnings.

    ``shapes``: True / "static" (dynamic=False) or "dynamic" (automatic dynamic shapes).
    ``mode``: "auto" = ``default_mode(device)``; any torch.compile mode, or None for the default."""
    if shapes is True:
        shapes = "static"
    if shapes not in SHAPES:
        raise ValueError(f"compile '{shapes}' is not supported; choose static or dynamic")
    device = _device_of(model)
    if mode == "auto":
        mode = default_mode(device)
    if backend != "inductor":
        mode = None
    warnings: List[str] = []
    if device.type == "cpu" and backend == "inductor":
        if not any(shutil.which(cc) for cc in ("gcc", "cc", "clang", "g++")):
            msg = "compile: no C compiler found for CPU inductor; the model runs eagerly"
            log.warning(msg)
            return [msg]
    dyn = False if shapes == "static" else None
    cfg = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, limit_name) < RECOMPILE_LIMIT:
        setattr(cfg, limit_name, RECOMPILE_LIMIT)
    patching.detach(model, FEATURE)  # compiled again with these settings
    for block in _blocks(model):
        block.compile(backend=backend, mode=mode, dynamic=dyn, fullgraph=fullgraph)
    patching.attach(model, CompiledBlocks(model, shapes, mode or "default", backend))
    log.info("compile: %d blocks share one %s graph (mode %s, %s shapes)", len(_blocks(model)), backend, mode or "default", shapes)
    return warnings


def uncompile_blocks(model: nn.Module) -> bool:
    """The blocks run eagerly again. False when they were not compiled."""
    return patching.detach(model, FEATURE)


def is_compiled(model: nn.Module) -> bool:
    return patching.get(model, FEATURE) is not None and any(
        getattr(b, "_compiled_call_impl", None) is not None for b in _blocks(model))


def graph_count() -> int:
    """Graphs compiled by dynamo in this process since the last ``reset_counters()``."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> dict:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def reset_counters(clear_caches: bool = False) -> None:
    from torch._dynamo.utils import counters

    if clear_caches:
        torch._dynamo.reset()
    counters.clear()
