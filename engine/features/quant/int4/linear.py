"""The int4 weight format: ``Int4Linear``, how sgld files store it (``X.weight`` U8 [out, in/2] with
``X.weight_scale`` / ``X.weight_zero`` [out, in/group]) and its entry "int4" in the format table (../registry.py)."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ....errors import CheckpointError
from ....io.safetensors import DTYPE_NAMES
from ..numerics import frozen
from ..prequantized import SCALE_DTYPES, QuantPlan
from ..registry import WeightFormat, register_format
from .numerics import dequantize_int4, int4_group, parse_int4, quantize_int4

log = logging.getLogger("sgld.quant")


class Int4Linear(nn.Module):
    """Linear with 4-bit group-wise weights (two per byte), bf16 scale and zero per group."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = self.in_features // scale.shape[-1]
        self.weight = frozen(packed)
        self.weight_scale = frozen(scale)
        self.weight_zero = frozen(zero)
        self.bias = frozen(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: int = 128) -> "Int4Linear":
        return cls(*quantize_int4(weight, group), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.weight, self.weight_scale, self.weight_zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


# -- how a file stores it ----------------------------------------------------------------------------------------
def read_int4_layers(plan: QuantPlan, keys: Set[str]) -> Dict[str, dict]:
    """Every U8 weight with X.weight_scale / X.weight_zero (sgld), its companions checked."""
    ckpt, layers = plan.ckpt, {}
    for k in sorted(keys):  # sorted: the first bad layer reported is the same on every run
        layer = k[: -len(".weight")]
        if (k.endswith(".weight") and ckpt.header(k)[0] == torch.uint8
                and (layer + ".weight_scale" in keys or layer + ".weight_zero" in keys)):
            layers[layer] = _int4_layer(ckpt, layer, keys)
            plan.sources.add("sgld")
    return layers


def _int4_layer(ckpt, layer: str, keys) -> dict:
    wkey = layer + ".weight"
    skey, zkey = layer + ".weight_scale", layer + ".weight_zero"
    for k in (skey, zkey):
        if k not in keys:
            raise CheckpointError(f"{ckpt.where(wkey)}: int4 weight without '{k}' (int4 needs X.weight_scale and "
                                  "X.weight_zero)")
    _, wshape = ckpt.header(wkey)
    if len(wshape) != 2:
        raise CheckpointError(f"{ckpt.where(wkey)}: int4 weight has shape {list(wshape)}; allowed: U8 [out, in/2]")
    out, in_features = wshape[0], 2 * wshape[1]
    for k in (skey, zkey):
        dt, shape = ckpt.header(k)
        if dt not in SCALE_DTYPES or len(shape) != 2 or shape[0] != out or not shape[1] or in_features % shape[1]:
            raise CheckpointError(
                f"{ckpt.where(k)} is {DTYPE_NAMES[dt]} {list(shape)}; int4 weight '{wkey}' {list(wshape)} needs "
                f"[{out}, in/group] with a group size dividing in = {in_features}, of F32, BF16, F16 or F64")
    if ckpt.header(skey)[1] != ckpt.header(zkey)[1]:
        raise CheckpointError(f"{ckpt.where(zkey)} has shape {list(ckpt.header(zkey)[1])}, but '{skey}' has "
                              f"{list(ckpt.header(skey)[1])}; they must match")
    return {"scale_key": skey, "zero_key": zkey, "shape": (out, in_features)}


# -- the table's entry -------------------------------------------------------------------------------------------
def _int4_quantize(weight: torch.Tensor, bias: Optional[torch.Tensor], group: int) -> Optional[Int4Linear]:
    g = int4_group(weight.shape[1], group)
    return Int4Linear.from_dense(weight, bias, g) if g else None


def _int4_bytes(shape: Tuple[int, int], group: int, dense: torch.dtype) -> int:
    n, g = shape[0] * shape[1], int4_group(shape[1], group)
    return n // 2 + 4 * n // g if g else n * dense.itemsize  # two weights a byte, bf16 scale and zero a group


def _int4_concat(parts: List[Int4Linear], bias: Optional[torch.Tensor]) -> Optional[Int4Linear]:
    if any(p.group_size != parts[0].group_size for p in parts):
        return None
    return Int4Linear(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]),
                      torch.cat([p.weight_zero for p in parts]), bias)


def _int4_rows(fused: Int4Linear, start: int, stop: int, bias: Optional[torch.Tensor]) -> Int4Linear:
    return Int4Linear(fused.weight[start:stop].clone(), fused.weight_scale[start:stop].clone(),
                      fused.weight_zero[start:stop].clone(), bias)


def _int4_split(module: Int4Linear, index: int, parts: int, dim: int) -> Int4Linear:
    """Tensor parallel: rank ``index``'s rows (dim 0), or its inputs (dim 1) on the file's group boundaries.
    Where a rank's inputs would cut a group, its slice is dequantized and quantized again in the largest
    group of 128 / 64 / 32 that divides it (int4 noise on top of the file's; logged), else refused."""
    step = (module.out_features if dim == 0 else module.in_features) // parts
    part = slice(index * step, (index + 1) * step)
    if dim == 0:
        return _int4_rows(module, part.start, part.stop, None if module.bias is None else module.bias[part].clone())
    g = module.group_size
    if step % g == 0:
        cols = slice(part.start // g, part.stop // g)
        return Int4Linear(module.weight[:, part.start // 2:part.stop // 2].contiguous(), module.weight_scale[:, cols].contiguous(),
                          module.weight_zero[:, cols].contiguous(), module.bias)
    smaller = int4_group(step, g)
    if not smaller:
        raise ValueError(f"int4 layer [{module.out_features}, {module.in_features}] cannot be split over {parts} ranks "
                         f"along its inputs: {step} inputs a rank is no multiple of its groups of {g} nor of 32; use a "
                         "dense file with quant=..., or ulysses_degree / ring_degree instead of tensor parallel")
    log.warning("int4 layer [%d, %d] over %d ranks: groups of %d cross the ranks' inputs; each rank's %d inputs are "
                "quantized again in groups of %d", module.out_features, module.in_features, parts, g, step, smaller)
    return Int4Linear.from_dense(module.dequantize()[:, part], module.bias, smaller)


INT4 = register_format(WeightFormat(
    "int4", Int4Linear, parse=parse_int4, choices=("int4", "int4-g64"), quantize=_int4_quantize,
    weight_bytes=_int4_bytes, from_stored=lambda p: Int4Linear(p["weight"], p["weight_scale"], p["weight_zero"]),
    dequantize=lambda p: dequantize_int4(p["weight"], p["weight_scale"], p["weight_zero"]),
    read_layers=read_int4_layers, concat=_int4_concat, rows=_int4_rows, split=_int4_split, packed=True,
    dense_why="have an input size that no group of 32/64/128 divides",
    help="4-bit, groups of 128 (int4-g64: 64), weight-only",
    storage="4-bit asymmetric, bf16 scale + zero per group of 128 (int4-g64: 64)",
    compute="unpack + dense GEMM everywhere (torch's int4 kernels are built for decode-size batches, not 4k-token "
            "DiT GEMMs); fused by torch.compile"))
