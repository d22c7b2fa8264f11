"""ComfyUI's quantized checkpoints as the community writes them, made here with comfy-kitchen's own quantizers
(the real package, ComfyUI's kernel library) in ComfyUI's layout: ``<layer>.weight`` in the storage type, its
scales, and the layer's tag as a ``<layer>.comfy_quant`` U8 JSON tensor or in the header's
``_quantization_metadata``. The policy of the published NVFP4 ERNIE-Image files: the blocks' attention
projections and MLP quantized, modulation and norms kept. ``NEW_FORMATS``: the 4-bit integer layouts and int8
with ConvRot rotation ("int8_convrot": ComfyUI's int8_tensorwise tagged ``convrot``); AWQ has no quantizer in
comfy-kitchen (AWQ is calibrated offline), so its tensors are made here by round-to-nearest in its layout."""
from __future__ import annotations

import json
from typing import Dict

import torch
from safetensors.torch import save_file

FORMATS = ("nvfp4", "mxfp8", "int8_tensorwise")
NEW_FORMATS = ("int8_convrot", "convrot_w4a4", "asym_w4a8_int8", "awq_w4a16")
PREFIX = "model.diffusion_model."  # as ComfyUI saves a diffusion model
ROTATION, W4A8_GROUP, AWQ_GROUP = 16, 16, 32  # small enough for the tiny model's widths and their halves


def quantized_by_policy(key: str, v: torch.Tensor) -> bool:
    return key.startswith("layers.") and key.endswith(".weight") and v.dim() == 2 and (
        ".self_attention.to" in key or ".mlp." in key)


def kitchen_tensors(fmt: str, w: torch.Tensor, rotation: int = ROTATION):
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
    if fmt == "int8_convrot":
        layout = ck.tensor.TensorWiseINT8Layout
        q, params = layout.quantize(w, per_channel=True, convrot=True, convrot_groupsize=rotation)
        return {"weight": q, "weight_scale": params.scale}, layout.dequantize(q, params)
    if fmt == "convrot_w4a4":
        q, scale = ck.quantize_convrot_w4a4_weight(w, rotation)
        return {"weight": q, "weight_scale": scale}, ck.dequantize_convrot_w4a4_weight(q, scale, rotation, 64, torch.float32)
    if fmt == "asym_w4a8_int8":
        q, s_rel, s_channel, _, codebook = ck.quantize_w4a8_int8_weight(w, W4A8_GROUP, rotation)
        dense = ck.dequantize_w4a8_int8_weight(q, s_rel, s_channel, codebook, None, W4A8_GROUP, rotation, torch.float32)
        return {"weight": q, "weight_s_rel": s_rel, "weight_s_channel": s_channel, "weight_codebook": codebook}, dense
    if fmt == "awq_w4a16":
        return awq_tensors(w)
    q, scale = ck.quantize_int8_tensorwise(w)
    return {"weight": q, "weight_scale": scale}, ck.dequantize_int8_simple(q, scale)


def awq_tensors(w: torch.Tensor, group: int = AWQ_GROUP):
    """AWQ's layout by round-to-nearest (w = (q - 8) * scale + zero, q in 0..15, low nibble first; scale and zero
    [in / group, out] in bf16), and the weight comfy-kitchen's AWQ layout dequantizes it to."""
    import comfy_kitchen as ck
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = ((groups - lo[..., None]) / scale.float()[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    stored = {"weight": packed, "weight_scale": scale.t().contiguous(), "weight_zeros": zero.t().contiguous()}
    layout = ck.tensor.TensorCoreAWQW4A16Layout
    params = layout.Params(scale=stored["weight_scale"], zeros=stored["weight_zeros"], group_size=group,
                           orig_dtype=torch.float32, orig_shape=(n, k))
    return stored, layout.dequantize(packed, params)


def tag_fields(fmt: str, rotation: int = ROTATION) -> dict:
    """A layer's tag as ComfyUI writes it (comfy/ops.py ``_quantized_weight_state_dict``)."""
    return {"int8_convrot": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": rotation},
            "convrot_w4a4": {"format": fmt, "convrot_groupsize": rotation},
            "asym_w4a8_int8": {"format": fmt, "group_size": W4A8_GROUP, "convrot_groupsize": rotation},
            "awq_w4a16": {"format": fmt, "group_size": AWQ_GROUP}}.get(fmt, {"format": fmt})


def tag(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def write_comfy(path, sd: Dict[str, torch.Tensor], fmt: str, tags: str = "tensor", full_precision: bool = True,
                prefix: str = PREFIX) -> Dict[str, torch.Tensor]:
    """Write ``sd`` with its policy layers in ``fmt`` (of FORMATS or NEW_FORMATS; tags: "tensor" per layer or "header" metadata);
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
        conf = {**tag_fields(fmt), **({"full_precision_matrix_mult": True} if full_precision else {})}
        if tags == "tensor":
            out[f"{prefix}{layer}.comfy_quant"] = tag(conf)
        else:
            layers[prefix + layer] = conf
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if layers else None
    save_file(out, str(path), metadata=meta)
    return dense
