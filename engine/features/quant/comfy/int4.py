"""ComfyUI's 4-bit integer layers as weight formats (../registry.py): "convrot-w4a4" and "asym-w4a8-int8" (weights
stored in ConvRot's rotated basis: groups of inputs times a Hadamard matrix) and "awq-w4a16" (AWQ's unsigned
4-bit values with a scale and a zero point per group), read from ComfyUI's layout (reader.py; the tensors in
numerics.py). A layer keeps the stored bytes and scales as frozen parameters (offload streams them, a LoRA is a
side path on them) and computes with comfy-kitchen: on CPU the rotated formats' forward dequantizes the weight
with its dequantizer and runs one dense GEMM (faster here than its eager W4A4 / W4A8 linears, which emulate the
integer GEMMs: bench/speed/comfy_formats_bench.py), on CUDA its kernels where a probe says they run and agree
(``prepare``); AWQ runs its ``gemv_awq_w4a16`` (a dequantization and a GEMM) on every device. Why and the limits: docs/quantization.md ("ComfyUI's quantized files")."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..numerics import frozen
from ..registry import WeightFormat, register_format
from . import numerics as N
from .linear import KITCHEN_LINEARS, ComfyLinear, split_step, with_tag
from .reader import read_layers


def rotation_for(inputs: int, sizes=(256, 64, 16)) -> int:
    """The ConvRot group a writer uses for a layer: the largest of ``sizes`` dividing its inputs (0: none)."""
    return next((g for g in sizes if inputs % g == 0), 0)


def _meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class ConvRotW4A4Linear(ComfyLinear):
    """Signed int4 weights (rotated), one F32 scale a row. ComfyUI's kernel also quantizes the rotated activations
    to int4 per token (``linear_dtype`` int4, or int8), an int4 GEMM (CUDA sm75+)."""

    FORMAT = "convrot_w4a4"
    KITCHEN_OP = "convrot_w4a4_linear"
    MIN_SM = (7, 5)
    PROBE_ERROR = 0.3  # int4 activations: the kernel's own error against the dequantized weight

    def __init__(self, weight, weight_scale, rotation: int, linear_dtype: str = "int4", bias=None):
        super().__init__()
        self._setup((weight.shape[0], weight.shape[1] * 2), bias)
        self.weight = frozen(weight)
        self.weight_scale = frozen(weight_scale.reshape(-1))
        self.rotation, self.linear_dtype = int(rotation), linear_dtype

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "ConvRotW4A4Linear":
        rotation = rotation_for(weight.shape[1], (256, 64))
        if weight.is_meta:  # sgld quantize asks for the stored tensors' shapes first
            n, k = weight.shape
            return cls(_meta((n, k // 2), torch.int8), _meta((n,)), rotation, bias=bias)
        return cls(*N.quantize_convrot_w4a4(weight, rotation), rotation, bias=bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return N.dequantize_convrot_w4a4(self.weight, self.weight_scale, self.rotation, dtype)

    def kitchen_forward(self, x2: torch.Tensor, bias) -> torch.Tensor:
        return N.kitchen().convrot_w4a4_linear(x2, self.weight, self.weight_scale.float(), bias, self.rotation,
                                               N.W4A4_GROUP, self.linear_dtype)

    def layout_tag(self) -> dict:
        return {"convrot_groupsize": self.rotation, **({"linear_dtype": self.linear_dtype} if self.linear_dtype != "int4" else {})}

    def part(self, rows: slice, cols: slice) -> "ConvRotW4A4Linear":
        weight = self.weight[rows, cols.start // 2: cols.stop // 2].contiguous()
        return ConvRotW4A4Linear(weight, self.weight_scale[rows].clone(), self.rotation, self.linear_dtype, self.bias)


class W4A8Linear(ComfyLinear):
    """ConvRot-rotated 4-bit codes (a 16-level codebook, or uniform) or 6-bit ones, a relative scale per group
    (``weight_s_rel``) and an F32 scale a row (``weight_s_channel``): ComfyUI decodes them to int8 and runs a
    W8A8 GEMM on the rotated activations (CUDA sm80+)."""

    FORMAT = "asym_w4a8_int8"
    KITCHEN_OP = "w4a8_int8_linear"
    MIN_SM = (8, 0)
    PROBE_ERROR = 0.1

    def __init__(self, weight, s_rel, s_channel, codebook, group: int, rotation: int, bias=None):
        super().__init__()
        self._setup((weight.shape[0], s_rel.shape[1] * group), bias)
        self.weight = frozen(weight)
        self.weight_s_rel = frozen(s_rel)
        self.weight_s_channel = frozen(s_channel.reshape(-1))
        self.weight_codebook = None if codebook is None else frozen(codebook.reshape(-1))
        self.group, self.rotation = int(group), int(rotation)
        self.bits = weight.shape[1] * 8 // self.in_features

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "W4A8Linear":
        rotation = rotation_for(weight.shape[1])
        if weight.is_meta:
            n, k = weight.shape
            return cls(_meta((n, k // 2), torch.int8), _meta((n, k // 16), torch.float8_e4m3fn), _meta((n,)),
                       _meta((16,)), 16, rotation, bias=bias)
        return cls(*N.quantize_w4a8(weight, 16, rotation), 16, rotation, bias=bias)

    def _codebook(self):
        return None if self.weight_codebook is None else self.weight_codebook.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return N.dequantize_w4a8(self.weight, self.weight_s_rel, self.weight_s_channel.float(), self._codebook(),
                                 self.group, self.rotation, dtype)

    def kitchen_forward(self, x2: torch.Tensor, bias) -> torch.Tensor:
        return N.kitchen().w4a8_int8_linear(x2, self.weight, self.weight_s_rel, self.weight_s_channel.float(),
                                            self._codebook(), None, bias, self.group, self.rotation, x2.dtype)

    def layout_tag(self) -> dict:
        return {"group_size": self.group, "convrot_groupsize": self.rotation}

    def part(self, rows: slice, cols: slice) -> "W4A8Linear":
        k = self.in_features
        weight = self.weight[rows, cols.start // 2: cols.stop // 2]
        if self.bits == 6:  # the 2-bit plane after the nibbles: four values a byte
            weight = torch.cat([weight, self.weight[rows, k // 2 + cols.start // 4: k // 2 + cols.stop // 4]], dim=1)
        s_rel = self.weight_s_rel[rows, cols.start // self.group: cols.stop // self.group]
        return W4A8Linear(weight.contiguous(), s_rel.contiguous(), self.weight_s_channel[rows].clone(), self.weight_codebook,
                          self.group, self.rotation, self.bias)


class AWQW4A16Linear(ComfyLinear):
    """Unsigned int4 weights, a scale and a zero point per group of inputs and output ([in / group, out], the
    compute dtype): w = (q - 8) * scale + zero; weight-only. Offline-calibrated (comfy-kitchen has no quantizer)."""

    FORMAT = "awq_w4a16"

    def __init__(self, weight, weight_scale, weight_zeros, group: int, bias=None):
        super().__init__()
        self._setup((weight.shape[0], weight.shape[1] * 2), bias)
        self.weight = frozen(weight)
        self.weight_scale = frozen(weight_scale)
        self.weight_zeros = frozen(weight_zeros)
        self.group = int(group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return N.dequantize_awq(self.weight, self.weight_scale, self.weight_zeros, self.group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """comfy-kitchen's ``gemv_awq_w4a16`` (ComfyUI's compute: dequantized in the scales' dtype, then a GEMM; a
        little faster than the float32 dequantization) when the activations have that dtype; else (float32
        activations) the dequantized path, which keeps their precision."""
        if self.full_precision or x.dtype != self.weight_scale.dtype:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return N.kitchen().gemv_awq_w4a16(x, self.weight, self.weight_scale, self.weight_zeros, bias, self.group)

    def layout_tag(self) -> dict:
        return {"group_size": self.group}

    def part(self, rows: slice, cols: slice) -> "AWQW4A16Linear":
        groups = slice(cols.start // self.group, cols.stop // self.group)
        return AWQW4A16Linear(self.weight[rows, cols.start // 2: cols.stop // 2].contiguous(),
                              self.weight_scale[groups, rows].contiguous(), self.weight_zeros[groups, rows].contiguous(),
                              self.group, self.bias)


KITCHEN_LINEARS.extend([ConvRotW4A4Linear, W4A8Linear])


# -- the table's entries ------------------------------------------------------------------------------------------
def _rows(fused, start: int, stop: int, bias):
    part = fused.part(slice(start, stop), slice(0, fused.in_features))
    part.bias = None if bias is None else frozen(bias)
    part.full_precision, part.use_kitchen = fused.full_precision, fused.use_kitchen
    return part


def _split(module, index: int, parts: int, dim: int):
    """Tensor parallel: rank ``index``'s share, on whole groups of inputs (the rotation's and the scales')."""
    unit = 1 if dim == 0 else math.lcm(getattr(module, "rotation", 1), getattr(module, "group", 1),
                                       32 if getattr(module, "bits", 4) == 6 else 2)
    step = split_step(module, parts, dim, unit, "groups (ConvRot / scale groups)")
    part = slice(index * step, (index + 1) * step)
    if dim == 0:
        return _rows(module, part.start, part.stop, None if module.bias is None else module.bias[part].clone())
    split = module.part(slice(0, module.out_features), part)
    split.full_precision, split.use_kitchen = module.full_precision, module.use_kitchen
    return split


