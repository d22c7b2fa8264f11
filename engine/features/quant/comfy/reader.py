"""ComfyUI's layout read from the header (the "nvfp4", "mxfp8", "int8-tensorwise" entries' ``read_layers``): every
layer tagged with a format (``X.comfy_quant`` or the header's ``_quantization_metadata``), its weight, its scales
and its tag checked against the layer before anything is read; a CheckpointError names the file, the tensor and
what is allowed. The shapes: numerics.py."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ....errors import CheckpointError
from ....io.safetensors import DTYPE_NAMES
from . import numerics as N


def _config(ckpt, layer: str, config: dict, fmt: str, group: int) -> Optional[Tuple[int, int]]:
    """Check a layer's tag; its ``orig_shape`` (a padded layer's real [out, in]) or None."""
    where = f"{ckpt.describe()}: layer '{layer}' ({fmt})"
    if group is not None and config.get("group_size", group) != group:
        raise CheckpointError(f"{where}: group_size {config['group_size']!r}; ComfyUI's {fmt} has groups of {group}")
    if config.get("convrot") or (isinstance(config.get("params"), dict) and config["params"].get("convrot")):
        raise CheckpointError(f"{where}: int8 with ConvRot rotation (convrot) is not read by SGLDiffusion; use a plain "
                              "int8_tensorwise, fp8 or bf16 file")
    if not isinstance(config.get("full_precision_matrix_mult", False), bool):
        raise CheckpointError(f"{where}: full_precision_matrix_mult must be true or false")
    shape = config.get("orig_shape")
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise CheckpointError(f"{where}: orig_shape {shape!r} must be [out, in], two positive integers")
    return shape[0], shape[1]


def _check(ckpt, key: str, what: str, dtypes: Tuple[torch.dtype, ...], shapes: Tuple[tuple, ...], layer_shape) -> None:
    dt, shape = ckpt.header(key)
    if dt not in dtypes or tuple(shape) not in shapes:
        allowed = " or ".join(DTYPE_NAMES[d] for d in dtypes) + " " + " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(f"{ckpt.where(key)}: {what} of layer {list(layer_shape)} is {DTYPE_NAMES[dt]} "
                              f"{list(shape)}; allowed: {allowed}")


def read_layers(fmt: str):
    """The entry's ``read_layers``: every layer tagged ``fmt``, its weight and companions checked from the header."""
    spec = SPECS[fmt]

    def read(plan, keys) -> Dict[str, dict]:
        ckpt, layers = plan.ckpt, {}
        for layer in sorted(plan.declared):
            config = plan.declared[layer]
            if config.get("format") != fmt:
                continue
            wkey = layer + ".weight"
            if wkey not in keys:
                raise CheckpointError(f"{ckpt.describe()}: layer '{layer}' is tagged {fmt} but '{wkey}' is missing")
            missing = N.kitchen_missing()
            if missing:
                raise CheckpointError(f"{ckpt.where(wkey)}: {missing}")
            orig = _config(ckpt, layer, config, fmt, spec["group"])
            dt, stored = ckpt.header(wkey)
            if dt != spec["storage"] or len(stored) != 2:
                raise CheckpointError(f"{ckpt.where(wkey)}: a {fmt} weight is {DTYPE_NAMES[spec['storage']]} [rows, "
                                      f"columns], not {DTYPE_NAMES[dt]} {list(stored)}")
            rows, cols = stored[0], stored[1] * spec["per_byte"]
            shape = orig or (rows, cols)
            pad = spec["pad"]
            if pad and (N.roundup(shape[0], pad), N.roundup(shape[1], pad)) != (rows, cols):
                raise CheckpointError(f"{ckpt.where(wkey)}: a {fmt} weight of [{shape[0]}, {shape[1]}] is stored padded to "
                                      f"[{N.roundup(shape[0], pad)}, {N.roundup(shape[1], pad)}], not [{rows}, {cols}]")
            info = {"shape": tuple(shape), "extra": {}, "rules": {}, "views": {}}
            for role, (dtypes, shapes_of, rule) in spec["companions"].items():
                key = f"{layer}.{role}"
                if key not in keys:
                    if role in spec["optional"]:
                        continue
                    raise CheckpointError(f"{ckpt.where(wkey)}: {fmt} weight without its '{key}'")
                _check(ckpt, key, role, dtypes, shapes_of(rows, cols), shape)
                if role == "weight_scale":
                    info["scale_key"] = key
                else:
                    info["extra"][role] = key
                info["rules"][role] = rule
                if torch.uint8 in dtypes:  # U8 bytes are read as the format's scale type, as ComfyUI does
                    info["views"][role] = dtypes[0]
            layers[layer] = info
            plan.sources.add("comfy_quant")
        return layers

    return read


_SCALAR = ((), (1,))
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # a tensor's scale: ComfyUI reads it as float32 whatever it is
SPECS = {  # role -> (dtypes, allowed shapes from the stored [rows, columns], value rule); per_byte: values a stored element
    "nvfp4": {"storage": torch.uint8, "per_byte": 2, "pad": 16, "group": N.NVFP4_BLOCK, "optional": ("pre_quant_scale",),
              "companions": {
                  "weight_scale": ((torch.float8_e4m3fn, torch.uint8),
                                   lambda r, c: (N.block_scale_shape(r, c // N.NVFP4_BLOCK),), ">= 0"),
                  "weight_scale_2": (_FLOATS, lambda r, c: _SCALAR, "> 0"),
                  "pre_quant_scale": (_FLOATS, lambda r, c: ((c,),), "finite")}},
    "mxfp8": {"storage": torch.float8_e4m3fn, "per_byte": 1, "pad": 32, "group": N.MXFP8_BLOCK, "optional": (),
              "companions": {
                  "weight_scale": ((torch.float8_e8m0fnu, torch.uint8),
                                   lambda r, c: (N.block_scale_shape(r, c // N.MXFP8_BLOCK),), "> 0")}},
    "int8_tensorwise": {"storage": torch.int8, "per_byte": 1, "pad": 0, "group": None, "optional": (),
                        "companions": {"weight_scale": (_FLOATS, lambda r, c: _SCALAR + ((r,), (r, 1)), "> 0")}},
}
