"""Weight-only FP8 / INT4 linear layers for the ERNIE-Image DiT, and quantized checkpoint formats.

What is quantized: the seven linear layers of every block (``self_attention.to_q/to_k/to_v/to_out.0``,
``mlp.gate_proj/up_proj/linear_fc2``), 98% of the 8B model's weights. Embedders, the modulation,
norms and the final layer stay in the compute dtype.

Formats
  fp8       float8 e4m3 weights, one float32 scale per output channel (absmax / 448).
            Bytes: 1 + 4/in_features per weight (0.50x of bf16).
  int4      4-bit weights, asymmetric, groups of 128 along the input (``int4-g64``: groups of 64);
            per group a bf16 scale and zero point: w = (q - 8) * scale + zero, q in 0..15; two weights
            per byte (even input index in the high nibble, as torch's int4pack kernels expect).
            Bytes: 0.5 + 4/group per weight (0.27x of bf16 at 128, 0.28x at 64).

Compute
  CPU and any device (reference path): the weight is dequantized to the activation dtype inside
  ``forward`` (fp8: a cast, the per-channel scale applied to the output; int4: unpack + scale +
  zero), then one dense GEMM. Memory at rest is the quantized size; a forward holds one dense
  weight at a time. torch.compile fuses the dequantization into one kernel per layer.
  FP8 on CUDA sm89+ (Ada, Hopper, Blackwell): ``torch._scaled_mm`` with row-wise scales, i.e. the
  activations are quantized to e4m3 per token on the fly (W8A8 dynamic, like torchao's
  Float8DynamicActivationFloat8Weight(PerRow) and ComfyUI's fp8_linear with --fast). It is enabled
  per device after a probe that checks it against the reference path; ``SGLD_FP8_MATMUL=0`` turns
  it off (weight-only, dequantize path).
  INT4 on GPUs also uses the dequantize path: torch's int4 kernels (``_weight_int4pack_mm``) are
  built for small-batch decoding and lose to a dense bf16 GEMM at DiT token counts (4k+ tokens).

Checkpoints (read by ``load_quantized``; ``engine.io.checkpoint.load_model`` routes here)
  sgld (``sgld quantize``): file metadata ``sgld_quant`` = JSON {"format", "group_size", "version"};
    fp8 layers: ``X.weight`` F8_E4M3 [out, in] + ``X.weight_scale`` F32 [out];
    int4 layers: ``X.weight`` U8 [out, in/2] + ``X.weight_scale`` / ``X.weight_zero`` BF16 [out, in/group].
  ComfyUI legacy ``scaled_fp8``: marker tensor ``scaled_fp8`` (its dtype = storage dtype), per linear
    ``X.weight`` fp8 + ``X.scale_weight`` F32 scalar (+ optional ``X.scale_input``, unused: weight-only).
  ComfyUI mixed precision: ``X.weight`` fp8 + ``X.weight_scale`` F32 scalar + ``X.comfy_quant`` (uint8
    JSON, e.g. {"format": "float8_e4m3fn"}) (+ optional ``X.input_scale``, unused), or the same layers
    listed in the file metadata ``_quantization_metadata`` = {"layers": {name: {"format": ...}}}.
    Formats other than float8 (nvfp4, mxfp8, int8 ...) are refused with a CheckpointError.
  Block linears stay quantized (per-tensor scale for ComfyUI files); quantized non-block layers are
  dequantized to the compute dtype at load. Every quantized weight's companions (names, dtypes, shapes,
  and finite, positive scale values) are checked at load, with a CheckpointError naming the tensor
  (``QuantPlan``); an fp8 file without any scale is a plain cast and reads as scale 1. Tensors are read
  one at a time, so a load holds about one file size.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("sgld.quant")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)
FORMATS = ("fp8", "int4", "int4-g64")
BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2",
                 "self_attention.qkv", "mlp.gate_up")  # the last two: fused by engine/features/fuse.py
BLOCK_LINEAR_RE = re.compile(r"^layers\.\d+\.(" + "|".join(re.escape(n) for n in BLOCK_LINEARS) + r")$")
SGLD_META_KEY = "sgld_quant"
COMFY_META_KEY = "_quantization_metadata"
COMFY_FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# Per-layer tensors of the ComfyUI formats that a weight-only engine does not need.
IGNORED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")


def parse_format(fmt: Optional[str]) -> Tuple[Optional[str], int]:
    """"fp8" | "int4" | "int4-g64" | "int4-g128" | None -> (kind, group_size)."""
    if fmt is None:
        return None, 0
    f = str(fmt).lower()
    if f in ("none", "off", ""):
        return None, 0
    if f == "fp8":
        return "fp8", 0
    m = re.fullmatch(r"int4(?:[-_]g(\d+))?", f)
    if m:
        g = int(m.group(1) or 128)
        if g not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size {g} is not supported; use 64 or 128")
        return "int4", g
    raise ValueError(f"quantization format '{fmt}' is not supported; choose one of fp8, int4 (groups of 128), int4-g64")


def is_block_linear(name: str) -> bool:
    return bool(BLOCK_LINEAR_RE.match(name))


# -- numerics -----------------------------------------------------------------------------------------------
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


# -- modules ----------------------------------------------------------------------------------------------
def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(nn.Module):
    """Linear with an e4m3 weight and a float32 scale per output channel (or one per tensor)."""

    fmt = "fp8"

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
        # e4m3 -> bf16/fp16/fp32 is exact; the scale is applied to the output (one channel = one scale).
        y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.weight_scale.dim() else "per-tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {kind}"


class Int4Linear(nn.Module):
    """Linear with 4-bit group-wise weights (two per byte), bf16 scale and zero per group."""

    fmt = "int4"

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


QUANT_MODULES = (FP8Linear, Int4Linear)


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


_fp8_probe: Dict[str, Tuple[bool, str]] = {}


def fp8_scaled_mm_supported(device) -> Tuple[bool, str]:
    """Does ``torch._scaled_mm`` (row-wise) run here and agree with the dequantize path? Probed once per device."""
    device = torch.device(device)
    key = str(device)
    if key in _fp8_probe:
        return _fp8_probe[key]
    if os.environ.get("SGLD_FP8_MATMUL", "auto").lower() in ("0", "off", "false", "no"):
        res = (False, "SGLD_FP8_MATMUL=0")
    elif device.type != "cuda" or not torch.cuda.is_available():
        res = (False, "torch._scaled_mm needs a CUDA GPU")
    elif not hasattr(torch, "_scaled_mm"):
        res = (False, "this torch has no torch._scaled_mm")
    elif torch.cuda.get_device_capability(device) < (8, 9):
        cap = torch.cuda.get_device_capability(device)
        res = (False, f"FP8 tensor cores need sm89+ (GPU is sm{cap[0]}{cap[1]})")
    else:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(64, 256, device=device, generator=g).to(torch.bfloat16)
            w = torch.randn(128, 256, device=device, generator=g)
            q, s = quantize_fp8(w)
            ref = F.linear(x.float(), dequantize_fp8(q, s))
            out = fp8_scaled_mm_linear(x, q, s, None).float()
            err = ((out - ref).norm() / ref.norm()).item()
            res = (err < 0.08, f"torch._scaled_mm row-wise, probe rel. error {err:.3f}")
        except Exception as e:  # unsupported scaling mode on this GPU / torch build
            res = (False, f"torch._scaled_mm failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    _fp8_probe[key] = res
    return res


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


# -- whole models -------------------------------------------------------------------------------------------
def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def make_quant_linear(kind: str, group: int, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[nn.Module]:
    if kind == "fp8":
        return FP8Linear.from_dense(weight, bias)
    g = int4_group(weight.shape[1], group)
    if not g:
        return None
    return Int4Linear.from_dense(weight, bias, g)


def quantize_model(model: nn.Module, fmt: str) -> List[str]:
    """Replace the blocks' linear layers in place (one at a time, so memory only shrinks).
    Layers already in the requested format are kept; others are re-quantized from their weights.
    Returns warnings (layers that could not be quantized)."""
    kind, group = parse_format(fmt)
    if kind is None:
        return []
    warnings = []
    skipped = []
    for name, mod in list(model.named_modules()):
        if not is_block_linear(name):
            continue
        if isinstance(mod, FP8Linear if kind == "fp8" else Int4Linear):
            continue
        if isinstance(mod, QUANT_MODULES):
            dense, bias = mod.dequantize(torch.float32), mod.bias
            warnings.append(f"{name}: re-quantized from {mod.fmt} to {kind}")
        elif isinstance(mod, nn.Linear):
            dense, bias = mod.weight.detach(), mod.bias
        else:
            continue
        new = make_quant_linear(kind, group, dense, None if bias is None else bias.detach())
        if new is None:
            skipped.append(name)
            continue
        _set_module(model, name, new)
    if skipped:
        warnings.append(f"int4: {len(skipped)} linear layers have an input size that no group of 32/64/128 divides "
                        f"and stay unquantized (first: {skipped[0]})")
    for w in warnings:
        log.warning(w)
    return warnings


def model_quant_format(model: nn.Module) -> Optional[str]:
    """"fp8", "int4", "mixed" or None, from the block linears."""
    kinds = {m.fmt for n, m in model.named_modules() if isinstance(m, QUANT_MODULES)}
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def weight_bytes(model: nn.Module, only_block_linears: bool = False) -> int:
    """Bytes of the weights at rest (parameters and buffers; quantized storage as stored)."""
    total = 0
    if only_block_linears:
        for name, mod in model.named_modules():
            if is_block_linear(name):
                total += sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
        return total
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()


# -- checkpoints ----------------------------------------------------------------------------------------------
def _read(ckpt, key: str) -> torch.Tensor:
    f, fk = ckpt.index[key]
    for _, t in f.tensors([fk]):
        return t
    raise KeyError(key)


MAX_COMFY_QUANT_BYTES = 64 * 1024  # a ComfyUI per-layer format tag is a few dozen bytes of JSON
SCALE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
SGLD_META_FIELDS = {  # field -> (check, what is allowed)
    "format": (lambda v: v in ("fp8", "int4"), "'fp8' or 'int4'"),
    "group_size": (lambda v: v is None or type(v) is int and v > 0, "a positive integer or null"),
    "version": (lambda v: type(v) is int and v == 1, "1"),
    "compute_dtype": (lambda v: v in ("bfloat16", "float16", "float32"), "'bfloat16', 'float16' or 'float32'"),
}


def _where(ckpt, key: str) -> str:
    """"<file>: tensor '<key in the file>'", for messages."""
    f, fk = ckpt.index[key]
    return f"{f.path}: tensor '{fk}'"


def _header(ckpt, key: str) -> Tuple[torch.dtype, tuple]:
    f, fk = ckpt.index[key]
    return f.dtype(fk), tuple(f.shape(fk))


def _dtype_name(dtype: torch.dtype) -> str:
    from ..io.safetensors import DTYPES

    return next(n for n, d in DTYPES.items() if d == dtype)


def _parse_comfy_quant(ckpt, key: str) -> dict:
    """A ComfyUI ``X.comfy_quant`` tensor: uint8 bytes of a JSON object such as {"format": "float8_e4m3fn"}."""
    from ..io.safetensors import CheckpointError, load_json_object

    dtype, shape = _header(ckpt, key)
    if dtype != torch.uint8 or len(shape) != 1 or shape[0] > MAX_COMFY_QUANT_BYTES:
        raise CheckpointError(f"{_where(ckpt, key)} is {_dtype_name(dtype)} {list(shape)}; a ComfyUI format tag must be "
                              f"1-D U8 JSON text of at most {MAX_COMFY_QUANT_BYTES} bytes")
    return load_json_object(_read(ckpt, key).numpy().tobytes(), _where(ckpt, key))


def _parse_sgld_meta(f) -> dict:
    from ..io.safetensors import CheckpointError, load_json_object

    where = f"{f.path}: metadata '{SGLD_META_KEY}'"
    meta = load_json_object(f.metadata[SGLD_META_KEY], where)
    if "format" not in meta:
        raise CheckpointError(f"{where}: field 'format' is missing (allowed: 'fp8' or 'int4')")
    for name, (ok, allowed) in SGLD_META_FIELDS.items():
        if name in meta and not ok(meta[name]):
            raise CheckpointError(f"{where}: field '{name}' = {meta[name]!r} must be {allowed}")
    return meta


def _parse_comfy_meta(f) -> dict:
    from ..io.safetensors import CheckpointError, load_json_object

    where = f"{f.path}: metadata '{COMFY_META_KEY}'"
    layers = load_json_object(f.metadata[COMFY_META_KEY], where).get("layers", {})
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise CheckpointError(f"{where}: field 'layers' must be an object of layer name -> {{\"format\": ...}}")
    return layers


class QuantPlan:
    """Which layers of a checkpoint are stored quantized, and how (read from names, dtypes, metadata).

    Every quantized weight's companions are checked here, from the header, before anything is built:
    sgld fp8 needs ``X.weight_scale`` F32 [out]; ComfyUI fp8 a scalar ``X.scale_weight`` (scaled_fp8) or
    ``X.weight_scale`` (comfy_quant); an fp8 file without any scale is a plain cast (scale 1, as ComfyUI
    reads it), but once some fp8 weights have scales, all need one; int4 needs ``X.weight`` U8 [out, in/2]
    with ``X.weight_scale`` / ``X.weight_zero`` [out, in/group] (group dividing in). Scale values are
    checked as they are read (``read_scales``)."""

    def __init__(self, ckpt):
        from ..io.safetensors import CheckpointError

        self.ckpt = ckpt
        self.layers: Dict[str, dict] = {}  # layer name (no prefix) -> {"kind", "scale_key", "zero_key", "shape"}
        self.ignored: List[str] = []  # keys of the file that are markers / unused input scales
        self.sources = set()
        keys = set(ckpt.keys())
        raw_keys = {fk for f in ckpt.files for fk in f.keys()}
        meta: dict = {}
        comfy_meta: dict = {}
        for f in ckpt.files:
            if SGLD_META_KEY in f.metadata:
                meta = _parse_sgld_meta(f)
            if COMFY_META_KEY in f.metadata:
                comfy_meta.update(_parse_comfy_meta(f))
        self.sgld_meta = meta
        legacy = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in raw_keys)
        if legacy:
            self.sources.add("comfy-scaled_fp8")
            self.ignored += [k for k in keys if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
        prefix = getattr(ckpt, "prefix", "")
        declared = {}
        for name, info in comfy_meta.items():
            declared[name[len(prefix):] if prefix and name.startswith(prefix) else name] = info
        for k in keys:
            if k.endswith(".comfy_quant"):
                declared[k[: -len(".comfy_quant")]] = _parse_comfy_quant(ckpt, k)
        for layer, info in declared.items():
            fmt = info.get("format", "")
            if not isinstance(fmt, str) or fmt not in COMFY_FP8_FORMATS:
                raise CheckpointError(
                    f"{ckpt.describe()}: layer '{layer}' uses ComfyUI quantization format '{fmt or '?'}', which "
                    "SGLDiffusion does not load (supported: float8_e4m3fn, float8_e5m2); use a bf16 or fp8 file")
            self.sources.add("comfy_quant")
        fp8_layers = [k[: -len(".weight")] for k in sorted(keys) if k.endswith(".weight") and _header(ckpt, k)[0] in FP8_STORAGE]
        scaled = bool(meta) or legacy or bool(declared) or any(
            layer + s in keys for layer in fp8_layers for s in (".weight_scale", ".scale_weight"))
        for layer in fp8_layers:
            style = "sgld" if meta else "comfy" if legacy or layer in declared else "fp8"
            self.layers[layer] = self._fp8_layer(layer, keys, style, scaled, legacy)
            if layer in declared:
                pass
            elif self.layers[layer]["scale_key"] and self.layers[layer]["scale_key"].endswith(".weight_scale"):
                self.sources.add("sgld" if meta else "fp8")
            elif not self.sources:
                self.sources.add("fp8")
        for k in sorted(keys):  # sorted: the first bad layer reported is the same on every run
            layer = k[: -len(".weight")]
            if (k.endswith(".weight") and _header(ckpt, k)[0] == torch.uint8
                    and (layer + ".weight_scale" in keys or layer + ".weight_zero" in keys)):
                self.layers[layer] = self._int4_layer(layer, keys)
                self.sources.add("sgld")
        for layer in declared:
            if layer not in self.layers:
                raise CheckpointError(f"{ckpt.describe()}: layer '{layer}' is marked quantized but its weight is not float8")
        self.ignored += [k for k in keys if k.endswith(IGNORED_SUFFIXES)]

    def _fp8_layer(self, layer: str, keys, style: str, scaled: bool, legacy: bool) -> dict:
        """Check an fp8 weight's scale from the header. ``style``: "sgld" | "comfy" | "fp8" (no marker)."""
        from ..io.safetensors import CheckpointError

        ckpt, wkey = self.ckpt, layer + ".weight"
        _, wshape = _header(ckpt, wkey)
        present = [layer + s for s in (".weight_scale", ".scale_weight") if layer + s in keys]
        if len(present) > 1:
            raise CheckpointError(f"{_where(ckpt, wkey)}: fp8 weight has two scales, '{present[0]}' and '{present[1]}'; "
                                  "a file holds one of them")
        if style == "sgld" and present and present[0].endswith(".scale_weight"):
            present = []  # an sgld file names its scales X.weight_scale
        if not present:
            if scaled:
                want = layer + (".weight_scale" if style == "sgld" or not legacy else ".scale_weight")
                raise CheckpointError(f"{_where(ckpt, wkey)}: fp8 weight without its scale '{want}' (this file's fp8 "
                                      "weights are scaled; only a file without any fp8 scale reads as scale 1)")
            return {"kind": "fp8", "scale_key": None, "shape": wshape}
        skey = present[0]
        sdtype, sshape = _header(ckpt, skey)
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
            raise CheckpointError(f"{_where(ckpt, skey)}: scale of fp8 weight '{wkey}' {list(wshape)} is "
                                  f"{_dtype_name(sdtype)} {list(sshape)}; allowed: {allowed}")
        return {"kind": "fp8", "scale_key": skey, "shape": wshape}

    def _int4_layer(self, layer: str, keys) -> dict:
        from ..io.safetensors import CheckpointError

        ckpt, wkey = self.ckpt, layer + ".weight"
        skey, zkey = layer + ".weight_scale", layer + ".weight_zero"
        for k in (skey, zkey):
            if k not in keys:
                raise CheckpointError(f"{_where(ckpt, wkey)}: int4 weight without '{k}' (int4 needs X.weight_scale and "
                                      "X.weight_zero)")
        _, wshape = _header(ckpt, wkey)
        if len(wshape) != 2:
            raise CheckpointError(f"{_where(ckpt, wkey)}: int4 weight has shape {list(wshape)}; allowed: U8 [out, in/2]")
        out, in_features = wshape[0], 2 * wshape[1]
        for k in (skey, zkey):
            dt, shape = _header(ckpt, k)
            if dt not in SCALE_DTYPES or len(shape) != 2 or shape[0] != out or not shape[1] or in_features % shape[1]:
                raise CheckpointError(
                    f"{_where(ckpt, k)} is {_dtype_name(dt)} {list(shape)}; int4 weight '{wkey}' {list(wshape)} needs "
                    f"[{out}, in/group] with a group size dividing in = {in_features}, of F32, BF16, F16 or F64")
        if _header(ckpt, skey)[1] != _header(ckpt, zkey)[1]:
            raise CheckpointError(f"{_where(ckpt, zkey)} has shape {list(_header(ckpt, zkey)[1])}, but '{skey}' has "
                                  f"{list(_header(ckpt, skey)[1])}; they must match")
        return {"kind": "int4", "scale_key": skey, "zero_key": zkey, "shape": (out, in_features)}

    def read_scales(self, layer: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scale, zero or None) of a quantized layer, read and checked: scales finite and > 0, zeros finite."""
        info = self.layers[layer]
        if info["kind"] == "fp8" and not info["scale_key"]:
            return torch.ones(()), None
        scale = self._read_finite(info["scale_key"], positive=True)
        zero = self._read_finite(info["zero_key"], positive=False) if info["kind"] == "int4" else None
        return scale, zero

    def _read_finite(self, key: str, positive: bool) -> torch.Tensor:
        from ..io.safetensors import CheckpointError

        t = _read(self.ckpt, key)
        values = t.float()
        bad = ~torch.isfinite(values) | (values <= 0) if positive else ~torch.isfinite(values)
        if bool(bad.any()):
            first = values.reshape(-1)[bad.reshape(-1)][0].item()
            raise CheckpointError(f"{_where(self.ckpt, key)}: {int(bad.sum())} values are not "
                                  f"{'finite and > 0' if positive else 'finite'} (e.g. {first})")
        return t

    def dense(self, layer: str, device=None) -> torch.Tensor:
        """The float32 weight of a quantized layer."""
        info = self.layers[layer]
        device = torch.device(device or "cpu")
        w = _read(self.ckpt, layer + ".weight").to(device)
        scale, zero = self.read_scales(layer)
        if info["kind"] == "fp8":
            return dequantize_fp8(w, scale.to(device), torch.float32)
        return dequantize_int4(w, scale.to(device), zero.to(device))

    @property
    def quantized(self) -> bool:
        return bool(self.layers) or bool(self.sources)

    def describe(self) -> str:
        kinds = sorted({v["kind"] for v in self.layers.values()})
        return f"{len(self.layers)} {'/'.join(kinds) or 'no'} layers ({', '.join(sorted(self.sources)) or 'plain'})"


def is_quantized_checkpoint(ckpt) -> bool:
    return QuantPlan(ckpt).quantized


def _compute_dtype(ckpt, plan: QuantPlan, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    stored = (plan.sgld_meta or {}).get("compute_dtype")
    if stored in ("bfloat16", "float16", "float32"):
        return getattr(torch, stored)
    skip = set(plan.ignored)
    for info in plan.layers.values():
        skip.update(v for k, v in info.items() if k.endswith("_key") and v)
    counts: Dict[torch.dtype, int] = {}
    for k, (f, fk) in ckpt.index.items():
        dt = f.dtype(fk)
        if k not in skip and dt.is_floating_point and dt.itemsize >= 2:
            counts[dt] = counts.get(dt, 0) + 1
    if not counts:
        return torch.bfloat16
    return max(counts, key=counts.get)


def load_quantized(ckpt, cfg, dtype: Optional[torch.dtype] = None, device="cpu", quant: Optional[str] = None) -> nn.Module:
    """Build the model from a pre-quantized and/or plain checkpoint, quantizing the block linears to
    ``quant`` (fp8 / int4 / int4-g64) as they are read. Tensors are read one at a time."""
    from ..io.checkpoint import build_model, check_keys
    from ..io.safetensors import CheckpointError

    kind, group = parse_format(quant)
    plan = QuantPlan(ckpt)
    cdt = _compute_dtype(ckpt, plan, dtype)
    model = build_model(cfg, "meta")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    used = set(plan.ignored)
    state: Dict[str, torch.Tensor] = {}
    replaced: Dict[str, nn.Module] = {}
    dev = torch.device(device)
    bad = []

    def dense_of(layer: str) -> torch.Tensor:
        return plan.dense(layer, dev)

    for layer, info in plan.layers.items():  # names and shapes first: nothing is read before they fit
        wkey = layer + ".weight"
        used.update([wkey] + [v for k, v in info.items() if k.endswith("_key") and v])
        if layer + ".bias" in ckpt.index:
            used.add(layer + ".bias")
        try:
            known = wkey in expected and model.get_submodule(layer) is not None
        except AttributeError:
            known = False
        if not known:
            bad.append(wkey)
        elif tuple(info["shape"]) != expected[wkey]:
            stored = "" if info["kind"] == "fp8" else f" (stored packed as {list(_header(ckpt, wkey)[1])})"
            raise CheckpointError(f"{ckpt.describe()}: {info['kind']} tensor '{wkey}' has shape {tuple(info['shape'])}"
                                  f"{stored}, but a model of this configuration needs {expected[wkey]}")
    if bad:
        raise CheckpointError(f"{ckpt.describe()}: quantized tensors do not match the ERNIE-Image architecture "
                              f"({len(bad)} unexpected, first: {bad[0]})")
    # the plain tensors: names and shapes (block linears get quantized as they arrive when ``quant`` is set)
    have = [k for k in ckpt.keys() if k not in used]
    check_keys(ckpt, [k for k in expected if k not in used and k not in have], sorted(k for k in have if k not in expected))
    for k in have:
        f, fk = ckpt.index[k]
        if tuple(f.shape(fk)) != expected[k]:
            raise CheckpointError(f"{ckpt.describe()}: tensor '{k}' has shape {tuple(f.shape(fk))}, but a model of this configuration needs {expected[k]}")
    for layer, info in plan.layers.items():
        wkey = layer + ".weight"
        target = model.get_submodule(layer)
        bkey = layer + ".bias"
        bias = _read(ckpt, bkey).to(dev, cdt) if bkey in ckpt.index else None
        block = is_block_linear(layer) and isinstance(target, nn.Linear)
        if block and (kind is None or kind == info["kind"]):
            w = _read(ckpt, wkey)
            scale, zero = plan.read_scales(layer)
            if info["kind"] == "fp8":
                s = scale.float()
                if w.dtype != FP8_DTYPE:  # e5m2 storage: re-store as e4m3 per channel
                    mod = FP8Linear.from_dense(dequantize_fp8(w, s).to(dev), bias)
                else:
                    mod = FP8Linear(w.to(dev), s.to(dev), bias)
            else:
                mod = Int4Linear(w.to(dev), scale.to(dev), zero.to(dev), bias)
            replaced[layer] = mod
        elif block:  # stored in another format than the one requested: re-quantize
            d = dense_of(layer)
            new = make_quant_linear(kind, group, d, bias)
            if new is not None:
                replaced[layer] = new
            else:
                state[wkey] = d.to(cdt)
                if bias is not None:
                    state[bkey] = bias
        else:  # quantized non-block layer (or a conv): dequantize to the compute dtype
            state[wkey] = dense_of(layer).to(cdt)
            if bias is not None:
                state[bkey] = bias
    for layer, mod in replaced.items():
        _set_module(model, layer, mod)
        for k in list(expected):
            if k.startswith(layer + "."):
                expected.pop(k)
    pending_bias: Dict[str, torch.Tensor] = {}
    for k in have:
        t = _read(ckpt, k)
        if t.is_floating_point() and t.dtype != cdt:
            t = t.to(cdt)
        t = t.to(dev)
        layer, _, leaf = k.rpartition(".")
        if kind and leaf == "weight" and is_block_linear(layer) and isinstance(model.get_submodule(layer), nn.Linear):
            new = make_quant_linear(kind, group, t, None)
            if new is not None:
                if model.get_submodule(layer).bias is not None:
                    pending_bias[layer] = None
                _set_module(model, layer, new)
                continue
        state[k] = t
    for layer in pending_bias:  # biases of layers quantized above
        bkey = layer + ".bias"
        mod = model.get_submodule(layer)
        mod.bias = _param(state.pop(bkey))
    remaining = {k: v for k, v in state.items()}
    model.load_state_dict(remaining, strict=False, assign=True)
    meta_left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if meta_left:
        raise CheckpointError(f"{ckpt.describe()}: tensors do not match the ERNIE-Image architecture: "
                              f"{len(meta_left)} missing (first: {', '.join(meta_left[:3])})")
    model.eval().requires_grad_(False)
    log.info("loaded %s: %s%s", ckpt.describe(), plan.describe(), f", quantized to {quant} at load" if kind else "")
    return model


# -- writing ------------------------------------------------------------------------------------------------
_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32",
             torch.int64: "I64", torch.bool: "BOOL", torch.float64: "F64", torch.int16: "I16"}


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def write_safetensors_streaming(path: str, specs: List[Tuple[str, torch.dtype, tuple]], produce, metadata: dict) -> None:
    """Write a safetensors file whose tensors come one at a time from ``produce(key) -> tensor``
    (memory: one tensor). ``specs`` fixes the order, dtypes and shapes in the header."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    off = 0
    for key, dt, shape in specs:
        n = _nbytes(dt, shape)
        header[key] = {"dtype": _ST_NAMES[dt], "shape": [int(d) for d in shape], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    from ..io.atomic import atomic_write

    with atomic_write(path) as f:  # a unique temporary file, renamed when complete, removed on any failure
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dt, shape in specs:
            t = produce(key)
            if t.dtype != dt or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"internal: '{key}' produced {t.dtype} {tuple(t.shape)}, header says {dt} {tuple(shape)}")
            f.write(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def quantize_file(src: str, dst: str, fmt: str, dtype: Union[None, str, torch.dtype] = None) -> dict:
    """``sgld quantize``: read an ERNIE-Image checkpoint (bf16/fp16/fp32, or already quantized) and write its
    block linears as fp8 / int4 in the sgld format (one tensor in memory at a time). Returns a summary."""
    from ..io.checkpoint import CONFIG_METADATA_KEY, Checkpoint, check_architecture, parse_dtype

    kind, group = parse_format(fmt)
    if kind is None:
        raise ValueError("--format must be fp8, int4 or int4-g64")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("the output file must differ from the input")
    ckpt = Checkpoint(src)
    cfg = check_architecture(ckpt)
    plan = QuantPlan(ckpt)
    cdt = _compute_dtype(ckpt, plan, parse_dtype(dtype))
    skip = set(plan.ignored)
    for info in plan.layers.values():
        skip.update(v for k, v in info.items() if k.endswith("_key") and v)
    specs: List[Tuple[str, torch.dtype, tuple]] = []
    jobs: Dict[str, Tuple[str, str]] = {}  # out key -> (layer, part)
    layer_groups: Dict[str, int] = {}
    for k in sorted(ckpt.keys()):
        if k in skip:
            continue
        f, fk = ckpt.index[k]
        shape = tuple(f.shape(fk))
        layer, _, leaf = k.rpartition(".")
        if leaf == "weight" and is_block_linear(layer):
            n = shape[0]
            kin = cfg.hidden_size if not layer.endswith("linear_fc2") else cfg.ffn_hidden_size
            g = int4_group(kin, group) if kind == "int4" else 0
            if kind == "fp8":
                specs += [(k, FP8_DTYPE, (n, kin)), (layer + ".weight_scale", torch.float32, (n,))]
            elif g:
                specs += [(k, torch.uint8, (n, kin // 2)), (layer + ".weight_scale", torch.bfloat16, (n, kin // g)),
                          (layer + ".weight_zero", torch.bfloat16, (n, kin // g))]
                layer_groups[layer] = g
            else:
                specs.append((k, cdt, (n, kin)))
                jobs[k] = (layer, "dense")
                continue
            for key, _, _ in specs[-(2 if kind == "fp8" else 3):]:
                jobs[key] = (layer, key[len(layer) + 1:])
        elif leaf == "weight" and layer in plan.layers:  # a quantized non-block layer: store it dense
            specs.append((k, cdt, shape))
            jobs[k] = (layer, "dense")
        else:
            dt = f.dtype(fk)
            specs.append((k, cdt if dt.is_floating_point and dt.itemsize >= 2 else dt, shape))
    cache: Dict[str, Tuple[str, dict]] = {}

    def dense(layer: str) -> torch.Tensor:
        if layer not in plan.layers:
            return _read(ckpt, layer + ".weight").float()
        return plan.dense(layer)

    def produce(key: str) -> torch.Tensor:
        if key not in jobs:
            t = _read(ckpt, key)
            return t.to(cdt) if t.is_floating_point() and t.dtype != cdt else t
        layer, part = jobs[key]
        if part == "dense":
            return dense(layer).to(cdt)
        if cache.get("layer", (None,))[0] != layer:
            w = dense(layer)
            if kind == "fp8":
                q, s = quantize_fp8(w)
                parts = {"weight": q, "weight_scale": s}
            else:
                q, s, z = quantize_int4(w, layer_groups[layer])
                parts = {"weight": q, "weight_scale": s, "weight_zero": z}
            cache["layer"] = (layer, parts)
        return cache["layer"][1][part]

    meta = {SGLD_META_KEY: json.dumps({"format": kind, "group_size": group if kind == "int4" else None, "version": 1,
                                       "compute_dtype": str(cdt).replace("torch.", "")})}
    ernie_meta = next((f.metadata[CONFIG_METADATA_KEY] for f in ckpt.files if CONFIG_METADATA_KEY in f.metadata), None)
    if ernie_meta:
        meta[CONFIG_METADATA_KEY] = ernie_meta
    write_safetensors_streaming(dst, specs, produce, meta)
    return {"input": src, "output": dst, "format": fmt, "layers": sum(1 for _, p in jobs.values() if p == "weight"),
            "input_bytes": os.path.getsize(src) if os.path.isfile(src) else None, "output_bytes": os.path.getsize(dst)}
