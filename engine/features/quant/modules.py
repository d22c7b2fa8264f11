"""The quantized linear layers, their entries in the format table (registry.py: "fp8", "int4"), and the
"quant" feature: ``apply_quant(model, fmt)`` replaces the blocks' linear layers by the format's module
(through engine/features/patching.py) and records the patch; ``prepare_fast_paths`` switches fp8 layers to
``torch._scaled_mm`` where a probe says it runs and agrees. Why weight-only, and the compute paths:
docs/quantization.md."""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...models.family import family_of
from .. import patching
from .formats import read_fp8_layers, read_int4_layers
from .numerics import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    int4_group,
    parse_int4,
    quantize_fp8,
    quantize_int4,
    scaled_linear,
)
from .registry import WeightFormat, format_of, get_format, parse_format, quant_modules, register_format
from .registry import choices as quant_choices  # noqa: I001

log = logging.getLogger("sgld.quant")

# engine/features/fuse.py's per-module record (each part's rows) of a fused linear: it belongs to the module's
# place, so a quantized (or, on removal, dequantized) replacement of a fused linear carries it over. Without
# it the replacement would be a plain module at ``qkv`` / ``gate_up`` and state_dict() could not split it.
FUSE_RECORD = "fuse"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    """``patching.replace_module`` that keeps a fused linear's row record on its replacement."""
    rows = patching.feature_state(model.get_submodule(name), FUSE_RECORD)
    patching.replace_module(model, name, new)
    if rows is not None:
        patching.state(new)[FUSE_RECORD] = rows


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(nn.Module):
    """Linear with an e4m3 weight and a float32 scale per output channel (or one per tensor)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _param(weight)
        self.weight_scale = _param(scale.float().reshape(-1) if scale.numel() > 1 else scale.float().reshape(()))
        self.bias = _param(bias) if bias is not None else None
        self.use_scaled_mm = False  # set by prepare_fast_paths on CUDA sm89+

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "FP8Linear":
        q, s = quantize_fp8(weight)
        return cls(q, s, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm and x.dtype == torch.bfloat16:  # the probed (and row-wise-supported) case
            return fp8_scaled_mm_linear(x, self.weight, self.weight_scale, self.bias)
        return scaled_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.weight_scale.dim() else "per-tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {kind}"


class Int4Linear(nn.Module):
    """Linear with 4-bit group-wise weights (two per byte), bf16 scale and zero per group."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = self.in_features // scale.shape[-1]
        self.weight = _param(packed)
        self.weight_scale = _param(scale)
        self.weight_zero = _param(zero)
        self.bias = _param(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: int = 128) -> "Int4Linear":
        return cls(*quantize_int4(weight, group), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.weight, self.weight_scale, self.weight_zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


# -- the table's entries ---------------------------------------------------------------------------------------
def _fp8_from_stored(parts) -> FP8Linear:
    weight, scale = parts["weight"], parts["weight_scale"]
    scale = torch.ones((), device=weight.device) if scale is None else scale.float()  # no scale: a plain cast
    if weight.dtype != FP8_DTYPE:  # e5m2 storage: re-stored as e4m3 per channel
        return FP8Linear.from_dense(dequantize_fp8(weight, scale))
    return FP8Linear(weight, scale)


def _fp8_dequantize(parts) -> torch.Tensor:
    scale = parts["weight_scale"]
    weight = parts["weight"]
    return dequantize_fp8(weight, torch.ones((), device=weight.device) if scale is None else scale, torch.float32)


def _fp8_concat(parts: List[FP8Linear], bias: Optional[torch.Tensor]) -> FP8Linear:
    scales = [p.weight_scale.reshape(-1).expand(p.out_features) for p in parts]  # a per-tensor scale on every row
    return FP8Linear(torch.cat([p.weight for p in parts]), torch.cat(scales), bias)


def _fp8_rows(fused: FP8Linear, start: int, stop: int, bias: Optional[torch.Tensor]) -> FP8Linear:
    part = FP8Linear(fused.weight[start:stop].clone(), fused.weight_scale[start:stop].clone(), bias)
    part.use_scaled_mm = fused.use_scaled_mm
    return part


def _fp8_join(leaf: str, tensors: List[torch.Tensor], rows: List[int]) -> torch.Tensor:
    if leaf == "weight_scale":  # a per-tensor scale becomes the same scale on every row of its part
        tensors = [t.reshape(-1).expand(n) for t, n in zip(tensors, rows)]
    return torch.cat(tensors)


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


FP8 = register_format(WeightFormat(
    "fp8", FP8Linear, parse=lambda text: 0 if text == "fp8" else None, choices=("fp8",),
    quantize=lambda weight, bias, group: FP8Linear.from_dense(weight, bias),
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] + 4 * shape[0],  # e4m3, a float32 scale a row
    from_stored=_fp8_from_stored, dequantize=_fp8_dequantize, read_layers=read_fp8_layers,
    concat=_fp8_concat, rows=_fp8_rows, join=_fp8_join))
