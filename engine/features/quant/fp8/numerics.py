"""fp8 numerics: e4m3 weights with a float32 scale per output channel (or one per tensor, ComfyUI's), and the
tensor-core GEMM (``torch._scaled_mm``, activations quantized per token) with its once-per-device probe."""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .... import device as device_rt
from ..numerics import quantize_rows

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 weight [out, in], float32 scale [out]) with w ~ q * scale per output row."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = scale.float()
    s = s[:, None] if s.dim() == 1 else s.reshape(())  # per channel, or per tensor (ComfyUI)
    return (q.float() * s).to(dtype)


def fp8_scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """FP8 GEMM on tensor cores: activations quantized to e4m3 per row (dynamic), weight scale per column."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_rows(x2, _quantize_activation_rows, FP8_DTYPE)
    n = w.shape[0]
    ws = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
    wq = w if w.dtype == FP8_DTYPE else w.to(FP8_DTYPE)
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=ws,
                         bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    if isinstance(y, tuple):  # torch < 2.5 returned (out, amax)
        y = y[0]
    return y.reshape(*shape[:-1], n)


def _quantize_activation_rows(x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] -> (e4m3 [rows, in], float32 scale [rows, 1]), one scale per row (token)."""
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x_scale


_scaled_mm_probes: Dict[str, Tuple[bool, str]] = {}


def fp8_scaled_mm_supported(device) -> Tuple[bool, str]:
    """Does ``torch._scaled_mm`` (row-wise) run here and agree with the dequantize path? Probed once per device."""
    device = torch.device(device)
    key = str(device)
    if key in _scaled_mm_probes:
        return _scaled_mm_probes[key]
    if os.environ.get("SGLD_FP8_MATMUL", "auto").lower() in ("0", "off", "false", "no"):
        result = (False, "SGLD_FP8_MATMUL=0")
    elif device.type != "cuda" or not device_rt.available():
        result = (False, "torch._scaled_mm needs a CUDA GPU")
    elif not hasattr(torch, "_scaled_mm"):
        result = (False, "this torch has no torch._scaled_mm")
    elif device_rt.capability(device) < (8, 9):
        cap = device_rt.capability(device)
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
