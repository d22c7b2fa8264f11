"""``offload="auto"``: layer-wise when the free memory of the CUDA device is below the model's bytes plus
the working memory (activations, other models); and the size of a checkpoint at rest, from its header.

Decided twice: at load from the model's bytes (the image size is not known yet: a budget for a 1024² CFG
batch), and again before a call whose image is larger (``choose_call_offload``: the family's estimate of that
call's activations against the free memory then), as ComfyUI frees memory per sampling run: fp8 at 2048² on a
12 GB card is resident at 1024² and offloaded at 2048² (docs/memory.md).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Optional, Tuple

import torch

from ... import device as device_rt

log = logging.getLogger("sgld.offload")

MODES = ("none", "layerwise", "auto")
GiB = 2 ** 30
# Working memory that "auto" keeps free besides the weights: activations of a 1024^2 CFG batch of the
# 8B model (~1-2 GiB with memory-efficient attention), the CUDA context and the allocator's slack.
# Override with SGLD_OFFLOAD_WORKING_GB (GiB, 0 to MAX_WORKING_GB).
MIN_WORKING_BYTES = 2 * GiB
WORKING_FRACTION = 0.15
WORKING_ENV = "SGLD_OFFLOAD_WORKING_GB"
MAX_WORKING_GB = 1024.0  # more than any device holds


# A call's working memory: the family's estimate of its activations plus this share (Cache-DiT's kept residuals,
# a LoRA side path's terms, the caching allocator's rounding) plus a workspace (one layer's weight dequantized,
# cuBLAS's workspace); the fake-CUDA trace of every format is within it (docs/memory.md).
CALL_MARGIN = 0.25
CALL_WORKSPACE_BYTES = GiB // 2


def working_override() -> Optional[int]:
    """SGLD_OFFLOAD_WORKING_GB in bytes, None when unset. A value that is not a finite number of GiB from 0 to
    MAX_WORKING_GB is refused (ValueError naming it): a negative one would switch the safety margin off."""
    raw = os.environ.get(WORKING_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_WORKING_GB):
        raise ValueError(f"environment variable {WORKING_ENV}={raw!r} is not valid: it must be a number of GiB from 0 to "
                         f"{MAX_WORKING_GB:g} (unset: at least {MIN_WORKING_BYTES / GiB:g} GiB or "
                         f"{WORKING_FRACTION:.0%} of the model); fix or unset it")
    return int(value * GiB)


def working_bytes(model_bytes: int) -> int:
    """The working memory offload "auto" keeps free at load, besides the model's bytes."""
    override = working_override()
    return max(MIN_WORKING_BYTES, int(WORKING_FRACTION * model_bytes)) if override is None else override


def choose_offload(mode, device, model_bytes: int, free_bytes: Optional[int] = None,
                   resident_bytes: int = 0) -> Tuple[str, str]:
    """("none" | "layerwise", why). ``auto``: layer-wise when the device's free memory (plus what the
    model already holds there, ``resident_bytes``) is below ``model_bytes`` + working memory.
    ``free_bytes`` defaults to the device's (engine/device.py); CPU devices never offload on ``auto``."""
    if mode not in MODES:  # EngineConfig normalizes the spellings (engine/config.py)
        raise ValueError(f"offload '{mode}' is not supported; choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode, ("requested" if mode == "layerwise" else "")
    choice, why = _choose_auto(device, model_bytes, free_bytes, resident_bytes)
    log.info("offload %s", why)
    return choice, why


def _choose_auto(device, model_bytes: int, free_bytes: Optional[int], resident_bytes: int) -> Tuple[str, str]:
    dev = torch.device(device)
    if free_bytes is None:
        free_bytes = device_rt.free_bytes(dev)
        if free_bytes is None:
            return "none", f"auto: {dev} is not a CUDA GPU, nothing to offload"
    available = int(free_bytes) + int(resident_bytes)
    need = int(model_bytes) + working_bytes(model_bytes)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    if available < need:
        return "layerwise", f"auto: {gib(available)} free on {dev} < model {gib(model_bytes)} + working {gib(need - model_bytes)}"
    return "none", f"auto: {gib(available)} free on {dev} >= model {gib(model_bytes)} + working {gib(need - model_bytes)}"


def with_margin(activation_bytes: int) -> int:
    """A call's activations as the model family estimates them, with ``CALL_MARGIN``."""
    return int(activation_bytes * (1 + CALL_MARGIN))


def call_working_bytes(activation_bytes: int) -> int:
    """What offload "auto" keeps free for a call whose activations the model family estimates at this."""
    return with_margin(activation_bytes) + CALL_WORKSPACE_BYTES


def choose_call_offload(device, activation_bytes: int) -> Tuple[str, str]:
    """("none" | "layerwise", why) for a call of a model that ``auto`` kept resident: layer-wise when the call's
    working memory (``call_working_bytes``, or SGLD_OFFLOAD_WORKING_GB) exceeds the device's
    free memory now (the weights are already in use there)."""
    dev = torch.device(device)
    free_bytes = device_rt.free_bytes(dev)
    if free_bytes is None:
        return "none", ""
    override = working_override()
    need = call_working_bytes(activation_bytes) if override is None else override
    why = f"auto: this call needs {need / GiB:.1f} GiB of working memory, {free_bytes / GiB:.1f} GiB free on {dev}"
    return ("layerwise" if free_bytes < need else "none"), why
