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
    except (TypeError, ValueError):
        t = None
    if t not in SUPPORTED:
        name = t.name if t is not None else repr(qtype)
        raise ValueError(f"GGUF type {name} is not supported; supported: {', '.join(NAMES)}")
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
# order as gguf.quants (so the results are equal bit for bit; integers are exact in float32, and their
# offsets are applied in int8 before the one conversion, a byte a value instead of four).
def _q8_0(b):
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, 0:2])


def _q4_0(b):
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b[:, 0:2]) * (q.to(torch.int8) - 16).float()


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
    return (dl * (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()).reshape(n, 256)


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
    q = ((ql | (qh << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    return (d * q).reshape(n, 256)


def _f32(b):
    return b.contiguous().view(torch.float32)


def _f16s(b):
    h = b.contiguous().view(torch.float16)
    out = h.float()
    # torch sets the quiet bit of a signalling NaN, gguf (numpy) keeps the payload as it is: put it back. The
    # check is a device sync, paid only here: the loader reads F16 tensors as torch float16, not per forward.
    if bool(torch.isnan(out).any()):
        signalling = torch.isnan(out) & ((h.view(torch.int16) & 0x200) == 0)
        out = torch.where(signalling, (out.view(torch.int32) & ~0x400000).view(torch.float32), out)
    return out


def _bf16(b):
    # the bits moved into the top half of a float32, as gguf does (exact for every pattern, NaNs included)
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_DECODERS = {Q.F32: _f32, Q.F16: _f16s, Q.BF16: _bf16, Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
             Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
             Q.Q6_K: _q6_k}


def dequantize(raw: torch.Tensor, qtype: int, shape, dtype=torch.float32) -> torch.Tensor:
    """GGUF bytes (a uint8 tensor of any shape) of one tensor of ``shape`` (torch order) -> its values as
    ``dtype`` on ``raw``'s device, decoded in torch (no copy to the host). The blocks run over the values in
    row-major order, so ``shape`` may be a tensor's original shape when it was stored reshaped into rows of
    whole blocks (ComfyUI-GGUF's ``comfy.gguf.orig_shape``): only the count must be whole blocks."""
    t = _check(qtype)
    shape = tuple(int(s) for s in shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"GGUF bytes must be a uint8 tensor, not {getattr(raw, 'dtype', type(raw).__name__)}")
    block, size = GGML_QUANT_SIZES[t]
    count = 1
    for s in shape:
        count *= s
    if count % block:
        raise ValueError(f"a {t.name} tensor holds a multiple of {block} values; shape {list(shape)} has {count}")
    need = count // block * size
    if raw.numel() != need:
        raise ValueError(f"a {t.name} tensor of shape {list(shape)} has {need} bytes, not {raw.numel()}")
    values = _DECODERS[t](raw.detach().reshape(-1, size)).reshape(shape)
    return values if dtype == torch.float32 else values.to(dtype)


# ---- quantizers for the K types (gguf has none): simple, not llama.cpp's. Each sub-block gets the scale (and
# min) of the best of a few candidate ranges; the per-sub-block scales are then stored in 4/6/8 bits against
# one fp16 super-scale, and the values are rounded against the scales as they will be decoded.
_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _keep_better(best, cand):
    """(scale, offset, error) candidates per sub-block: the one of lower error."""
    better = cand[2] < best[2]
    return tuple(torch.where(better, c, b) for b, c in zip(best, cand))


def _sym_fit(x, s, qmin, qmax):
    inv = torch.where(s == 0, torch.zeros_like(s), 1 / s)
    q = torch.round(x * inv).clamp(qmin, qmax)
    return q, ((q * s - x) ** 2).sum(-1, keepdim=True)


def _sym_scales(x: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Sub-blocks x [N, L] -> scales [N] for q in [qmin, qmax]: the best of candidate ranges (the largest
    magnitude mapped to qmin, then shrunk), refined by least squares on its integers."""
    big = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    zero = torch.zeros_like(big)
    best = None
    for f in _FACTORS:
        s = big * (f / qmin)
        cand = (s, zero, _sym_fit(x, s, qmin, qmax)[1])
        best = cand if best is None else _keep_better(best, cand)
    for _ in range(2):  # s = <q, x> / <q, q> for the integers of the best scale
        q, _ = _sym_fit(x, best[0], qmin, qmax)
        qq = (q * q).sum(-1, keepdim=True)
        s = torch.where(qq > 0, (q * x).sum(-1, keepdim=True) / qq.clamp(min=1), best[0])
        best = _keep_better(best, (s, zero, _sym_fit(x, s, qmin, qmax)[1]))
    return best[0].squeeze(-1)


def _asym_fit(x, s, lo, qmax):
    inv = torch.where(s == 0, torch.zeros_like(s), 1 / s)
    q = torch.round((x - lo) * inv).clamp(0, qmax)
    return q, ((q * s + lo - x) ** 2).sum(-1, keepdim=True)


def _asym_scales(x: torch.Tensor, qmax: int):
    """Sub-blocks x [N, L] -> (scales [N] >= 0, mins [N] >= 0) for x ~ scale * q - min, q in [0, qmax]: the
    best of candidate ranges, refined by least squares on its integers (min kept >= 0)."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    best = None
    for f in _FACTORS:
        s = (hi - lo) * (f / qmax)
        cand = (s, lo, _asym_fit(x, s, lo, qmax)[1])
        best = cand if best is None else _keep_better(best, cand)
    n = x.shape[-1]
    for _ in range(2):  # (s, lo) = the least-squares line through the best integers, lo <= 0
        q, _ = _asym_fit(x, best[0], best[1], qmax)
        sq, sx, sqq, sqx = q.sum(-1, keepdim=True), x.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True), \
            (q * x).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 0
        s = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), best[0])
        lo2 = torch.where(ok, (sx - s * sq) / n, best[1])
        pos = lo2 > 0  # the min must stay >= 0: refit the scale alone with lo = 0
        s = torch.where(pos, torch.where(sqq > 0, sqx / sqq.clamp(min=1), s), s)
        lo2 = torch.where(pos, torch.zeros_like(lo2), lo2)
        s = s.clamp(min=0)
        best = _keep_better(best, (s, lo2, _asym_fit(x, s, lo2, qmax)[1]))
    return best[0].squeeze(-1), -best[1].squeeze(-1)


def _super(s: torch.Tensor, top: int, signed: bool):
    """Sub-block scales [nb, k] -> (fp16 super-scale bytes [nb, 2], its float32 value [nb, 1], integer scales
    [nb, k] in [-top-1, top] when signed (the largest magnitude maps to -top-1), else [0, top])."""
    if signed:
        d = s.gather(-1, s.abs().argmax(-1, keepdim=True)) / -(top + 1)
    else:
        d = s.amax(-1, keepdim=True) / top
    d16 = d.to(torch.float16)
    df = d16.float()
    inv = torch.where(df == 0, torch.zeros_like(df), 1 / df)
    sc = torch.round(s * inv).clamp(-top - 1 if signed else 0, top)
    return d16.view(torch.uint8).reshape(-1, 2), df, sc


def _round_q(x, scale, qmin, qmax, offset=None):
    """Values x [nb, k, L] against the decoded scales [nb, k, 1] (and mins) -> integers in [qmin, qmax]."""
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    y = x if offset is None else x + offset
    return torch.round(y * inv).clamp(qmin, qmax).to(torch.uint8 if qmin >= 0 else torch.int16)


def _pack(v: torch.Tensor, groups: int, shifts, width: int) -> torch.Tensor:
    """The inverse of ``_shifted``: values [n, groups * len(shifts) * width] (already masked) -> bytes
    [n, groups * width]."""
    v = v.to(torch.uint8).reshape(v.shape[0], groups, len(shifts), width)
    out = v[:, :, 0] << shifts[0]
    for i in range(1, len(shifts)):
        out = out | (v[:, :, i] << shifts[i])
    return out.reshape(v.shape[0], -1)


def _k_pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_k_scale_min``: eight 6-bit scales and mins [nb, 8] -> 12 bytes."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    d = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    m = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    md = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return torch.cat([d, m, md], dim=-1)


def _asym_k(x: torch.Tensor, sub: int, qmax: int, top: int):
    """Q2_K / Q4_K / Q5_K: blocks [nb, 256] -> (d bytes, dmin bytes, scales, mins, q [nb, 256])."""
    nb = x.shape[0]
    xs = x.reshape(nb, -1, sub)
    s, m = _asym_scales(xs.reshape(-1, sub), qmax)
    d16, df, sc = _super(s.reshape(nb, -1), top, signed=False)
    m16, mf, mn = _super(m.reshape(nb, -1), top, signed=False)
    q = _round_q(xs, (df * sc).unsqueeze(-1), 0, qmax, offset=(mf * mn).unsqueeze(-1))
    return d16, m16, sc, mn, q.reshape(nb, -1)


def _sym_k(x: torch.Tensor, sub: int, qmin: int, qmax: int, top: int):
    """Q3_K / Q6_K: blocks [nb, 256] -> (d bytes, signed scales, q [nb, 256] in [qmin, qmax])."""
    nb = x.shape[0]
    xs = x.reshape(nb, -1, sub)
    s = _sym_scales(xs.reshape(-1, sub), qmin, qmax)
    d16, df, sc = _super(s.reshape(nb, -1), top, signed=True)
    q = _round_q(xs, (df * sc).unsqueeze(-1), qmin, qmax)
    return d16, sc, q.reshape(nb, -1)


def _enc_q2_k(x):
    d16, m16, sc, mn, q = _asym_k(x, 16, 3, 15)
    scales = sc.to(torch.uint8) | (mn.to(torch.uint8) << 4)
    return torch.cat([scales, _pack(q, 2, (0, 2, 4, 6), 32), d16, m16], dim=-1)


def _enc_q3_k(x):
    d16, sc, q = _sym_k(x, 16, -4, 3, 31)
    u = (q + 4).to(torch.uint8)
    v = (sc + 32).to(torch.uint8)
    scales = torch.cat([_pack(v & 15, 1, (0, 4), 8), _pack(v >> 4, 1, (0, 2, 4, 6), 4)], dim=-1)
    return torch.cat([_pack(u >> 2, 1, range(8), 32), _pack(u & 3, 2, (0, 2, 4, 6), 32), scales, d16], dim=-1)


def _enc_q4_k(x):
    d16, m16, sc, mn, q = _asym_k(x, 32, 15, 63)
    return torch.cat([d16, m16, _k_pack_scale_min(sc, mn), _pack(q, 4, (0, 4), 32)], dim=-1)


def _enc_q5_k(x):
    d16, m16, sc, mn, q = _asym_k(x, 32, 31, 63)
    return torch.cat([d16, m16, _k_pack_scale_min(sc, mn), _pack(q >> 4, 1, range(8), 32),
                      _pack(q & 15, 4, (0, 4), 32)], dim=-1)


def _enc_q6_k(x):
    d16, sc, q = _sym_k(x, 16, -32, 31, 127)
    u = (q + 32).to(torch.uint8)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([_pack(u & 15, 2, (0, 4), 64), _pack(u >> 4, 2, (0, 2, 4, 6), 32), scales, d16], dim=-1)


_K_ENCODERS = {Q.Q2_K: _enc_q2_k, Q.Q3_K: _enc_q3_k, Q.Q4_K: _enc_q4_k, Q.Q5_K: _enc_q5_k, Q.Q6_K: _enc_q6_k}


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Float ``weight`` [..., in] -> uint8 GGUF bytes [..., row_bytes(qtype, in)] (rows kept). The types gguf
    can write go through ``gguf.quants.quantize`` (its bytes exactly); the K types through the quantizers
    above (on the weight's device)."""
    t = _check(qtype)
    if weight.dim() == 0:
        weight = weight.reshape(1)
    n = int(weight.shape[-1])
    nb = row_bytes(t, n)
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"cannot quantize to {t.name}: the weight holds NaN or infinite values")
    if t in _K_ENCODERS:
        block, size = GGML_QUANT_SIZES[t]
        out = _K_ENCODERS[t](w.reshape(-1, block))
        assert out.shape[-1] == size and out.dtype == torch.uint8
        return out.reshape(*weight.shape[:-1], nb)
    data = _gq.quantize(w.cpu().numpy().reshape(-1, n), t)
    out = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1, nb))
    return out.reshape(*weight.shape[:-1], nb).to(weight.device)
