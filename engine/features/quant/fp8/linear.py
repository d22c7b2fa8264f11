"""The fp8 weight format: ``FP8Linear``, how a file stores it (sgld's per-channel scales, ComfyUI's scaled_fp8 and
per-layer tags, a plain cast without scales) and its entry "fp8" in the format table (../registry.py)."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Set

import torch
from torch import nn

from ....errors import CheckpointError
from ....io.safetensors import DTYPE_NAMES
from ..numerics import frozen, scaled_linear
from ..prequantized import SCALE_DTYPES, QuantPlan
from ..registry import WeightFormat, register_format
from .numerics import FP8_DTYPE, dequantize_fp8, fp8_scaled_mm_linear, fp8_scaled_mm_supported, quantize_fp8

log = logging.getLogger("sgld.quant")
FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)


class FP8Linear(nn.Module):
    """Linear with an e4m3 weight and a float32 scale per output channel (or one per tensor)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = frozen(weight)
        self.weight_scale = frozen(scale.float().reshape(-1) if scale.numel() > 1 else scale.float().reshape(()))
        self.bias = frozen(bias) if bias is not None else None
        self.use_scaled_mm = False  # set by prepare_fp8 on CUDA sm89+

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


# -- how a file stores it ----------------------------------------------------------------------------------------
def read_fp8_layers(plan: QuantPlan, keys: Set[str]) -> Dict[str, dict]:
    """Every float8 weight, its scale checked by the file's dialect (sgld, ComfyUI, or no scale at all)."""
    ckpt, meta, legacy, declared = plan.ckpt, plan.sgld_meta, plan.legacy, plan.declared
    fp8_layers = [k[: -len(".weight")] for k in sorted(keys) if k.endswith(".weight") and ckpt.header(k)[0] in FP8_STORAGE]
    scaled = bool(meta) or legacy or bool(declared) or any(
        layer + s in keys for layer in fp8_layers for s in (".weight_scale", ".scale_weight"))
    layers = {}
    for layer in fp8_layers:
        style = "sgld" if meta else "comfy" if legacy or layer in declared else "fp8"
        layers[layer] = info = _fp8_layer(ckpt, layer, keys, style, scaled, legacy)
        if layer in declared:
            pass
        elif info["scale_key"] and info["scale_key"].endswith(".weight_scale"):
            plan.sources.add("sgld" if meta else "fp8")
        elif not plan.sources:
            plan.sources.add("fp8")
    return layers


def _fp8_layer(ckpt, layer: str, keys, style: str, scaled: bool, legacy: bool) -> dict:
    """Check an fp8 weight's scale from the header. ``style``: "sgld" | "comfy" | "fp8" (no marker)."""
    wkey = layer + ".weight"
    _, wshape = ckpt.header(wkey)
    present = [layer + s for s in (".weight_scale", ".scale_weight") if layer + s in keys]
    if len(present) > 1:
        raise CheckpointError(f"{ckpt.where(wkey)}: fp8 weight has two scales, '{present[0]}' and '{present[1]}'; "
                              "a file holds one of them")
    if style == "sgld" and present and present[0].endswith(".scale_weight"):
        present = []  # an sgld file names its scales X.weight_scale
    if not present:
        if scaled:
            want = layer + (".weight_scale" if style == "sgld" or not legacy else ".scale_weight")
            raise CheckpointError(f"{ckpt.where(wkey)}: fp8 weight without its scale '{want}' (this file's fp8 "
                                  "weights are scaled; only a file without any fp8 scale reads as scale 1)")
        return {"scale_key": None, "shape": wshape}
    skey = present[0]
    sdtype, sshape = ckpt.header(skey)
    per_channel = len(wshape) == 2 and sshape == (wshape[0],)
    scalar = sshape in ((), (1,))
    if style == "sgld":
        ok, allowed = sdtype == torch.float32 and per_channel, f"F32 {[wshape[0]] if wshape else []} (one per output channel)"
    elif style == "comfy":
        ok, allowed = sdtype in SCALE_DTYPES and scalar, "a scalar (one per tensor) of F32, BF16, F16 or F64"
    else:
        ok, allowed = sdtype in SCALE_DTYPES and (scalar or per_channel), \
            f"a scalar or [{wshape[0] if wshape else ''}] (one per output channel) of F32, BF16, F16 or F64"
    if not ok:
        raise CheckpointError(f"{ckpt.where(skey)}: scale of fp8 weight '{wkey}' {list(wshape)} is "
                              f"{DTYPE_NAMES[sdtype]} {list(sshape)}; allowed: {allowed}")
    return {"scale_key": skey, "shape": wshape}


# -- the table's entry -------------------------------------------------------------------------------------------
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


def _fp8_split(module: FP8Linear, index: int, parts: int, dim: int) -> FP8Linear:
    """Tensor parallel: rank ``index``'s rows with their scales (dim 0), or its inputs (dim 1: a row's scale
    covers all its inputs, so every rank keeps it and the ranks' partial sums add up to the layer's output)."""
    step = (module.out_features if dim == 0 else module.in_features) // parts
    part = slice(index * step, (index + 1) * step)
    scale = module.weight_scale
    if dim == 0:
        bias = None if module.bias is None else module.bias[part].clone()
        out = FP8Linear(module.weight[part].clone(), (scale[part] if scale.dim() else scale).clone(), bias)
    else:
        out = FP8Linear(module.weight[:, part].contiguous(), scale.clone(), module.bias)
    out.use_scaled_mm = module.use_scaled_mm
    return out


def prepare_fp8(modules) -> list:
    """Switch FP8 layers to ``torch._scaled_mm`` where it runs (CUDA sm89+). Returns notes (info, not warnings)."""
    fp8 = [m for m in modules if isinstance(m, FP8Linear)]
    if not fp8:
        return []
    ok, why = fp8_scaled_mm_supported(fp8[0].weight.device)
    for m in fp8:
        m.use_scaled_mm = ok and m.in_features % 16 == 0 and m.out_features % 16 == 0
    msg = f"fp8 matmul: {'torch._scaled_mm' if ok else 'dequantize + dense GEMM'} ({why})"
    log.info(msg)
    return [msg]


FP8 = register_format(WeightFormat(
    "fp8", FP8Linear, parse=lambda text: 0 if text == "fp8" else None, choices=("fp8",),
    quantize=lambda weight, bias, group: FP8Linear.from_dense(weight, bias),
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] + 4 * shape[0],  # e4m3, a float32 scale a row
    from_stored=_fp8_from_stored, dequantize=_fp8_dequantize, read_layers=read_fp8_layers,
    concat=_fp8_concat, rows=_fp8_rows, join=_fp8_join, split=_fp8_split, prepare=prepare_fp8, comfy_formats=("float8_e4m3fn", "float8_e5m2"), help="e4m3, one scale per output channel, weight-only",
    storage="e4m3 + float32 scale per output channel",
    compute="CPU / older GPUs: cast + dense GEMM, scale on the output. CUDA sm89+: `torch._scaled_mm` with the "
            "activations quantized per token to e4m3 (W8A8 dynamic), enabled after a per-device probe; "
            "`SGLD_FP8_MATMUL=0` turns it off"))
