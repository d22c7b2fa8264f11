"""INT8 weights, per output channel, symmetric: ``X.weight`` I8 [out, in] and ``X.weight_scale`` F32 [out],
w = q * scale with q in -127..127. Two entries of the format table (registry.py) share that storage:

- "int8" (``Int8Linear``): W8A8. Each forward quantizes its input per token (absmax of each row of the
  flattened input / 127), multiplies int8 x int8 -> int32 with ``torch._int_mm`` and scales the int32 result
  by the token's and the channel's scale. Faster than a float GEMM where int8 units are (CPU VNNI/AMX,
  CUDA sm80+ tensor cores); shapes the kernel refuses (a probe, once per device and shape class), and a CPU
  without VNNI / AMX (where torch._int_mm runs ~20x slower than the float GEMM: engine/compute_dtype.py
  ``cpu_int8``), take the dequantized path instead.
- "int8-weight" (``Int8WeightLinear``): weight-only, the weight dequantized per layer in ``forward``
  (memory alone; the activations keep their precision).

Why, when it is faster and the measured figures: docs/quantization.md ("INT8")."""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ....compute_dtype import cpu_int8
from ....errors import CheckpointError
from ....io.safetensors import DTYPE_NAMES
from ..numerics import product_rows, quantize_rows, scaled_linear
from ..registry import WeightFormat, register_format

log = logging.getLogger("sgld.quant")

INT8_MAX = 127  # symmetric: -128 is never used, so -q is always representable
WEIGHT_ONLY = "int8-weight"
TINY = 1e-30  # an all-zero row (weight or token) gets this scale: its q is 0 and so is its product


