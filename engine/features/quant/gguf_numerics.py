"""GGUF block formats: bytes <-> values for the types ERNIE-Image GGUF files use (F32 ... Q6_K).

``dequantize`` turns one tensor's GGUF bytes into values on the bytes' device; ``quantize`` writes the
bytes. Both agree with the ``gguf`` package (its numpy code is the reference; docs/quantization.md)."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

Q = GGMLQuantizationType
SUPPORTED: Tuple[int, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                              Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
NAMES: Dict[str, int] = {Q(t).name.lower(): int(t) for t in SUPPORTED}  # "q8_0" -> Q.Q8_0, ...


def _check(qtype) -> Q:
    try:
        t = Q(int(qtype))
    except ValueError:
        t = None
    if t not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype!r} is not supported; supported: {', '.join(NAMES)}")
    return t


def type_name(qtype) -> str:
    return _check(qtype).name


def block_size(qtype) -> Tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[_check(qtype)]


def row_bytes(qtype, n: int) -> int:
    """Bytes of a row of ``n`` values; ValueError when ``n`` is not a whole number of blocks."""
    block, size = block_size(qtype)
    if n <= 0 or n % block:
        raise ValueError(f"a {type_name(qtype)} row holds a multiple of {block} values, not {n}")
    return n // block * size


def tensor_bytes(qtype, shape) -> int:
    """Bytes of a tensor of ``shape`` (torch order, the last dimension the rows)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        shape = (1,)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * row_bytes(qtype, shape[-1])


def dequantize(raw: torch.Tensor, qtype: int, shape, dtype=torch.float32) -> torch.Tensor:
    """GGUF bytes (a uint8 tensor of any shape) of one tensor of ``shape`` (torch order) -> its values as
    ``dtype`` on ``raw``'s device."""
    t = _check(qtype)
    shape = tuple(int(s) for s in shape)
    if raw.dtype != torch.uint8:
        raise ValueError(f"GGUF bytes must be a uint8 tensor, not {raw.dtype}")
    need = tensor_bytes(t, shape)
    if raw.numel() != need:
        raise ValueError(f"a {t.name} tensor of shape {list(shape)} has {need} bytes, not {raw.numel()}")
    data = raw.detach().reshape(-1).cpu().numpy().reshape(-1, row_bytes(t, shape[-1] if shape else 1))
    values = _gq.dequantize(data, t).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(device=raw.device, dtype=dtype)


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Float ``weight`` [..., in] -> uint8 GGUF bytes [..., row_bytes(qtype, in)] (rows kept)."""
    t = _check(qtype)
    if weight.dim() == 0:
        weight = weight.reshape(1)
    n = int(weight.shape[-1])
    nb = row_bytes(t, n)
    w = weight.detach().to(device="cpu", dtype=torch.float32).numpy().reshape(-1, n)
    data = _gq.quantize(w, t)
    out = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1, nb))
    return out.reshape(*weight.shape[:-1], nb)
