"""ComfyUI's layout read from the header (the comfy entries' ``read_layers``): every layer tagged with a format
(``X.comfy_quant`` or the header's ``_quantization_metadata``), its weight, its scales and its tag's layout
parameters checked against the layer before anything is read; a CheckpointError names the file, the tensor and
what is allowed. The shapes: numerics.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from ....errors import CheckpointError
from ....io.checkpoint import PACKED_COLUMNS
from ....io.safetensors import DTYPE_NAMES
from ..prequantized import COMFY_META_KEY, parse_comfy_meta, parse_comfy_quant
from . import numerics as N


def _tag_value(config: dict, name: str, default, nested: bool = True):
    """A layout parameter as ComfyUI's loader reads it: the tag's own field, else (``nested``) its "params" object's."""
    params = config.get("params") if nested else None
    return config.get(name, (params if isinstance(params, dict) else {}).get(name, default))


def _rotation(where: str, config: dict) -> int:
    g = _tag_value(config, "convrot_groupsize", 256)
    if not N.is_rotation_size(g):
        raise CheckpointError(f"{where}: convrot_groupsize {g!r} must be a power of 4 (4, 16, 64, 256, ...)")
    return g


def _group(where: str, config: dict, default: int, nested: bool = True) -> int:
    g = _tag_value(config, "group_size", default, nested)
    if type(g) is not int or g < 1:
        raise CheckpointError(f"{where}: group_size {g!r} must be a positive integer")
    return g


def _int8_params(where: str, config: dict) -> dict:
    convrot = _tag_value(config, "convrot", False)
    if not isinstance(convrot, bool):
        raise CheckpointError(f"{where}: convrot must be true or false, not {convrot!r}")
    return {"rotation": _rotation(where, config) if convrot else 0}


def _w4a4_params(where: str, config: dict) -> dict:
    linear = _tag_value(config, "linear_dtype", "int4")
    if linear not in ("int4", "int8"):
        raise CheckpointError(f"{where}: linear_dtype {linear!r} must be 'int4' or 'int8'")
    return {"rotation": _rotation(where, config), "linear_dtype": linear}


def _w4a8_params(where: str, config: dict) -> dict:
    g = _group(where, config, 16)
    if g < 4 or (16 % g and g % 16):
        raise CheckpointError(f"{where}: group_size {g} must divide 16 or be a multiple of 16 (at least 4)")
    return {"group": g, "rotation": _rotation(where, config)}


def _awq_params(where: str, config: dict) -> dict:
    return {"group": _group(where, config, 64, nested=False)}  # ComfyUI reads it from the tag itself only