def _w4a4_concat(parts, bias) -> Optional[ConvRotW4A4Linear]:
    first = parts[0]
    if any((p.rotation, p.linear_dtype, p.full_precision) != (first.rotation, first.linear_dtype, first.full_precision)
           for p in parts):
        return None
    joined = ConvRotW4A4Linear(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]),
                               first.rotation, first.linear_dtype, bias)
    joined.full_precision = first.full_precision
    return joined


def _quantize(cls, unit: int):
    def quantize(weight: torch.Tensor, bias: Optional[torch.Tensor], group: int):
        return None if weight.shape[1] % unit else cls.from_dense(weight, bias)

    return quantize


def _stored(build):
    """A layer from a file's tensors (``p``: QuantPlan.stored), tagged with the file's full_precision_matrix_mult."""
    return lambda p: with_tag(build(p, p.get("params") or {}), p)


_W4A4 = _stored(lambda p, q: ConvRotW4A4Linear(p["weight"], p["weight_scale"], q["rotation"], q["linear_dtype"]))
_W4A8 = _stored(lambda p, q: W4A8Linear(p["weight"], p["weight_s_rel"], p["weight_s_channel"], p.get("weight_codebook"),
                                        q["group"], q["rotation"]))
_AWQ = _stored(lambda p, q: AWQW4A16Linear(p["weight"], p["weight_scale"], p["weight_zeros"], q["group"]))
_DEQUANTIZED = "dequantized per forward by comfy-kitchen, then a dense GEMM"

