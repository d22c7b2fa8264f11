"""``sgld quantize --format nvfp4|mxfp8|int8-tensorwise``: a DiT checkpoint's block linears (attention and MLP;
the modulation, norms and embedders keep the compute dtype, the community files' policy) written with
comfy-kitchen's quantizers in ComfyUI's layout: each layer's tensors as ComfyUI's loader pops them
(comfy/ops.py ``_load_quantized_module``) and its ``X.comfy_quant`` tag, so ComfyUI loads the file as its own."""
from __future__ import annotations

import json
from typing import Dict

import torch
from torch import nn

from ..convert import quantize_file
from ..modules import stored_tensors
from ..registry import FileWriter, register_writer
from .linear import INT8_TENSORWISE, MXFP8, NVFP4, Int8TensorwiseLinear


def comfy_tag(conf: dict) -> torch.Tensor:
    """A ComfyUI per-layer tag: the JSON's UTF-8 bytes as a U8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def comfy_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """A quantized layer's tensors as ComfyUI stores them: its own (a per-tensor int8 scale as a scalar), and its tag."""
    out = stored_tensors(module)
    conf = {"format": module.FORMAT}
    if isinstance(module, Int8TensorwiseLinear):
        if out["weight_scale"].numel() == 1:
            out["weight_scale"] = out["weight_scale"].reshape(())
        if module.full_precision:
            conf["full_precision_matrix_mult"] = True
    out["comfy_quant"] = comfy_tag(conf)
    return out


def write_comfy_file(src: str, dst: str, fmt: str, dtype=None) -> dict:
    return quantize_file(src, dst, fmt, dtype, layer_tensors=comfy_tensors, record=False)


COMFY_WRITER = register_writer(FileWriter(
    "comfy", "ComfyUI quantized safetensors", ".safetensors", write_comfy_file,
    formats=lambda: tuple(c for f in (NVFP4, MXFP8, INT8_TENSORWISE) for c in f.choices),
    help="ComfyUI's own layout (per-layer comfy_quant tags), written with comfy-kitchen; loads in ComfyUI's loader"))