INT4 = register_format(WeightFormat(
    "int4", Int4Linear, parse=parse_int4, choices=("int4", "int4-g64"), quantize=_int4_quantize,
    weight_bytes=_int4_bytes, from_stored=lambda p: Int4Linear(p["weight"], p["weight_scale"], p["weight_zero"]),
    dequantize=lambda p: dequantize_int4(p["weight"], p["weight_scale"], p["weight_zero"]),
    read_layers=read_int4_layers, concat=_int4_concat, rows=_int4_rows, packed=True,
    dense_why="have an input size that no group of 32/64/128 divides"))
QUANT_MODULES = quant_modules()  # the built-in classes; code that must see every registered one calls quant_modules()


def stored_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a file stores for a quantized layer (its own names: weight, weight_scale, ...), bias apart."""
    return {k: v for k, v in module.state_dict().items() if k != "bias"}


def fp8_scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """FP8 GEMM on tensor cores: activations quantized to e4m3 per row (dynamic), weight scale per column."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    n = w.shape[0]
    ws = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
    wq = w if w.dtype == FP8_DTYPE else w.to(FP8_DTYPE)
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=ws,
                         bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    if isinstance(y, tuple):  # torch < 2.5 returned (out, amax)
        y = y[0]
    return y.reshape(*shape[:-1], n)


_scaled_mm_probes: Dict[str, Tuple[bool, str]] = {}


