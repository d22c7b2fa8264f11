"""ComfyUI's quantized checkpoints as the community writes them, made here with comfy-kitchen's own quantizers
(the real package, ComfyUI's kernel library) in ComfyUI's layout: ``<layer>.weight`` in the storage type, its
scales, and the layer's tag as a ``<layer>.comfy_quant`` U8 JSON tensor or in the header's
``_quantization_metadata``. The policy of the published NVFP4 ERNIE-Image files: the blocks' attention
projections and MLP quantized, modulation and norms kept."""
from __future__ import annotations

import json
from typing import Dict

import torch
from safetensors.torch import save_file

FORMATS = ("nvfp4", "mxfp8", "int8_tensorwise")
PREFIX = "model.diffusion_model."  # as ComfyUI saves a diffusion model


def quantized_by_policy(key: str, v: torch.Tensor) -> bool:
    return key.startswith("layers.") and key.endswith(".weight") and v.dim() == 2 and (
        ".self_attention.to" in key or ".mlp." in key)


def kitchen_tensors(fmt: str, w: torch.Tensor):
    """(stored tensors by suffix, the weight comfy-kitchen dequantizes them to)."""
    import comfy_kitchen as ck
    w = w.float()
    if fmt == "nvfp4":
        scale = w.abs().amax() / (448.0 * 6.0)
        q, block = ck.quantize_nvfp4(w, scale)
        return {"weight": q, "weight_scale": block, "weight_scale_2": scale}, ck.dequantize_nvfp4(q, scale, block, torch.float32)
    if fmt == "mxfp8":
        q, block = ck.quantize_mxfp8(w)
        return {"weight": q, "weight_scale": block}, ck.dequantize_mxfp8(q, block, torch.float32)
    q, scale = ck.quantize_int8_tensorwise(w)
    return {"weight": q, "weight_scale": scale}, ck.dequantize_int8_simple(q, scale)


def tag(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def write_comfy(path, sd: Dict[str, torch.Tensor], fmt: str, tags: str = "tensor", full_precision: bool = True,
                prefix: str = PREFIX) -> Dict[str, torch.Tensor]:
    """Write ``sd`` with its policy layers in ``fmt`` (tags: "tensor" per layer or "header" metadata);
    ``full_precision``: the tag's ``full_precision_matrix_mult``. Returns the dense state comfy-kitchen
    dequantizes the file to (unquantized tensors as they are)."""
    out, dense, layers = {}, {}, {}
    for k, v in sd.items():
        if not quantized_by_policy(k, v):
            out[prefix + k] = dense[k] = v
            continue
        layer = k[: -len(".weight")]
        stored, dense[k] = kitchen_tensors(fmt, v)
        out.update({f"{prefix}{layer}.{leaf}": t for leaf, t in stored.items()})
        conf = {"format": fmt, **({"full_precision_matrix_mult": True} if full_precision else {})}
        if tags == "tensor":
            out[f"{prefix}{layer}.comfy_quant"] = tag(conf)
        else:
            layers[prefix + layer] = conf
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if layers else None
    save_file(out, str(path), metadata=meta)
    return dense
