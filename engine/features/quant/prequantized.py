"""Pre-quantized checkpoints: which layers a file stores quantized and how (``QuantPlan``), every quantized
weight's companions checked from the header, and the scales checked as they are read. The file dialects
(sgld, ComfyUI scaled_fp8, ComfyUI mixed precision) are in docs/quantization.md; each weight format finds
its own layers (``read_layers`` of its entry in registry.py: e.g. fp8/linear.py's ``read_fp8_layers``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from ...errors import CheckpointError
from ...io.safetensors import COMPUTE_DTYPES, DTYPE_NAMES, load_json_object
from .registry import FORMATS, get_format

SGLD_META_KEY = "sgld_quant"
COMFY_META_KEY = "_quantization_metadata"
# Per-layer tensors of the ComfyUI formats that a weight-only engine does not need.
IGNORED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
MAX_COMFY_QUANT_BYTES = 64 * 1024  # a ComfyUI per-layer format tag is a few dozen bytes of JSON
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
COMPUTE_DTYPE_NAMES = tuple(str(d).replace("torch.", "") for d in COMPUTE_DTYPES.values())  # as sgld quantize records
SGLD_META_FIELDS = {  # field -> (check, what is allowed; "format": the table's names, filled in when checked)
    "format": (lambda v: isinstance(v, str) and v in FORMATS, ""),
    "group_size": (lambda v: v is None or type(v) is int and v > 0, "a positive integer or null"),
    "version": (lambda v: type(v) is int and v == 1, "1"),
    "compute_dtype": (lambda v: v in COMPUTE_DTYPE_NAMES, "'bfloat16', 'float16' or 'float32'"),
}


def parse_comfy_quant(ckpt, key: str) -> dict:
    """A ComfyUI ``X.comfy_quant`` tensor: uint8 bytes of a JSON object such as {"format": "float8_e4m3fn"}."""
    dtype, shape = ckpt.header(key)
    if dtype != torch.uint8 or len(shape) != 1 or shape[0] > MAX_COMFY_QUANT_BYTES:
        raise CheckpointError(f"{ckpt.where(key)} is {DTYPE_NAMES[dtype]} {list(shape)}; a ComfyUI format tag must be "
                              f"1-D U8 JSON text of at most {MAX_COMFY_QUANT_BYTES} bytes")
    return load_json_object(ckpt.read(key).numpy().tobytes(), ckpt.where(key))


def _parse_sgld_meta(f) -> dict:
    where = f"{f.path}: metadata '{SGLD_META_KEY}'"
    meta = load_json_object(f.metadata[SGLD_META_KEY], where)
    formats = " or ".join(repr(name) for name in FORMATS)
    if "format" not in meta:
        raise CheckpointError(f"{where}: field 'format' is missing (allowed: {formats})")
    for name, (ok, allowed) in SGLD_META_FIELDS.items():
        if name in meta and not ok(meta[name]):
            raise CheckpointError(f"{where}: field '{name}' = {meta[name]!r} must be {allowed or formats}")
    return meta


def parse_comfy_meta(f) -> dict:
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
    checked as they are read (``stored``)."""

    def __init__(self, ckpt):
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
                comfy_meta.update(parse_comfy_meta(f))
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
                declared[k[: -len(".comfy_quant")]] = parse_comfy_quant(ckpt, k)
        comfy_formats = {name: f for f in FORMATS.values() for name in f.comfy_formats}  # ComfyUI's name -> entry
        for layer, info in declared.items():
            fmt = info.get("format", "")
            if not isinstance(fmt, str) or fmt not in comfy_formats:
                raise CheckpointError(
                    f"{ckpt.describe()}: layer '{layer}' uses ComfyUI quantization format '{fmt or '?'}', which "
                    f"SGLDiffusion does not load (supported: {', '.join(comfy_formats)}); use a bf16 or fp8 file")
            self.sources.add("comfy_quant")
        self.keys, self.legacy, self.declared = keys, legacy, declared
        for fmt in FORMATS.values():  # registration order: the first format that claims a layer has it
            # a layer tagged with a ComfyUI format is only offered to the entry that takes that format
            others = {layer + ".weight" for layer, info in declared.items() if info.get("format") not in fmt.comfy_formats}
            for layer, info in fmt.read_layers(self, keys - others).items():
                self.layers.setdefault(layer, {**info, "kind": fmt.name})
        for k in sorted(keys):  # an integer weight with a scale that no registered format reads
            layer = k[: -len(".weight")]
            if (k.endswith(".weight") and layer not in self.layers and not ckpt.header(k)[0].is_floating_point
                    and (layer + ".weight_scale" in keys or layer + ".weight_zero" in keys)):
                raise CheckpointError(f"{ckpt.where(k)}: a quantized weight stored as {DTYPE_NAMES[ckpt.header(k)[0]]} "
                                      f"that no weight format reads (formats: {', '.join(FORMATS)})")
        for layer, info in declared.items():
            if layer not in self.layers:
                raise CheckpointError(f"{ckpt.describe()}: layer '{layer}' is marked quantized but its weight is not "
                                      f"{comfy_formats[info['format']].name} (ComfyUI format '{info['format']}')")
        self.ignored += [k for k in keys if k.endswith(IGNORED_SUFFIXES)]

    def keys_of(self, layer: str) -> List[str]:
        """The file's tensors of a quantized layer: its weight, then its scale and zero if stored, then the
        format's other companions (``extra``: role -> key, e.g. nvfp4's ``weight_scale_2``)."""
        info = self.layers[layer]
        return ([layer + ".weight"] + [info[k] for k in ("scale_key", "zero_key") if info.get(k)]
                + list(info.get("extra", {}).values()))

    def stored_keys(self) -> Set[str]:
        """Every key that is part of a quantized layer, a marker or an unused input scale."""
        return {k for layer in self.layers for k in self.keys_of(layer)} | set(self.ignored)

    def stored(self, layer: str, parts: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
        """A quantized layer's tensors by their role ("weight", "weight_scale", "weight_zero" and the format's
        ``extra`` roles; None when the file has none), checked: scales finite and > 0 (a format's ``rules``
        may allow 0: block scales of all-zero blocks), zeros finite. A role in the format's ``views`` is read
        as that dtype first (ComfyUI stores fp8 block scales as U8 too)."""
        info = self.layers[layer]
        rules, views = info.get("rules", {}), info.get("views", {})
        roles = {"weight_scale": info.get("scale_key"), "weight_zero": info.get("zero_key"), **info.get("extra", {})}
        out: Dict[str, object] = {"weight": parts[layer + ".weight"]}
        for role, key in roles.items():
            t = parts[key] if key else None
            if t is not None and role in views and t.dtype != views[role]:
                t = t.view(views[role])
            out[role] = None if t is None else self._finite(key, t, rules.get(role, "finite" if role == "weight_zero" else "> 0"))
        # the layer's shapes as the header gives them (a packed layer's bytes do not say its shape), a ComfyUI
        # layer's own tag ({"format": ..., "full_precision_matrix_mult": ...}) and its checked layout parameters
        return {**out, "shape": info["shape"], "stored_shape": info.get("stored_shape"),
                "config": self.declared.get(layer, {}), "params": info.get("params", {})}

    def _finite(self, key: str, t: torch.Tensor, rule: str) -> torch.Tensor:
        """``t`` when its values are finite and, by ``rule``, "> 0", ">= 0" or any ("finite"); else a CheckpointError."""
        values = t.float()
        bad = ~torch.isfinite(values)
        bad |= (values <= 0) if rule == "> 0" else (values < 0) if rule == ">= 0" else torch.zeros_like(bad)
        if bool(bad.any()):
            first = values.reshape(-1)[bad.reshape(-1)][0].item()
            raise CheckpointError(f"{self.ckpt.where(key)}: {int(bad.sum())} values are not "
                                  f"{'finite' if rule == 'finite' else 'finite and ' + rule} (e.g. {first})")
        return t

    def dequantize(self, layer: str, parts: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight of a quantized layer from its tensors (``keys_of``), on their device."""
        return get_format(self.layers[layer]["kind"]).dequantize(self.stored(layer, parts)).float()

    def read_dense(self, layer: str) -> torch.Tensor:
        """The float32 weight of a quantized layer, read from the file."""
        return self.dequantize(layer, {k: self.ckpt.read(k) for k in self.keys_of(layer)})

    def compute_dtype(self) -> torch.dtype:
        """The "as stored" compute dtype: the one ``sgld quantize`` recorded, else that of most dense weights."""
        recorded = self.sgld_meta.get("compute_dtype")
        if recorded:
            return getattr(torch, recorded)
        skip = self.stored_keys()
        if any(get_format(v["kind"]).small_f32 for v in self.layers.values()):  # e.g. GGUF's converters
            skip |= {k for k in self.keys if len(self.ckpt.header(k)[1]) <= 1}
        return self.ckpt.stored_dtype(skip=skip, default=torch.bfloat16 if self.quantized else torch.float32)

    @property
    def quantized(self) -> bool:
        return bool(self.layers) or bool(self.sources)

    def unshardable(self) -> List[str]:
        """The file's quantized layers that tensor parallel cannot split (their format has no ``split``); [] when a
        shard can be loaded (a file marked quantized without quantized layers is a dense one)."""
        return [layer for layer, info in self.layers.items() if get_format(info["kind"]).split is None]

    def describe(self) -> str:
        """What the file holds, for the load log: "120 q4_k/q6_k layers (gguf)", or "dense weights"."""
        kinds = "/".join(sorted({v["kind"] for v in self.layers.values()}))
        held = f"{len(self.layers)} {kinds} layers" if self.layers else "dense weights"
        return held + (f" ({', '.join(sorted(self.sources))})" if self.sources else "")