def _w4a8_columns(ckpt, layer: str, stored, params: dict, keys) -> int:
    """W4A8's inputs: its group scales' count times the group; the weight's width then says 4 or 6 bits a value."""
    key = layer + ".weight_s_rel"
    if key not in keys:
        raise CheckpointError(f"{ckpt.where(layer + '.weight')}: asym_w4a8_int8 weight without its '{key}'")
    _, shape = ckpt.header(key)
    if len(shape) != 2 or shape[0] != stored[0]:
        raise CheckpointError(f"{ckpt.where(key)}: weight_s_rel is {list(shape)}; allowed: [{stored[0]}, inputs / group_size]")
    k = shape[1] * params["group"]
    bits = {k // 2: 4, 3 * k // 4: 6}.get(stored[1])
    if k == 0 or k % 16 or bits is None or (bits == 6 and (k % 32 or params["group"] % 16 or layer + ".weight_codebook" in keys)):
        raise CheckpointError(f"{ckpt.where(layer + '.weight')}: an asym_w4a8_int8 weight of {k} inputs (weight_s_rel "
                              f"{list(shape)}, group_size {params['group']}; inputs a multiple of 16) is "
                              f"[{stored[0]}, {k // 2}] (4 bits) or "
                              f"[{stored[0]}, {3 * k // 4}] (6 bits: inputs a multiple of 32, group_size a multiple of 16, no "
                              f"codebook), not {list(stored)}")
    params["bits"] = bits
    return k


def _divides(*names: str):
    """A layer fits when each named layout parameter divides its inputs (else why not)."""
    def fits(shape, params) -> Optional[str]:
        bad = [f"{_NAMES[n]} {params[n]}" for n in names if params.get(n) and shape[1] % params[n]]
        return f"its {shape[1]} inputs are not a multiple of its {' and '.join(bad)}" if bad else None
    return fits


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # a tensor's scale: ComfyUI reads it as float32 whatever it is
_SCALAR = ((), (1,))
_NAMES = {"rotation": "convrot_groupsize", "group": "group_size"}


@dataclass(frozen=True)
class Layout:
    """One ComfyUI format's stored layer: the weight's ``storage`` dtype, ``per_byte`` values a stored element,
    ``pad`` (the tile a layer is padded to, 0: none), ``group`` (the only group_size its tag may say), ``params``
    ((where, tag) -> the tag's checked layout parameters), ``columns`` (the inputs when the weight alone does
    not say them), ``fits`` ((shape, params) -> why the layer does not fit them, or None) and its ``companions``
    (role -> (dtypes, shapes from the stored rows / logical inputs / params, value rule)); ``optional`` roles may
    be absent; ``refused`` roles name why a file with them is not read."""

    storage: torch.dtype
    companions: Dict[str, tuple]
    per_byte: int = 1
    pad: int = 0
    group: Optional[int] = None
    params: Callable[[str, dict], dict] = lambda where, config: {}
    columns: Optional[Callable] = None
    fits: Callable = lambda shape, params: None
    optional: Tuple[str, ...] = ()
    refused: Dict[str, str] = field(default_factory=dict)


def _config(where: str, config: dict, fmt: str, layout: Layout) -> Optional[Tuple[int, int]]:
    """Check a layer's tag; its ``orig_shape`` (a padded layer's real [out, in]) or None."""
    if layout.group is not None and config.get("group_size", layout.group) != layout.group:
        raise CheckpointError(f"{where}: group_size {config['group_size']!r}; ComfyUI's {fmt} has groups of {layout.group}")
    if not isinstance(config.get("full_precision_matrix_mult", False), bool):
        raise CheckpointError(f"{where}: full_precision_matrix_mult must be true or false")
    shape = config.get("orig_shape")
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise CheckpointError(f"{where}: orig_shape {shape!r} must be [out, in], two positive integers")
    return shape[0], shape[1]


def _check(ckpt, key: str, what: str, dtypes: Tuple[torch.dtype, ...], shapes: Tuple[tuple, ...], layer_shape) -> torch.dtype:
    dt, shape = ckpt.header(key)
    if dt not in dtypes or tuple(shape) not in shapes:
        allowed = " or ".join(DTYPE_NAMES[d] for d in dtypes) + " " + " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(f"{ckpt.where(key)}: {what} of layer {list(layer_shape)} is {DTYPE_NAMES[dt]} "
                              f"{list(shape)}; allowed: {allowed}")
    return dt


def _layer(plan, keys, layer: str, fmt: str, layout: Layout) -> dict:
    ckpt, config = plan.ckpt, plan.declared[layer]
    wkey = layer + ".weight"
    if wkey not in keys:
        raise CheckpointError(f"{ckpt.describe()}: layer '{layer}' is tagged {fmt} but '{wkey}' is missing")
    missing = N.kitchen_missing()
    if missing:
        raise CheckpointError(f"{ckpt.where(wkey)}: {missing}")
    where = f"{ckpt.describe()}: layer '{layer}' ({fmt})"
    orig = _config(where, config, fmt, layout)
    params = layout.params(where, config)
    dt, stored = ckpt.header(wkey)
    if dt != layout.storage or len(stored) != 2:
        raise CheckpointError(f"{ckpt.where(wkey)}: a {fmt} weight is {DTYPE_NAMES[layout.storage]} [rows, "
                              f"columns], not {DTYPE_NAMES[dt]} {list(stored)}")
    rows = stored[0]
    cols = layout.columns(ckpt, layer, stored, params, keys) if layout.columns else stored[1] * layout.per_byte
    shape = orig or (rows, cols)
    pad = layout.pad or 1
    want = [N.roundup(shape[0], pad), N.roundup(shape[1], pad)]
    if want != [rows, cols]:
        raise CheckpointError(f"{ckpt.where(wkey)}: a {fmt} weight of [{shape[0]}, {shape[1]}] is stored "
                              f"{'padded to ' if layout.pad else 'as '}{want}, not [{rows}, {cols}]")
    why = layout.fits(shape, params)
    if why:
        raise CheckpointError(f"{where}: the layer [{shape[0]}, {shape[1]}] does not fit its tag: {why}")
    info = {"shape": tuple(shape), "extra": {}, "rules": {}, "views": {}, "params": params}
    for role, why in layout.refused.items():
        if f"{layer}.{role}" in keys:
            raise CheckpointError(f"{ckpt.where(layer + '.' + role)}: {why}")
    for role, (dtypes, shapes_of, rule) in layout.companions.items():
        key = f"{layer}.{role}"
        if key not in keys:
            if role in layout.optional:
                continue
            raise CheckpointError(f"{ckpt.where(wkey)}: {fmt} weight without its '{key}'")
        stored_dt = _check(ckpt, key, role, dtypes, shapes_of(rows, cols, params), shape)
        if role == "weight_scale":
            info["scale_key"] = key
        else:
            info["extra"][role] = key
        info["rules"][role] = rule
        if stored_dt == torch.uint8 and dtypes[0] != torch.uint8:  # U8 bytes read as the format's scale type, as ComfyUI does
            info["views"][role] = dtypes[0]
    return info


