"""int4 numerics: asymmetric 4-bit weights, groups along the input, a bf16 scale and zero per group, two weights
a byte (torch's int4pack convention)."""
from __future__ import annotations

import re
from typing import Optional, Tuple

import torch

INT4_GROUPS = (32, 64, 128, 256)


def parse_int4(text: str) -> Optional[int]:
    """"int4" | "int4-g64" | "int4_g128" ... -> the group size (128 when not given); None for other names."""
    m = re.fullmatch(r"int4(?:[-_]g(\d+))?", text)
    if not m:
        return None
    g = int(m.group(1) or 128)
    if g not in INT4_GROUPS:
        raise ValueError(f"int4 group size {g} is not supported; use 64 or 128")
    return g


def int4_group(in_features: int, group: int) -> int:
    """The group size used for a layer: ``group`` if it divides in_features, else the largest of 64, 32."""
    for g in (group, 64, 32):
        if g <= group and in_features % g == 0:
            return g
    return 0


def quantize_int4(w: torch.Tensor, group: int = 128) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed uint8 [out, in/2], scale bf16 [out, in/g], zero bf16 [out, in/g]).

    Asymmetric per group: w ~ (q - 8) * scale + zero with q in 0..15 (torch's int4pack convention).
    Scale and zero are rounded to bf16 first and q is chosen against the rounded values."""
    n, k = w.shape
    if k % group or k % 2:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group size {group}")
    wg = w.float().reshape(n, k // group, group)
    mn, mx = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((mx - mn) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zero = (mn + 8 * scale.float()).to(torch.bfloat16)
    q = ((wg - zero.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return packed.contiguous(), scale, zero


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> uint8 values 0..15 [out, in]."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = packed.shape[0]
    groups = scale.shape[-1]
    q = unpack_int4(packed).reshape(n, groups, -1).to(dtype)
    return ((q - 8) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]).reshape(n, -1)
