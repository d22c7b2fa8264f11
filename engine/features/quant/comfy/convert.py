"""``sgld quantize --format nvfp4|mxfp8|int8-tensorwise|convrot-w4a4|asym-w4a8-int8|float8-e4m3fn``: a DiT
checkpoint's block linears (those the model family's description names; every other layer keeps the compute
dtype, the community files' policy) written with
comfy-kitchen's quantizers in ComfyUI's layout: each layer's tensors as ComfyUI's loader pops them
(comfy/ops.py ``_load_quantized_module``) and its ``X.comfy_quant`` tag, so ComfyUI loads the file as its own."""
from __future__ import annotations

import json
from typing import Dict

import torch
from torch import nn

from ..convert import quantize_file
from ..fp8.linear import FP8Linear
from ..fp8.numerics import FP8_DTYPE, FP8_MAX
from ..modules import stored_tensors
from ..registry import FileWriter, register_writer
from .int4 import ASYM_W4A8_INT8, CONVROT_W4A4
from .linear import INT8_TENSORWISE, MXFP8, NVFP4, Int8TensorwiseLinear
from .numerics import kitchen


def comfy_tag(conf: dict) -> torch.Tensor:
    """A ComfyUI per-layer tag: the JSON's UTF-8 bytes as a U8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def comfy_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """A quantized layer's tensors as ComfyUI stores them (a per-tensor int8 scale as a scalar, one a row as
    [out, 1]: ComfyUI's dequantizer broadcasts it so), and its tag with the layer's layout parameters."""
    out = stored_tensors(module)
    if isinstance(module, FP8Linear):  # ComfyUI's float8_e4m3fn: one scale per tensor (fp8_per_tensor made it)
        out["comfy_quant"] = comfy_tag({"format": COMFY_FP8})
        return out
    conf = {"format": module.FORMAT, **module.layout_tag()}
    if isinstance(module, Int8TensorwiseLinear):
        scale = out["weight_scale"]
        out["weight_scale"] = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
    if module.full_precision:
        conf["full_precision_matrix_mult"] = True
    out["comfy_quant"] = comfy_tag(conf)
    return out


def fp8_per_tensor(weight: torch.Tensor) -> FP8Linear:
    """A layer in ComfyUI's float8_e4m3fn layout: e4m3 with one F32 scale (absmax / 448), comfy-kitchen's quantizer."""
    w = weight.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    if w.device.type == "meta":  # sgld quantize asks for the tensors' shapes first
        return FP8Linear(torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"), scale)
    return FP8Linear(kitchen().quantize_per_tensor_fp8(w, scale, FP8_DTYPE), scale)


def write_comfy_file(src: str, dst: str, fmt: str, dtype=None) -> dict:
    if fmt == FP8_NAME:
        summary = quantize_file(src, dst, "fp8", dtype, layer_tensors=comfy_tensors, record=False, quantize=fp8_per_tensor)
        return {**summary, "format": fmt}
    return quantize_file(src, dst, fmt, dtype, layer_tensors=comfy_tensors, record=False)


COMFY_FP8, FP8_NAME = "float8_e4m3fn", "float8-e4m3fn"  # ComfyUI's name for it, and the --format name
COMFY_WRITER = register_writer(FileWriter(
    "comfy", "ComfyUI quantized safetensors", ".safetensors", write_comfy_file,
    formats=lambda: tuple(c for f in (NVFP4, MXFP8, INT8_TENSORWISE, CONVROT_W4A4, ASYM_W4A8_INT8) for c in f.choices)
    + (FP8_NAME,),
    help="ComfyUI's own layout (per-layer comfy_quant tags), written with comfy-kitchen; loads in ComfyUI's loader; "
         f"{FP8_NAME}: ComfyUI's fp8, one scale per tensor"))
