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


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high ones (the Q4_0 ... Q5_1 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] of 0/1: bit i of the little-endian word (byte i // 8, bit i % 8)."""
    return torch.stack([(qh >> i) & 1 for i in range(8)], dim=-1).reshape(qh.shape[0], -1)


def _shifted(x: torch.Tensor, shifts, mask: int) -> torch.Tensor:
    """[n, g, w] bytes -> [n, g, len(shifts), w]: each byte shifted right by each shift, masked."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def _k_scale_min(s: torch.Tensor):
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, as float32 [n, 8, 1]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


# Each decoder: blocks [n, type_size] uint8 -> [n, block] float32, the same float32 operations in the same
# order as gguf.quants (so the results are equal bit for bit; integers are exact in float32).
def _q8_0(b):
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, 0:2])


def _q4_0(b):
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b):
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b[:, 0:2]) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    dl = (_f16(b[:, 80:82]) * (scales & 15).float()).unsqueeze(-1)
    ml = (_f16(b[:, 82:84]) * (scales >> 4).float()).unsqueeze(-1)
    q = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    lo = _shifted(s[:, 0:8].reshape(n, 1, 8), (0, 4), 15).reshape(n, 16)
    hi = _shifted(s[:, 8:12].reshape(n, 1, 4), (0, 2, 4, 6), 3).reshape(n, 16)
    dl = (_f16(b[:, 108:110]) * ((lo | (hi << 4)).float() - 32)).unsqueeze(-1)
    ql = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = _shifted(hmask.reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16) ^ 1
    return (dl * (ql.float() - (qh << 2).float())).reshape(n, 256)


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = _f16(b[:, 0:2]).unsqueeze(-1) * sc
    dm = _f16(b[:, 2:4]).unsqueeze(-1) * mn
    q = _shifted(b[:, 16:144].reshape(n, 4, 32), (0, 4), 15).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = _f16(b[:, 0:2]).unsqueeze(-1) * sc
    dm = _f16(b[:, 2:4]).unsqueeze(-1) * mn
    ql = _shifted(b[:, 48:176].reshape(n, 4, 32), (0, 4), 15).reshape(n, 8, 32)
    qh = _shifted(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    ql = _shifted(b[:, 0:128].reshape(n, 2, 64), (0, 4), 15).reshape(n, 8, 32)
    qh = _shifted(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).float() - 32).reshape(n, 16, 16)
    return (d * q).reshape(n, 256)


def _f32(b):
    return b.contiguous().view(torch.float32)


def _f16s(b):
    return b.contiguous().view(torch.float16).float()


def _bf16(b):
    # the bits moved into the top half of a float32, as gguf does (exact for every pattern, NaNs included)
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_DECODERS = {Q.F32: _f32, Q.F16: _f16s, Q.BF16: _bf16, Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
             Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
             Q.Q6_K: _q6_k}


def dequantize(raw: torch.Tensor, qtype: int, shape, dtype=torch.float32) -> torch.Tensor:
    """GGUF bytes (a uint8 tensor of any shape) of one tensor of ``shape`` (torch order) -> its values as
    ``dtype`` on ``raw``'s device, decoded in torch (no copy to the host)."""
    t = _check(qtype)
    shape = tuple(int(s) for s in shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"GGUF bytes must be a uint8 tensor, not {getattr(raw, 'dtype', type(raw).__name__)}")
    need = tensor_bytes(t, shape)
    if raw.numel() != need:
        raise ValueError(f"a {t.name} tensor of shape {list(shape)} has {need} bytes, not {raw.numel()}")
    size = GGML_QUANT_SIZES[t][1]
    values = _DECODERS[t](raw.detach().reshape(-1, size)).reshape(shape)
    return values if dtype == torch.float32 else values.to(dtype)


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
