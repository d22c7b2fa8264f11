"""``sgld quantize --format q8_0|q4_k|...``: write a DiT checkpoint as a GGUF file through
``gguf.GGUFWriter``, in the layout city96's ComfyUI-GGUF loads (docs/quantization.md, "GGUF"): diffusers' key
names without a prefix, the blocks' linear weights in the asked type, 1-D and small tensors F32, the rest in the
dense dtype; one tensor in memory at a time, the file written atomically."""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple, Union

import gguf
import numpy as np
import torch

from ....io.atomic import atomic_path, check_output_not_input
from ....io.checkpoint import check_architecture, open_checkpoint, parse_dtype
from ....models.family import CONFIG_FIELDS
from ..prequantized import QuantPlan
from ..registry import FileWriter, register_writer
from . import numerics as gn

Q = gguf.GGMLQuantizationType
# general.architecture: ComfyUI-GGUF's loader.py refuses any value outside its IMG_ARCH_LIST for a diffusion
# model (and a missing one sends it to key-based detection, which does not know ERNIE-Image). unsloth's
SMALL = 1024  # tensors of at most this many values stay F32 (ComfyUI-GGUF's convert.py QUANTIZATION_THRESHOLD)
# A block weight whose rows are not whole blocks of the asked type gets llama.cpp's fallback type (its
# llama_tensor_get_type rule for such tensors), else the dense dtype. Not reshaped into rows of 256 with
# comfy.gguf.orig_shape: ComfyUI-GGUF's convert.py does that only for SD1/SDXL, and a linear's bytes are kept
# as rows of whole blocks at load (quant/gguf/linear.py). The 8B model's linears (4096 / 12288 inputs) fit all.
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
DENSE_TYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
              Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
              Q.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K, Q.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_S,
              Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S, Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_S,
              Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K}
GGUF_FORMATS: Tuple[str, ...] = tuple(gn.NAMES)  # "f32", "f16", "bf16", "q8_0", ..., "q6_k"


def gguf_type(fmt: str) -> Optional[int]:
    """A ``--format`` name -> its GGUF type, None when it is not a GGUF type."""
    return gn.NAMES.get(str(fmt).lower())


def _tensor_type(family, key: str, shape: Tuple[int, ...], qtype: int, dense: int) -> int:
    """The GGUF type of one tensor (ComfyUI-GGUF's convert.py rules, the asked type for the block linears)."""
    count = 1
    for s in shape:
        count *= s
    layer, _, leaf = key.rpartition(".")
    if leaf == "weight" and family.is_block_linear(layer) and len(shape) == 2:
        for t in (qtype, FALLBACK.get(qtype)):
            if t is not None and shape[-1] % gn.block_size(t)[0] == 0:
                return t
        return dense
    if len(shape) <= 1 or count <= SMALL:
        return Q.F32
    return dense


def _as_stored(ckpt, plan, shapes: Dict[str, Tuple[int, ...]], qtype: int) -> torch.dtype:
    """The dense dtype "as stored": that of most tensors this writer stores dense (not the F32 small ones,
    which would outvote the rest in a GGUF input), else the plan's."""
    counts: Dict[torch.dtype, int] = {}
    for k, shape in shapes.items():
        dt = ckpt.header(k)[0]
        if _tensor_type(ckpt.family, k, shape, qtype, -1) == -1 and dt in DENSE_TYPES:
            counts[dt] = counts.get(dt, 0) + 1
    return max(counts, key=counts.get) if counts else plan.compute_dtype()


def quantize_gguf_file(src: str, dst: str, fmt: str, dtype: Union[None, str, torch.dtype] = None) -> dict:
    """Read a DiT checkpoint (bf16/fp16/fp32, or already quantized) and write ``dst`` (.gguf) with the
    blocks' linear weights in GGUF type ``fmt``; everything else F32 (1-D, small) or the dense dtype (``dtype``,
    else as stored). Returns a summary."""
    qtype = gguf_type(fmt)
    if qtype is None:
        raise ValueError(f"--format '{fmt}' is not a GGUF type; choose one of {', '.join(GGUF_FORMATS)}")
    check_output_not_input(src, dst)
    ckpt = open_checkpoint(src)
    cfg = check_architecture(ckpt)
    plan = QuantPlan(ckpt)
    skip = plan.stored_keys() - {layer + ".weight" for layer in plan.layers}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for k in sorted(ckpt.keys()):
        if k not in skip:
            layer, _, leaf = k.rpartition(".")
            shapes[k] = tuple(plan.layers[layer]["shape"]) if leaf == "weight" and layer in plan.layers else ckpt.header(k)[1]
    compute = parse_dtype(dtype) or _as_stored(ckpt, plan, shapes, qtype)
    if compute not in DENSE_TYPES:
        raise ValueError(f"--dtype {dtype}: a GGUF file stores dense tensors as bf16, fp16 or fp32")
    family = ckpt.family
    entries = [(k, _tensor_type(family, k, shape, qtype, DENSE_TYPES[compute]), shape) for k, shape in shapes.items()]

    writer = gguf.GGUFWriter(path=None, arch=family.gguf_architecture or family.name)  # as others write it
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_name(family.title)
    config_key = family.config_metadata_key
    if config_key:  # the file's config, else what the shapes do not say (rope axes, theta, eps ...)
        config_meta = next((f.metadata[config_key] for f in ckpt.files if config_key in f.metadata), None)
        writer.add_string(config_key, config_meta or json.dumps(
            {k: v for k, v in cfg.to_dict().items() if k not in CONFIG_FIELDS}))
    for k, t, shape in entries:
        # the bytes' shape, as gn.quantize gives them; the writer records the values' shape (GGUF order)
        byte_shape = (*shape[:-1], gn.row_bytes(t, shape[-1]))
        writer.add_tensor_info(k, byte_shape, np.dtype(np.uint8), gn.tensor_bytes(t, shape), raw_dtype=t)

    def dense(key: str) -> torch.Tensor:
        layer, _, leaf = key.rpartition(".")
        if leaf == "weight" and layer in plan.layers:
            return plan.read_dense(layer)
        return ckpt.read(key).float()

    counts: Dict[str, int] = {}
    with atomic_path(dst) as tmp:
        try:
            writer.write_header_to_file(path=tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for k, t, _ in entries:
                try:
                    raw = gn.quantize(dense(k), t)
                except ValueError as e:  # e.g. NaN / inf values: name the tensor
                    raise ValueError(f"{ckpt.where(k)}: {e}") from None
                writer.write_tensor_data(raw.numpy())
                counts[Q(t).name] = counts.get(Q(t).name, 0) + 1
        finally:
            writer.close()
    blocks = [(k.rpartition(".")[0], t) for k, t, _ in entries if k.endswith(".weight") and family.is_block_linear(k.rpartition(".")[0])]
    return {"input": src, "output": dst, "format": Q(qtype).name.lower(), "layers": sum(t == qtype for _, t in blocks),
            "fallback": {layer: Q(t).name.lower() for layer, t in blocks if t != qtype}, "types": counts,
            "input_bytes": os.path.getsize(src) if os.path.isfile(src) else None, "output_bytes": os.path.getsize(dst)}


GGUF_WRITER = register_writer(FileWriter("gguf", "GGUF", ".gguf", quantize_gguf_file, formats=lambda: GGUF_FORMATS,
                                         help="a file that ComfyUI-GGUF also loads"))
