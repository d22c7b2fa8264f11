"""ComfyUI's quantized layers as weight formats (../registry.py): "nvfp4", "mxfp8" and "int8-tensorwise", read
from ComfyUI's layout (``X.comfy_quant`` tags or the header's ``_quantization_metadata``; the tensors and shapes
in numerics.py). A layer keeps the stored bytes and scales as frozen parameters (offload moves them, LoRA side
paths see a quantized layer) and computes as ComfyUI does: nvfp4 and mxfp8 dequantized per forward by
comfy-kitchen, then a dense GEMM; int8_tensorwise W8A8 (activations quantized per token, an int8 GEMM; with
ConvRot, rotated first) unless the layer's tag says ``full_precision_matrix_mult``. Also what every ComfyUI layer
shares (``ComfyLinear``, the GPU kernels' probe in ``prepare_comfy``, ``split_step``); the 4-bit integer layers:
int4.py. Why and the limits: docs/quantization.md ("ComfyUI's quantized files")."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .... import device as device_rt
from ..int8.linear import int_mm_accepts, w8a8
from ..numerics import frozen
from ..registry import WeightFormat, register_format
from . import numerics as N
from .reader import read_layers

log = logging.getLogger("sgld.quant")


class ComfyLinear(nn.Module):
    """What ComfyUI's layers share: logical [out, in], bias, the per-forward dequantized path, and comfy-kitchen's
    GPU kernel ``KITCHEN_OP`` (``kitchen_forward``) where ``prepare`` found it runs on this device (``MIN_SM`` and
    up) and agrees with the dequantized path within ``PROBE_ERROR`` (its activations are quantized too)."""

    FORMAT = ""  # ComfyUI's name
    KITCHEN_OP: Optional[str] = None
    MIN_SM = (10, 0)
    PROBE_ERROR = 0.2
    CPU_PATH = "dequantized per layer by comfy-kitchen, then a dense GEMM"  # what prepare's note says off the GPU path

    def _setup(self, shape: Tuple[int, int], bias: Optional[torch.Tensor]) -> None:
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.bias = frozen(bias) if bias is not None else None
        self.full_precision = False  # the tag's full_precision_matrix_mult: always the dequantized path
        self.use_kitchen = False  # set by prepare where comfy-kitchen's GPU kernel runs and agrees with a probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.use_kitchen and not self.full_precision and x.dtype in (torch.bfloat16, torch.float16):
            return self.kitchen_forward(x.reshape(-1, self.in_features), bias).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def layout_tag(self) -> dict:
        """The layout parameters ComfyUI's tag carries for this layer (beyond its format)."""
        return {}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ComfyUI {self.FORMAT}"


class NVFP4Linear(ComfyLinear):
    """e2m1 values in blocks of 16, an e4m3 scale a block and an F32 scale a tensor (``pre_quant_scale``: a
    per-input factor folded into the weight, as ComfyUI multiplies the input by it)."""

    FORMAT = "nvfp4"
    KITCHEN_OP = "scaled_mm_nvfp4"

    def __init__(self, weight, weight_scale, weight_scale_2, shape, bias=None, pre_quant_scale=None):
        super().__init__()
        self._setup(shape, bias)
        self.weight = frozen(weight)
        self.weight_scale = frozen(weight_scale.view(torch.float8_e4m3fn))
        self.weight_scale_2 = frozen(weight_scale_2.float().reshape(()))
        self.pre_quant_scale = None if pre_quant_scale is None else frozen(pre_quant_scale.reshape(-1))

    def kitchen_forward(self, x2: torch.Tensor, bias) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        return N.nvfp4_linear(x2, self.weight, self.weight_scale, self.weight_scale_2, self.out_features, bias)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "NVFP4Linear":
        return cls(*N.quantize_nvfp4(weight), tuple(weight.shape), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if self.pre_quant_scale is None:
            return N.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, shape, dtype)
        w = N.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, shape, torch.float32)
        return (w * self.pre_quant_scale.float()).to(dtype)