def quantize_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale [out]) with w ~ q * scale per output row."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / INT8_MAX).clamp(min=TINY)
    q = torch.round(wf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_tokens(x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[tokens, in] -> (int8 [tokens, in], float32 scale [tokens, 1]): dynamic, one scale per token (row)."""
    return quantize_rows(x2, _quantize_tokens, torch.int8)


def _quantize_tokens(x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    xf = x2.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=TINY)
    q = (xf * (INT8_MAX / amax)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, amax / INT8_MAX


def w8a8(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
         bias: Optional[torch.Tensor] = None, prepare: Optional[Callable] = None) -> torch.Tensor:
    """[tokens, in] x int8 [out, in] -> [tokens, out] in ``dtype``: each token quantized (after ``prepare``, a
    row-wise transform of the input), int8 x int8 -> int32 with ``torch._int_mm``, rescaled by the token's and the
    weight's scale in float32 (the int32 sums exceed bf16 / fp16 precision), ``bias`` added there. In chunks of
    rows (``product_rows``: the same bits, a bounded int32 / float32 temporary)."""
    def rows(part: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_tokens(prepare(part) if prepare is not None else part)
        y = torch._int_mm(xq, weight.t())  # int32: |sum| <= 127^2 * in, far below 2^31
        y = (y * xs).mul_(weight_scale)
        return y if bias is None else y.add_(bias)

    return product_rows(x2, weight.shape[0], dtype, rows)


# -- which shapes torch._int_mm takes: measured once per device and shape class -------------------------------
_int_mm_probes: Dict[tuple, bool] = {}


def _shape_class(device: torch.device, m: int, k: int, n: int) -> tuple:
    # cuBLAS's int8 GEMM wants more than 16 rows and K, N multiples of 8; the probe checks what this device takes
    return (str(device), m > 16, k % 8 == 0, n % 8 == 0)


def int_mm_accepts(device, m: int, k: int, n: int) -> bool:
    """Does ``torch._int_mm`` run an [m, k] x [k, n] product (mat2 a transposed [n, k] weight, as Int8Linear
    passes it) on this device, and give the exact integer result? Probed once per device and shape class."""
    device = torch.device(device)
    key = _shape_class(device, m, k, n)
    if key in _int_mm_probes:
        return _int_mm_probes[key]
    if torch.compiler.is_compiling():  # no probe inside a traced graph: the known rule
        return device.type == "cpu" or all(key[1:])
    ok, why = _probe(device, m if m <= 16 else 32, k, n)
    _int_mm_probes[key] = ok
    log.info("int8 matmul on %s for [%s rows, K %% 8 %s, N %% 8 %s]: %s", device, "> 16" if key[1] else "<= 16",
             "= 0" if key[2] else "!= 0", "= 0" if key[3] else "!= 0", why)
    return ok


def _probe(device: torch.device, m: int, k: int, n: int) -> Tuple[bool, str]:
    if not hasattr(torch, "_int_mm"):
        return False, "this torch has no torch._int_mm: dequantized matmul"
    if device.type == "cpu":
        fast, why = cpu_int8()
        if not fast:  # torch._int_mm runs, but without VNNI / AMX ~20x slower than the float GEMM
            return False, f"{why}: dequantized matmul"
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-INT8_MAX, INT8_MAX + 1, (max(m, 1), k), generator=g, dtype=torch.int8).to(device)
        w = torch.randint(-INT8_MAX, INT8_MAX + 1, (n, k), generator=g, dtype=torch.int8).to(device)
        got = torch._int_mm(a, w.t())
        want = (a.double() @ w.double().t()).round().to(torch.int32)  # exact: |sum| < 2^53
        if got.dtype != torch.int32 or not torch.equal(got, want):
            return False, "torch._int_mm gave a wrong result: dequantized matmul"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return False, f"torch._int_mm refused it ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return True, "torch._int_mm"


# -- the layers --------------------------------------------------------------------------------------------
class _Int8Stored(nn.Module):
    """The storage both int8 formats share (not registered itself: format_of tells the two classes apart)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float().reshape(-1), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        return cls(*quantize_int8(weight), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def dequantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_linear(x, self.weight, self.weight_scale, self.bias)


class Int8Linear(_Int8Stored):
    """W8A8: int8 weights per output channel, activations quantized per token at run time, int32 GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not int_mm_accepts(x2.device, x2.shape[0], self.in_features, self.out_features):
            return self.dequantized_forward(x)
        y = w8a8(x2, self.weight, self.weight_scale, x.dtype, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, W8A8 per-token"


class Int8WeightLinear(_Int8Stored):
    """Weight-only int8: dequantized per layer in ``forward`` (the activations keep their dtype)."""

    forward = _Int8Stored.dequantized_forward

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, weight-only"


# -- a file's int8 layers (the entries' read_layers) --------------------------------------------------------------
def _read_int8_layers(plan, keys: Set[str], weight_only: bool) -> Dict[str, dict]:
    """Every I8 weight, its ``X.weight_scale`` (F32 [out]) checked from the header. A file that ``sgld
    quantize --format int8-weight`` wrote says so in its metadata; any other I8 file reads as "int8"."""
    if (plan.sgld_meta.get("format") == WEIGHT_ONLY) != weight_only:
        return {}
    ckpt, layers = plan.ckpt, {}
    for k in sorted(keys):  # sorted: the first bad layer reported is the same on every run
        if not k.endswith(".weight") or ckpt.header(k)[0] != torch.int8:
            continue
        layer, skey = k[: -len(".weight")], k[: -len(".weight")] + ".weight_scale"
        _, wshape = ckpt.header(k)
        if len(wshape) != 2:
            raise CheckpointError(f"{ckpt.where(k)}: int8 weight has shape {list(wshape)}; allowed: I8 [out, in]")
        if skey not in keys:
            raise CheckpointError(f"{ckpt.where(k)}: int8 weight without its scale '{skey}' (F32 [{wshape[0]}], "
                                  "one per output channel)")
        sdtype, sshape = ckpt.header(skey)
        if sdtype != torch.float32 or tuple(sshape) != (wshape[0],):
            raise CheckpointError(f"{ckpt.where(skey)}: scale of int8 weight '{k}' {list(wshape)} is "
                                  f"{DTYPE_NAMES[sdtype]} {list(sshape)}; allowed: F32 [{wshape[0]}] (one per output channel)")
        layers[layer] = {"scale_key": skey, "shape": tuple(wshape)}
        plan.sources.add("sgld")
    return layers


def _entry(name: str, cls: type, weight_only: bool) -> WeightFormat:
    def concat(parts: List[_Int8Stored], bias: Optional[torch.Tensor]) -> _Int8Stored:
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]), bias)

    def rows(fused: _Int8Stored, start: int, stop: int, bias: Optional[torch.Tensor]) -> _Int8Stored:
        return cls(fused.weight[start:stop].clone(), fused.weight_scale[start:stop].clone(), bias)

    def split(module: _Int8Stored, index: int, parts: int, dim: int) -> _Int8Stored:
        """Tensor parallel: rank ``index``'s rows with their scales, or its inputs (each row's scale kept)."""
        step = (module.out_features if dim == 0 else module.in_features) // parts
        part = slice(index * step, (index + 1) * step)
        if dim == 0:
            return rows(module, part.start, part.stop, None if module.bias is None else module.bias[part].clone())
        return cls(module.weight[:, part].contiguous(), module.weight_scale.clone(), module.bias)

    return WeightFormat(
        name, cls, parse=lambda text: 0 if text in (name, name.replace("-", "_")) else None, choices=(name,),
        quantize=lambda weight, bias, group: cls.from_dense(weight, bias),
        weight_bytes=lambda shape, group, dense: shape[0] * shape[1] + 4 * shape[0],  # a byte a weight, F32 a row
        from_stored=lambda p: cls(p["weight"], p["weight_scale"]),
        dequantize=lambda p: dequantize_int8(p["weight"], p["weight_scale"]),
        read_layers=lambda plan, keys: _read_int8_layers(plan, keys, weight_only), concat=concat, rows=rows, split=split,
        help="int8, one scale per output channel, weight-only" if weight_only else
             "int8, one scale per output channel; also quantizes the activations per token and multiplies in int8 "
             "(faster on CPUs with VNNI and on sm80+ GPUs)",
        storage="int8 symmetric + float32 scale per output channel",
        compute="cast + dense GEMM in the activation dtype" if weight_only else
                "activations quantized per token, `torch._int_mm` (int8 x int8 -> int32; VNNI / AMX CPUs, CUDA sm80+) "
                "where its per-device shape probe says it runs, else the dequantized path; the sums scaled per "
                "token and channel")


INT8 = register_format(_entry("int8", Int8Linear, weight_only=False))
INT8_WEIGHT = register_format(_entry(WEIGHT_ONLY, Int8WeightLinear, weight_only=True))