def fp8_scaled_mm_supported(device) -> Tuple[bool, str]:
    """Does ``torch._scaled_mm`` (row-wise) run here and agree with the dequantize path? Probed once per device."""
    device = torch.device(device)
    key = str(device)
    if key in _scaled_mm_probes:
        return _scaled_mm_probes[key]
    if os.environ.get("SGLD_FP8_MATMUL", "auto").lower() in ("0", "off", "false", "no"):
        result = (False, "SGLD_FP8_MATMUL=0")
    elif device.type != "cuda" or not torch.cuda.is_available():
        result = (False, "torch._scaled_mm needs a CUDA GPU")
    elif not hasattr(torch, "_scaled_mm"):
        result = (False, "this torch has no torch._scaled_mm")
    elif torch.cuda.get_device_capability(device) < (8, 9):
        cap = torch.cuda.get_device_capability(device)
        result = (False, f"FP8 tensor cores need sm89+ (GPU is sm{cap[0]}{cap[1]})")
    else:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(64, 256, device=device, generator=g).to(torch.bfloat16)
            w = torch.randn(128, 256, device=device, generator=g)
            q, s = quantize_fp8(w)
            ref = F.linear(x.float(), dequantize_fp8(q, s))
            out = fp8_scaled_mm_linear(x, q, s, None).float()
            err = ((out - ref).norm() / ref.norm()).item()
            result = (err < 0.08, f"torch._scaled_mm row-wise, probe rel. error {err:.3f}")
        except Exception as e:  # unsupported scaling mode on this GPU / torch build
            result = (False, f"torch._scaled_mm failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    _scaled_mm_probes[key] = result
    return result


def prepare_fast_paths(model: nn.Module) -> List[str]:
    """Switch FP8 layers to ``torch._scaled_mm`` where it runs (CUDA sm89+). Returns notes (info, not warnings)."""
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    if not fp8:
        return []
    ok, why = fp8_scaled_mm_supported(fp8[0].weight.device)
    for m in fp8:
        m.use_scaled_mm = ok and m.in_features % 16 == 0 and m.out_features % 16 == 0
    msg = f"fp8 matmul: {'torch._scaled_mm' if ok else 'dequantize + dense GEMM'} ({why})"
    log.info(msg)
    return [msg]


# -- the feature ----------------------------------------------------------------------------------------------
def make_quant_linear(kind: str, group: int, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[nn.Module]:
    """A quantized layer of ``weight`` in format ``kind``, or None when the format leaves it dense."""
    return get_format(kind).quantize(weight, bias, group)


def quantized_bytes(kind: str, group: int, shape: Tuple[int, int], dense: torch.dtype) -> int:
    """Bytes of an [out, in] weight once ``make_quant_linear`` made it (``dense`` when it stays dense)."""
    return get_format(kind).weight_bytes(shape, group, dense)


class QuantPatch(patching.Patch):
    """The model's block linears are quantized: ``format`` (a format name or "mixed"), ``layers`` (how many),
    ``warnings`` (layers left dense or re-quantized). Removing it puts dense layers back (dequantized)."""

    name = "quant"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.format, self.layers, self.warnings = None, 0, []

    def describe(self) -> dict:
        return {"format": self.format, "layers": self.layers}

    def remove(self) -> None:
        model = self.model
        if model is None:
            return
        dtype = model.dtype
        for name, module in list(model.named_modules()):
            if format_of(module) is not None:
                dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
                dense.weight = _param(module.dequantize(dtype))
                if module.bias is not None:
                    dense.bias = _param(module.bias.to(dtype))
                _replace(model, name, dense)


def record_quant(model: nn.Module) -> Optional[QuantPatch]:
    """Register (or update) the "quant" patch from the quantized layers the model holds; None if it has none."""
    layers = [m for m in model.modules() if format_of(m) is not None]
    if not layers:
        return None
    patch = patching.get(model, QuantPatch.name) or patching.attach(model, QuantPatch(model))
    patch.format, patch.layers = model_quant_format(model), len(layers)
    return patch


def apply_quant(model: nn.Module, fmt: str) -> QuantPatch:
    """Replace the blocks' linear layers in place (one at a time, so memory only shrinks) and record the
    "quant" patch. Layers already in the requested format are kept; others are re-quantized from their
    weights. The patch's ``warnings``: layers that could not be quantized or were re-quantized."""
    kind, group = parse_format(fmt)
    if kind is None:
        raise ValueError("apply_quant needs a format: " + ", ".join(quant_choices()))
    target = get_format(kind)
    warnings = []
    skipped = []
    family = family_of(model)
    for name, mod in list(model.named_modules()):
        if not family.is_block_linear(name):
            continue
        now = format_of(mod)
        if now is target:
            continue
        if now is not None:
            dense, bias = mod.dequantize(torch.float32), mod.bias
            warnings.append(f"{name}: re-quantized from {now.name} to {kind}")
        elif isinstance(mod, nn.Linear):
            dense, bias = mod.weight.detach(), mod.bias
        else:
            continue
        new = target.quantize(dense, None if bias is None else bias.detach(), group)
        if new is None:
            skipped.append(name)
            continue
        _replace(model, name, new)  # a fused linear (fuse, then quantize) stays fused: same rows, same numbers
    if skipped:
        warnings.append(f"{kind}: {len(skipped)} linear layers {target.dense_why} and stay unquantized "
                        f"(first: {skipped[0]})")
    for w in warnings:
        log.warning(w)
    patch = record_quant(model) or patching.attach(model, QuantPatch(model))
    patch.warnings = warnings
    return patch


def remove_quant(model: nn.Module) -> bool:
    """Dense layers again (the quantized weights dequantized to the model's dtype). False if none were quantized."""
    return patching.detach(model, QuantPatch.name)


def model_quant_format(model: nn.Module) -> Optional[str]:
    """The format name ("fp8", "int4", ...), "mixed" or None, from the quantized layers."""
    kinds = {f.name for f in map(format_of, model.modules()) if f is not None}
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def weight_bytes(model: nn.Module, only_block_linears: bool = False) -> int:
    """Bytes of the weights at rest (parameters and buffers; quantized storage as stored)."""
    total = 0
    if only_block_linears:
        family = family_of(model)
        for name, mod in model.named_modules():
            if family.is_block_linear(name):
                total += sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
        return total
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
