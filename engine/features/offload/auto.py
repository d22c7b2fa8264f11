"""``offload="auto"``: layer-wise when the free memory of the CUDA device is below the model's bytes plus
the working memory (activations, other models); and the size of a checkpoint at rest, from its header.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch

from ... import device as device_rt

log = logging.getLogger("sgld.offload")

MODES = ("none", "layerwise", "auto")
GiB = 2 ** 30
# Working memory that "auto" keeps free besides the weights: activations of a 1024^2 CFG batch of the
# 8B model (~1-2 GiB with memory-efficient attention), the CUDA context and the allocator's slack.
# Override with SGLD_OFFLOAD_WORKING_GB.
MIN_WORKING_BYTES = 2 * GiB
WORKING_FRACTION = 0.15


def working_bytes(model_bytes: int) -> int:
    env = os.environ.get("SGLD_OFFLOAD_WORKING_GB")
    if env:
        return int(float(env) * GiB)
    return max(MIN_WORKING_BYTES, int(WORKING_FRACTION * model_bytes))


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

