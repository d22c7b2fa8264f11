"""Regional torch.compile: the repeated ERNIE-Image block is compiled once and reused by every layer.

Each ``model.layers[i]`` gets ``nn.Module.compile``. All blocks share one code object and their
parameters are graph inputs (dynamo inlines built-in nn.Modules), so the 36 layers of the 8B model
use ONE compiled graph: compile time is one block's, not the model's. Embedding, unembedding and
the block loop stay eager, which is what lets wrappers change the loop without recompiling:
Cache-DiT (engine/features/cache) skipping middle blocks on some steps just calls fewer compiled blocks.

Modes
  device   GPU: inductor ``max-autotune-no-cudagraphs`` (autotuned GEMM / Triton kernels; CUDA graphs
           off because offload, caching and parallel wrappers change what runs between blocks).
           CPU: plain inductor (C++ kernels; needs a C compiler).
           ``SGLD_COMPILE_MODE`` overrides the mode (e.g. "default" to skip autotuning).
  shapes   "static" (``compile=True``): ``dynamic=False``; the first call of a new shape (resolution,
           batch, text length) compiles exactly one more graph for it, and any shape seen before
           never recompiles. Best kernels; one compile per resolution you use.
           "dynamic": the first graph is static and the first new shape compiles ONE extra graph with
           symbolic sizes that every later resolution reuses (torch's automatic dynamic shapes).
  A run whose text is padded (CFG with prompts of different lengths) passes an attention mask and
  one that is not padded passes none; these are separate graphs of the same block.
  The recompile limit is raised to ``RECOMPILE_LIMIT`` so that a handful of resolutions stays
  compiled instead of silently falling back to eager at torch's default of 8.

Attention kernels outside torch (sage, flash) are custom ops (engine/features/attention.py), so they stay in
the graph; FP8 / INT4 linears (engine/features/quant.py) trace as plain torch ops and their dequantization
is fused by inductor.
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional, Union

import torch
from torch import nn

SHAPES = ("static", "dynamic")  # EngineConfig.compile: one graph per resolution, or one dynamic-shape graph
log = logging.getLogger("sgld.compile")

RECOMPILE_LIMIT = 32
GPU_MODE = "max-autotune-no-cudagraphs"


def default_mode(device) -> Optional[str]:
    env = os.environ.get("SGLD_COMPILE_MODE")
    if env:
        return None if env.lower() == "default" else env
    return GPU_MODE if torch.device(device).type == "cuda" else None


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def compile_blocks(model: nn.Module, shapes: Union[bool, str] = "static", mode: Optional[str] = "auto",
                   backend: str = "inductor", fullgraph: bool = False) -> List[str]:
    """Compile every block of ``model.layers`` in place (one shared graph). Returns warnings.

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
        from shutil import which

        if not (which("gcc") or which("cc") or which("clang") or which("g++")):
            msg = "compile: no C compiler found for CPU inductor; the model runs eagerly"
            log.warning(msg)
            return [msg]
    dyn = False if shapes == "static" else None
    cfg = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, limit_name) < RECOMPILE_LIMIT:
        setattr(cfg, limit_name, RECOMPILE_LIMIT)
    for block in model.layers:
        block.compile(backend=backend, mode=mode, dynamic=dyn, fullgraph=fullgraph)
    model._sgld_compile = {"shapes": shapes, "mode": mode or "default", "backend": backend}
    log.info("compile: %d blocks share one %s graph (mode %s, %s shapes)", len(model.layers), backend, mode or "default", shapes)
    return warnings


def uncompile_blocks(model: nn.Module) -> None:
    for block in model.layers:
        block._compiled_call_impl = None
    model.__dict__.pop("_sgld_compile", None)


def is_compiled(model: nn.Module) -> bool:
    return bool(getattr(model, "_sgld_compile", None)) and any(
        getattr(b, "_compiled_call_impl", None) is not None for b in model.layers)


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
