"""``sgld quantize``: write a DiT checkpoint's block linears in a format of the table (registry.py)
in the sgld layout (each layer's module's own tensors), one layer in memory at a time (streaming writer,
atomic: engine/io/safetensors.py)."""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ...io.atomic import check_output_not_input
from ...io.checkpoint import check_architecture, open_checkpoint, parse_dtype
from ...io.load import checkpoint_shapes
from ...io.safetensors import write_safetensors_streaming
from .modules import stored_tensors
from .prequantized import SGLD_META_KEY, QuantPlan
from .registry import FileWriter, choices, get_format, parse_format, register_writer


def quantize_file(src: str, dst: str, fmt: str, dtype: Union[None, str, torch.dtype] = None,
                  layer_tensors: Callable[[torch.nn.Module], Dict[str, torch.Tensor]] = stored_tensors,
                  record: bool = True, quantize: Optional[Callable[[torch.Tensor], Optional[torch.nn.Module]]] = None) -> dict:
    """Read a DiT checkpoint (bf16/fp16/fp32, or already quantized) and write its block linears in
    format ``fmt`` in the sgld layout; every other float tensor in its own dtype (``dtype``: in that one; a
    quantized source's dense layers in its compute dtype). Returns a summary.
    ``layer_tensors``: a quantized layer's tensors by leaf name (another layout's, e.g. ComfyUI's with its
    tag: comfy/convert.py); ``record``: write the ``sgld_quant`` metadata (the sgld layout's); ``quantize``: a layer's
    quantizer other than the format's (ComfyUI's fp8: one scale per tensor), a module or None (stays dense)."""
    kind, group = parse_format(fmt)
    if kind is None:
        raise ValueError("--format must be one of " + ", ".join(choices()))
    target = get_format(kind)
    make = quantize or (lambda w: target.quantize(w, None, group))
    check_output_not_input(src, dst)
    ckpt = open_checkpoint(src)
    cfg = check_architecture(ckpt)
    family, expected = ckpt.family, checkpoint_shapes(cfg)  # the model's shapes: a block linear's [out, in]
    plan = QuantPlan(ckpt)
    asked = parse_dtype(dtype)
    compute = asked or plan.compute_dtype()

    def kept(stored: torch.dtype) -> torch.dtype:  # a tensor left as it is: its own dtype, or the one asked for
        return (asked or stored) if stored.is_floating_point and stored.itemsize >= 2 else stored
    skip = plan.stored_keys() - {layer + ".weight" for layer in plan.layers}
    specs: List[Tuple[str, torch.dtype, tuple]] = []
    jobs: Dict[str, Tuple[str, str]] = {}  # out key -> (layer, part)
    for k in sorted(ckpt.keys()):
        if k in skip:
            continue
        stored, shape = ckpt.header(k)
        layer, _, leaf = k.rpartition(".")
        if leaf == "weight" and family.is_block_linear(layer):
            n, k_in = shape[0], expected.get(k, plan.layers.get(layer, {}).get("shape", shape))[1]
            shaped = make(torch.empty(n, k_in, device="meta"))  # its tensors' shapes only
            if shaped is None:  # the format leaves this layer dense
                specs.append((k, compute if layer in plan.layers else kept(stored), (n, k_in)))
                jobs[k] = (layer, "dense")
                continue
            for leaf, t in layer_tensors(shaped).items():
                specs.append((f"{layer}.{leaf}", t.dtype, tuple(t.shape)))
                jobs[f"{layer}.{leaf}"] = (layer, leaf)
        elif leaf == "weight" and layer in plan.layers:  # a quantized non-block layer: store it dense
            specs.append((k, compute, shape))
            jobs[k] = (layer, "dense")
        else:
            specs.append((k, kept(stored), shape))
    cache: Dict[str, Tuple[str, dict]] = {}
    want = {key: dt for key, dt, _ in specs}

    def dense(layer: str) -> torch.Tensor:
        if layer not in plan.layers:
            return ckpt.read(layer + ".weight").float()
        return plan.read_dense(layer)

    def produce(key: str) -> torch.Tensor:
        if key not in jobs:
            t = ckpt.read(key)
            return t.to(want[key]) if t.dtype != want[key] else t
        layer, part = jobs[key]
        if part == "dense":
            return dense(layer).to(want[key])
        if cache.get("layer", (None,))[0] != layer:
            cache["layer"] = (layer, layer_tensors(make(dense(layer))))
        return cache["layer"][1][part]

    meta = {SGLD_META_KEY: json.dumps({"format": kind, "group_size": group or None, "version": 1,
                                       "compute_dtype": str(compute).replace("torch.", "")})} if record else {}
    config_key = family.config_metadata_key
    config_meta = next((f.metadata[config_key] for f in ckpt.files if config_key and config_key in f.metadata), None)
    if config_meta:
        meta[config_key] = config_meta
    write_safetensors_streaming(dst, specs, produce, meta)
    return {"input": src, "output": dst, "format": fmt, "layers": sum(1 for _, p in jobs.values() if p == "weight"),
            "input_bytes": os.path.getsize(src) if os.path.isfile(src) else None, "output_bytes": os.path.getsize(dst)}


SGLD_WRITER = register_writer(FileWriter("sgld", "safetensors", ".safetensors", quantize_file,
                                         help="the sgld layout, read back quantized by this engine"))
