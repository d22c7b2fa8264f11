"""Tensors across the pipe between the parent and rank 0: float32 numpy arrays (plain bytes, so no
shared-memory file descriptors to leak), and back."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..features.lora import LoRATensors


def pack(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy()


def unpack(a, dtype=None, device="cpu"):
    if a is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device=device, dtype=dtype or t.dtype)


def pack_loras(items):
    """[(path or LoRATensors, strength)] as plain data for the ranks (an in-memory LoRA: its tensors packed)."""
    return [(p if isinstance(p, str) else {"name": p.name, "weights": {k: pack(t) for k, t in p.weights.items()},
                                           "origin": dict(p.origin)}, s) for p, s in items]


def unpack_loras(items):
    """pack_loras' items back, on a rank."""
    return [(LoRATensors(p["name"], {k: unpack(a) for k, a in p["weights"].items()}, p["origin"]) if isinstance(p, dict)
             else p, s) for p, s in items]