CONVROT_W4A4 = register_format(WeightFormat(
    "convrot-w4a4", ConvRotW4A4Linear, parse=lambda t: 0 if t in ("convrot-w4a4", "convrot_w4a4") else None,
    choices=("convrot-w4a4",), quantize=_quantize(ConvRotW4A4Linear, 64),
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] // 2 + 4 * shape[0], from_stored=_W4A4,
    dequantize=lambda p: _W4A4(p).dequantize(), read_layers=read_layers("convrot_w4a4"), concat=_w4a4_concat,
    rows=_rows, packed=True, dense_why="have inputs that are not multiples of 64", split=_split,
    comfy_formats=("convrot_w4a4",), help="ComfyUI's ConvRot W4A4 (int4 rotated by Hadamard groups, a scale a row)",
    storage="ComfyUI's layout: int4 pairs in I8 (rotated by groups of `convrot_groupsize` inputs), an F32 scale per row",
    compute=f"{_DEQUANTIZED}; CUDA sm75+: comfy-kitchen's `convrot_w4a4_linear` (int4 activations) after a probe"))
ASYM_W4A8_INT8 = register_format(WeightFormat(
    "asym-w4a8-int8", W4A8Linear, parse=lambda t: 0 if t in ("asym-w4a8-int8", "asym_w4a8_int8") else None,
    choices=("asym-w4a8-int8",), quantize=_quantize(W4A8Linear, 16),
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] * 9 // 16 + 4 * shape[0] + 64, from_stored=_W4A8,
    dequantize=lambda p: _W4A8(p).dequantize(), read_layers=read_layers("asym_w4a8_int8"),
    concat=lambda parts, bias: None, rows=_rows, packed=True, dense_why="have inputs that are not multiples of 16",
    split=_split, comfy_formats=("asym_w4a8_int8",),
    help="ComfyUI's W4A8 (4-bit codebook codes rotated by Hadamard groups, e4m3 scales per 16)",
    storage="ComfyUI's layout: 4-bit (or 6-bit) codes in I8, rotated; E4M3 scale per group of 16, F32 per row, "
            "an F32 codebook of 16",
    compute=f"{_DEQUANTIZED}; CUDA sm80+: comfy-kitchen's `w4a8_int8_linear` (int8 activations) after a probe"))
AWQ_W4A16 = register_format(WeightFormat(
    "awq-w4a16", AWQW4A16Linear, parse=lambda t: None, choices=(), quantize=lambda weight, bias, group: None,
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] // 2 + 4 * shape[0] * (shape[1] // 64),
    from_stored=_AWQ, dequantize=lambda p: _AWQ(p).dequantize(), read_layers=read_layers("awq_w4a16"),
    concat=lambda parts, bias: None, rows=_rows, packed=True, dense_why="has no quantizer (AWQ is calibrated offline)",
    split=_split, comfy_formats=("awq_w4a16",), help="ComfyUI's AWQ W4A16 (read only)",
    storage="ComfyUI's layout: uint4 pairs in I8, a scale and a zero point per 64 inputs (BF16 / F16)",
    compute="comfy-kitchen's `gemv_awq_w4a16` (dequantized in the scales' dtype, then a dense GEMM) when the "
            "activations have that dtype, else dequantized by comfy-kitchen to theirs + a dense GEMM"))
