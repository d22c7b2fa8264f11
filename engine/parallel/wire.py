"""Tensors across the pipe between the parent and rank 0: float32 numpy arrays (plain bytes, so no
shared-memory file descriptors to leak), and back."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def pack(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy()


def unpack(a, dtype=None, device="cpu"):
    if a is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device=device, dtype=dtype or t.dtype)