class MXFP8Linear(ComfyLinear):
    """e4m3 values in blocks of 32 with a power-of-two (e8m0) scale a block."""

    FORMAT = "mxfp8"
    KITCHEN_OP = "scaled_mm_mxfp8"

    def __init__(self, weight, weight_scale, shape, bias=None):
        super().__init__()
        self._setup(shape, bias)
        self.weight = frozen(weight)
        self.weight_scale = frozen(weight_scale.view(torch.float8_e8m0fnu))

    def kitchen_forward(self, x2: torch.Tensor, bias) -> torch.Tensor:
        return N.mxfp8_linear(x2, self.weight, self.weight_scale, self.out_features, bias)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "MXFP8Linear":
        return cls(*N.quantize_mxfp8(weight), tuple(weight.shape), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return N.dequantize_mxfp8(self.weight, self.weight_scale, (self.out_features, self.in_features), dtype)


class Int8TensorwiseLinear(ComfyLinear):
    """int8 weights with one F32 scale (or one a row). W8A8 as ComfyUI computes it: each token's activations
    quantized to int8 (absmax / 127), an int8 x int8 -> int32 GEMM, the sums scaled back; ``full_precision``
    (the tag's ``full_precision_matrix_mult``): dequantized weight and a dense GEMM instead. ``rotation``
    (ConvRot, the tag's ``convrot_groupsize``; 0: none): the weight is stored rotated by groups of that many
    inputs, so the activations are rotated alike before they are quantized."""

    FORMAT = "int8_tensorwise"

    def __init__(self, weight, weight_scale, bias=None, full_precision: bool = False, rotation: int = 0):
        super().__init__()
        self._setup(tuple(weight.shape), bias)
        self.weight = frozen(weight)
        self.weight_scale = frozen(N.int8_scale(weight_scale).reshape(-1))  # [1] or [out]
        self.full_precision = bool(full_precision)
        self.rotation = int(rotation)
        self.use_kitchen = False  # set by prepare where comfy-kitchen has a GPU kernel for int8_linear

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int8TensorwiseLinear":
        return cls(*N.quantize_int8_tensorwise(weight), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.rotation:
            return N.dequantize_int8_convrot(self.weight, self.weight_scale, self.rotation, dtype)
        return N.dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.full_precision:
            return F.linear(x, self.dequantize(x.dtype), bias)
        if self.use_kitchen:
            return N.kitchen().int8_linear(x, self.weight, self.weight_scale, bias, x.dtype, convrot=self.rotation > 0,
                                           convrot_groupsize=self.rotation or 256)
        x2 = x.reshape(-1, self.in_features)
        if not int_mm_accepts(x2.device, x2.shape[0], self.in_features, self.out_features):
            return F.linear(x, self.dequantize(x.dtype), bias)  # the int8 GEMM refuses this shape here
        rotate = (lambda rows: N.rotate_inputs(rows, self.rotation)) if self.rotation else None
        y = w8a8(x2, self.weight, self.weight_scale, x.dtype, prepare=rotate).reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def layout_tag(self) -> dict:
        return {"convrot": True, "convrot_groupsize": self.rotation} if self.rotation else {}

    def extra_repr(self) -> str:
        how = "dequantized" if self.full_precision else "W8A8"
        return f"{super().extra_repr()}, {how}{f', ConvRot {self.rotation}' if self.rotation else ''}"


# -- the table's entries ------------------------------------------------------------------------------------------
def with_tag(layer: ComfyLinear, p) -> ComfyLinear:
    layer.full_precision = bool((p.get("config") or {}).get("full_precision_matrix_mult", False))
    return layer


def _nvfp4_from_stored(p) -> NVFP4Linear:
    return with_tag(NVFP4Linear(p["weight"], p["weight_scale"], p["weight_scale_2"], p["shape"],
                               pre_quant_scale=p.get("pre_quant_scale")), p)


def _mxfp8_from_stored(p) -> MXFP8Linear:
    return with_tag(MXFP8Linear(p["weight"], p["weight_scale"], p["shape"]), p)


def _int8_from_stored(p) -> Int8TensorwiseLinear:
    return Int8TensorwiseLinear(p["weight"], p["weight_scale"], rotation=(p.get("params") or {}).get("rotation", 0),
                                full_precision=(p.get("config") or {}).get("full_precision_matrix_mult", False))


def _blocks(module, block: int) -> torch.Tensor:
    """A block layer's scales unswizzled: U8 [stored rows, blocks a row]."""
    rows = module.weight.shape[0]
    return N.kitchen().from_blocked(module.weight_scale.view(torch.uint8), rows, module.weight.shape[1] * (
        2 if isinstance(module, NVFP4Linear) else 1) // block)


def _block_part(module, rows: slice, cols: slice, shape: Tuple[int, int]):
    """A new block layer of ``module``'s ``rows`` x ``cols`` (logical columns on block boundaries)."""
    nv = isinstance(module, NVFP4Linear)
    block = N.NVFP4_BLOCK if nv else N.MXFP8_BLOCK
    scales = _blocks(module, block)[rows, cols.start // block: cols.stop // block]
    swizzled = N.kitchen().to_blocked(scales.contiguous(), flatten=False).view(module.weight_scale.dtype)
    per = 2 if nv else 1
    weight = module.weight[rows, cols.start // per: cols.stop // per].contiguous()
    if nv:
        pre = None if module.pre_quant_scale is None else module.pre_quant_scale[cols].clone()
        part = NVFP4Linear(weight, swizzled, module.weight_scale_2.clone(), shape, module.bias, pre)
    else:
        part = MXFP8Linear(weight, swizzled, shape, module.bias)
    part.full_precision, part.use_kitchen = module.full_precision, module.use_kitchen
    return part


def _block_rows(fused, start: int, stop: int, bias: Optional[torch.Tensor]):
    part = _block_part(fused, slice(start, stop), slice(0, fused.in_features), (stop - start, fused.in_features))
    part.bias = None if bias is None else frozen(bias)
    return part


def _split_blocks(module, index: int, parts: int, dim: int):
    """Tensor parallel: rank ``index``'s share, whole padded tiles only (16 / 32 rows and columns)."""
    pad = N.NVFP4_BLOCK if isinstance(module, NVFP4Linear) else N.MXFP8_BLOCK
    out, n = module.out_features, module.in_features
    size = out if dim == 0 else n
    if size % (parts * pad) or module.weight.shape[0] != out:
        raise ValueError(f"ComfyUI {module.FORMAT} layer [{out}, {n}] cannot be split over {parts} ranks along "
                         f"{'its outputs' if dim == 0 else 'its inputs'} on whole blocks of {pad}; use "
                         "ulysses_degree / ring_degree instead of tensor parallel, or a bf16 file")
    step = size // parts
    part = slice(index * step, (index + 1) * step)
    if dim == 0:
        bias = None if module.bias is None else module.bias[part].clone()
        return _block_rows(module, part.start, part.stop, bias)
    return _block_part(module, slice(0, out), part, (out, step))


def _int8_concat(parts: List[Int8TensorwiseLinear], bias) -> Optional[Int8TensorwiseLinear]:
    if any((p.full_precision, p.rotation) != (parts[0].full_precision, parts[0].rotation) for p in parts):
        return None
    scales = torch.cat([p.weight_scale.expand(p.out_features) for p in parts])  # a per-tensor scale on every row
    return Int8TensorwiseLinear(torch.cat([p.weight for p in parts]), scales, bias, parts[0].full_precision,
                                parts[0].rotation)


def _int8_rows(fused: Int8TensorwiseLinear, start: int, stop: int, bias, cols: slice = slice(None)):
    scale = fused.weight_scale if fused.weight_scale.numel() == 1 else fused.weight_scale[start:stop]
    return Int8TensorwiseLinear(fused.weight[start:stop, cols].contiguous(), scale.clone(), bias, fused.full_precision,
                                fused.rotation)


def split_step(module, parts: int, dim: int, unit: int, why: str) -> int:
    """Tensor parallel: each rank's rows (``dim`` 0) or inputs (1), a multiple of ``unit`` (else a ValueError
    naming the layer's layout, ``why`` it needs whole units, and the alternatives)."""
    size = module.out_features if dim == 0 else module.in_features
    if size % (parts * unit):
        raise ValueError(f"ComfyUI {module.FORMAT} layer [{module.out_features}, {module.in_features}] cannot be split "
                         f"over {parts} ranks along {'its outputs' if dim == 0 else 'its inputs'} on whole {why} of "
                         f"{unit}; use ulysses_degree / ring_degree instead of tensor parallel, or a bf16 file")
    return size // parts


def _int8_split(module: Int8TensorwiseLinear, index: int, parts: int, dim: int) -> Int8TensorwiseLinear:
    step = split_step(module, parts, dim, module.rotation if dim == 1 and module.rotation else 1, "ConvRot groups")
    if dim == 0:
        bias = None if module.bias is None else module.bias[index * step:(index + 1) * step].clone()
        return _int8_rows(module, index * step, (index + 1) * step, bias)
    return _int8_rows(module, 0, module.out_features, module.bias, slice(index * step, (index + 1) * step))


def _int8_join(leaf: str, tensors: List[torch.Tensor], rows: List[int]) -> torch.Tensor:
    if leaf == "weight_scale":
        tensors = [t.reshape(-1).expand(n) for t, n in zip(tensors, rows)]
    return torch.cat(tensors)


def _block_bytes(pad: int, block: int, per_byte: int):
    def weight_bytes(shape: Tuple[int, int], group: int, dense: torch.dtype) -> int:
        rows, cols = N.roundup(shape[0], pad), N.roundup(shape[1], pad)
        scales = N.block_scale_shape(rows, cols // block)
        return rows * cols // per_byte + scales[0] * scales[1] + 4

    return weight_bytes


def _quantize(cls, pad: int):
    def quantize(weight: torch.Tensor, bias: Optional[torch.Tensor], group: int):
        if pad and (weight.shape[0] % pad or weight.shape[1] % pad):
            return None
        return cls.from_dense(weight, bias)

    return quantize


KITCHEN_LINEARS: List[type] = [NVFP4Linear, MXFP8Linear]  # the layers with a GPU kernel (int4.py adds its own)


def prepare_comfy(modules) -> List[str]:
    """int8_tensorwise: comfy-kitchen's ``int8_linear`` where it has a GPU kernel (CUDA / HIP) and agrees with the
    dequantized path on a probe; on CPU the engine's own ``torch._int_mm`` path (faster there, docs/quantization.md).
    The others (``KITCHEN_LINEARS``): their GPU kernel after ``_kitchen_probe``, else their ``CPU_PATH``. Notes."""
    layers = [m for m in modules if isinstance(m, ComfyLinear)]
    if not layers:
        return []
    notes = []
    int8 = [m for m in layers if isinstance(m, Int8TensorwiseLinear) and not m.full_precision]
    if int8:
        ok, why = _kitchen_int8_probe(int8[0].weight.device)
        for m in int8:
            m.use_kitchen = ok
        notes.append(f"int8_tensorwise matmul: {'comfy-kitchen int8_linear' if ok else 'torch._int_mm W8A8'} ({why})")
    for cls in KITCHEN_LINEARS:
        mine = [m for m in layers if isinstance(m, cls)]
        if mine:
            ok, why = _kitchen_probe(cls, mine[0].weight.device)
            for m in mine:
                m.use_kitchen = ok
            notes.append(f"{cls.FORMAT} matmul: {f'comfy-kitchen {cls.KITCHEN_OP}' if ok else cls.CPU_PATH} ({why})")
    for note in notes:
        log.info(note)
    return notes


_probes: Dict[str, Tuple[bool, str]] = {}


def _kitchen_probe(cls, device) -> Tuple[bool, str]:
    """Does comfy-kitchen's GPU kernel for ``cls`` run on ``device`` and agree with the dequantized path on a probe
    input (quantized by the kernel as ComfyUI does)? Once per device and format."""
    device = torch.device(device)
    key = f"{cls.FORMAT}:{device}"
    if key not in _probes:
        backend, why = N.gpu_backend(device, cls.KITCHEN_OP)
        if backend is None:
            _probes[key] = (False, why if device.type == "cuda" else "CPU")
        elif device_rt.capability(device) < cls.MIN_SM:
            _probes[key] = (False, f"{cls.KITCHEN_OP} needs sm{cls.MIN_SM[0]}{cls.MIN_SM[1]}+")
        else:
            try:
                err = _probe_error(device, cls.from_dense, lambda layer, x: layer.kitchen_forward(x, None))
                _probes[key] = (err < cls.PROBE_ERROR, f"comfy-kitchen {backend}, probe rel. error {err:.3f} "
                                                       "(activations quantized too)")
            except Exception as e:  # a kernel this GPU or build does not run
                _probes[key] = (False, _failed(cls.KITCHEN_OP, e))
    return _probes[key]


def _probe_error(device, from_dense, run) -> float:
    """A random [128, 256] layer made by ``from_dense`` on ``device``, ``run(layer, x)`` on bf16 inputs: its
    relative error against the dequantized weight's float32 product."""
    g = torch.Generator().manual_seed(0)
    layer = from_dense(torch.randn(128, 256, generator=g)).to(device)
    x = torch.randn(64, 256, generator=g).to(device, torch.bfloat16)
    ref = F.linear(x.float(), layer.dequantize())
    out = run(layer, x).float()
    return ((out - ref).norm() / ref.norm()).item()


def _failed(op: str, e: Exception) -> str:
    return f"{op} failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _kitchen_int8_probe(device) -> Tuple[bool, str]:
    device = torch.device(device)
    if str(device) in _probes:
        return _probes[str(device)]
    ck = N.kitchen()
    gpu = [name for name, b in ck.list_backends().items() if name in ("cuda", "hip") and b.get("available")
           and "int8_linear" in b.get("capabilities", ())]
    if device.type != "cuda" or not gpu:
        result = (False, "comfy-kitchen has no GPU int8 kernel here" if device.type == "cuda" else "CPU")
    else:
        try:
            err = _probe_error(device, Int8TensorwiseLinear.from_dense,
                               lambda w, x: ck.int8_linear(x, w.weight, w.weight_scale, None, x.dtype))
            result = (err < 0.05, f"comfy-kitchen {gpu[0]}, probe rel. error {err:.3f}")
        except Exception as e:  # a kernel this GPU does not run
            result = (False, _failed("comfy-kitchen int8_linear", e))
    _probes[str(device)] = result
    return result


HELP = {"nvfp4": "ComfyUI's NVFP4 (4-bit e2m1, blocks of 16), weight-only, computed by comfy-kitchen",
        "mxfp8": "ComfyUI's MXFP8 (e4m3, blocks of 32 with power-of-two scales), weight-only, computed by comfy-kitchen",
        "int8_tensorwise": "ComfyUI's INT8 (one scale per tensor), W8A8 as ComfyUI computes it"}
NVFP4 = register_format(WeightFormat(
    "nvfp4", NVFP4Linear, parse=lambda t: 0 if t == "nvfp4" else None, choices=("nvfp4",),
    quantize=_quantize(NVFP4Linear, 16), weight_bytes=_block_bytes(16, N.NVFP4_BLOCK, 2), from_stored=_nvfp4_from_stored,
    dequantize=lambda p: _nvfp4_from_stored(p).dequantize(), read_layers=read_layers("nvfp4"),
    concat=lambda parts, bias: None, rows=_block_rows, packed=True, dense_why="have sizes that are not multiples of 16",
    split=_split_blocks, comfy_formats=("nvfp4",), prepare=prepare_comfy, help=HELP["nvfp4"],
    storage="ComfyUI's layout: e2m1 pairs in U8, an e4m3 scale per 16 values (swizzled), an F32 scale per tensor",
    compute="dequantized per forward by comfy-kitchen, then a dense GEMM; Blackwell (sm100+): comfy-kitchen's "
            "`scaled_mm_nvfp4` with the activations quantized, after a probe"))
MXFP8 = register_format(WeightFormat(
    "mxfp8", MXFP8Linear, parse=lambda t: 0 if t == "mxfp8" else None, choices=("mxfp8",),
    quantize=_quantize(MXFP8Linear, 32), weight_bytes=_block_bytes(32, N.MXFP8_BLOCK, 1), from_stored=_mxfp8_from_stored,
    dequantize=lambda p: _mxfp8_from_stored(p).dequantize(), read_layers=read_layers("mxfp8"),
    concat=lambda parts, bias: None, rows=_block_rows, dense_why="have sizes that are not multiples of 32",
    split=_split_blocks, comfy_formats=("mxfp8",), help=HELP["mxfp8"],
    storage="ComfyUI's layout: e4m3 values, an e8m0 (power of two) scale per 32 values (swizzled)",
    compute="dequantized per forward by comfy-kitchen, then a dense GEMM; Blackwell (sm100+): comfy-kitchen's "
            "`scaled_mm_mxfp8` with the activations quantized, after a probe"))
INT8_TENSORWISE = register_format(WeightFormat(
    "int8-tensorwise", Int8TensorwiseLinear, parse=lambda t: 0 if t in ("int8-tensorwise", "int8_tensorwise") else None,
    choices=("int8-tensorwise",), quantize=_quantize(Int8TensorwiseLinear, 0),
    weight_bytes=lambda shape, group, dense: shape[0] * shape[1] + 4, from_stored=_int8_from_stored,
    dequantize=lambda p: _int8_from_stored(p).dequantize(), read_layers=read_layers("int8_tensorwise"),
    concat=_int8_concat, rows=_int8_rows, join=_int8_join, split=_int8_split, comfy_formats=("int8_tensorwise",),
    help=HELP["int8_tensorwise"], storage="ComfyUI's layout: int8 + one F32 scale per tensor (or per row); with "
                                          "ConvRot (tag `convrot`) rotated by groups of inputs",
    compute="activations quantized per token, `torch._int_mm` on CPU (faster there than comfy-kitchen's eager "
            "`int8_linear`), comfy-kitchen's `int8_linear` on CUDA / HIP after a probe; the tag's "
            "`full_precision_matrix_mult`: dequantized + dense GEMM; ConvRot: the activations rotated first"))