def read_layers(fmt: str):
    """The entry's ``read_layers``: every layer tagged ``fmt``, its weight and companions checked from the header."""
    layout = LAYOUTS[fmt]

    def read(plan, keys) -> Dict[str, dict]:
        layers = {}
        for layer in sorted(plan.declared):
            if plan.declared[layer].get("format") == fmt:
                layers[layer] = _layer(plan, keys, layer, fmt, layout)
                plan.sources.add("comfy_quant")
        return layers

    return read


LAYOUTS = {
    "nvfp4": Layout(torch.uint8, per_byte=2, pad=16, group=N.NVFP4_BLOCK, optional=("pre_quant_scale",), companions={
        "weight_scale": ((torch.float8_e4m3fn, torch.uint8), lambda r, c, p: (N.block_scale_shape(r, c // N.NVFP4_BLOCK),), ">= 0"),
        "weight_scale_2": (_FLOATS, lambda r, c, p: _SCALAR, "> 0"),
        "pre_quant_scale": (_FLOATS, lambda r, c, p: ((c,),), "finite")}),
    "mxfp8": Layout(torch.float8_e4m3fn, pad=32, group=N.MXFP8_BLOCK, companions={
        "weight_scale": ((torch.float8_e8m0fnu, torch.uint8), lambda r, c, p: (N.block_scale_shape(r, c // N.MXFP8_BLOCK),), "> 0")}),
    "int8_tensorwise": Layout(torch.int8, params=_int8_params, fits=_divides("rotation"), companions={
        "weight_scale": (_FLOATS, lambda r, c, p: _SCALAR + ((r,), (r, 1)), "> 0")}),
    "convrot_w4a4": Layout(torch.int8, per_byte=2, params=_w4a4_params, fits=_divides("rotation"), companions={
        "weight_scale": (_FLOATS, lambda r, c, p: ((r,), (r, 1)), "> 0")}),
    "asym_w4a8_int8": Layout(torch.int8, params=_w4a8_params, columns=_w4a8_columns, fits=_divides("rotation"),
                             optional=("weight_codebook",), companions={
        "weight_s_rel": ((torch.float8_e4m3fn, torch.uint8, torch.float32), lambda r, c, p: ((r, c // p["group"]),), ">= 0"),
        "weight_s_channel": (_FLOATS, lambda r, c, p: ((r,),), "> 0"),
        "weight_codebook": (_FLOATS, lambda r, c, p: ((16,),), "finite")},
        refused={"weight_correction": "an asymmetric W4A8 layer (weight_correction) is not read: ComfyUI's loader "
                                      "(comfy/ops.py) ignores the correction, so the file would compute other weights "
                                      "there; write it symmetric (comfy-kitchen's default)"}),
    "awq_w4a16": Layout(torch.int8, per_byte=2, params=_awq_params, fits=_divides("group"), companions={
        "weight_scale": (_FLOATS, lambda r, c, p: ((c // p["group"], r),), "> 0"),
        "weight_zeros": (_FLOATS, lambda r, c, p: ((c // p["group"], r),), "finite")}),
}


def packed_columns(ckpt) -> Dict[str, int]:
    """The architecture check's view of ComfyUI's 4-bit integer weights (engine/io/checkpoint.py's
    ``PACKED_COLUMNS``): weight key -> the inputs a stored row holds, as the layer's tag says; whatever is unclear
    is left to ``read_layers``, which checks it in full."""
    tags, prefix = {}, getattr(ckpt, "prefix", "")
    for f in ckpt.files:
        if COMFY_META_KEY in f.metadata:
            tags.update({k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in parse_comfy_meta(f).items()})
    tags.update({k[: -len(".comfy_quant")]: parse_comfy_quant(ckpt, k) for k in ckpt.keys() if k.endswith(".comfy_quant")})
    out = {}
    for layer, config in tags.items():
        wkey, fmt = layer + ".weight", config.get("format")
        if fmt not in ("convrot_w4a4", "awq_w4a16", "asym_w4a8_int8") or wkey not in ckpt.index:
            continue
        dt, shape = ckpt.header(wkey)
        if dt != torch.int8 or len(shape) != 2:
            continue
        if fmt != "asym_w4a8_int8":
            out[wkey] = 2 * shape[1]
        elif layer + ".weight_s_rel" in ckpt.index:
            group, s_rel = _tag_value(config, "group_size", 16), ckpt.header(layer + ".weight_s_rel")[1]
            if type(group) is int and len(s_rel) == 2:
                out[wkey] = s_rel[1] * group
    return out


PACKED_COLUMNS.append(packed_columns)
