"""The weight formats as one table: ``FORMATS`` (name -> ``WeightFormat``). Everything that depends on the
format (how a dense weight is quantized, the module class, bytes at rest, the tensors a file stores, how a
file's layers are found and checked, how fused projections concatenate and split it) is a field of its
entry, so a new format is one package that calls ``register_format`` (docs/architecture.md). ``FILE_WRITERS`` (name ->
``FileWriter``): the files ``sgld quantize`` writes, each for the format names it takes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn


def _cat_rows(leaf: str, tensors: List[torch.Tensor], rows: List[int]) -> torch.Tensor:
    return torch.cat(tensors)


@dataclass(frozen=True)
class WeightFormat:
    """One weight format of the blocks' linear layers.

    ``parse(text)`` -> the group size (0: none) when ``text`` names this format, else None; ``choices``: the
    names offered as EngineConfig.quant / ``sgld quantize --format`` (none: a format only read from files);
    ``module``: the layer class (with
    ``from_dense``-made instances, ``.dequantize(dtype)``, ``.in_features``, ``.out_features``, ``.bias``);
    ``quantize(weight, bias, group)`` -> a module, or None when this layer stays dense; ``weight_bytes(shape,
    group, dense dtype)``: bytes at rest once quantized; ``from_stored(parts)`` / ``dequantize(parts)``: a
    module / the float32 weight from a file's tensors ({"weight", "weight_scale", "weight_zero"}, scale and
    zero possibly None, plus the layer's ``extra`` roles, its "shape", its ComfyUI tag as "config" and the
    tag's checked layout parameters as "params");
    ``read_layers(plan, keys)``: the file's layers in this format, each checked from the header, as
    {layer: {"scale_key", "zero_key" (either may be absent or None), "shape" ([out, in] unpacked), and
    optionally "extra" (role -> key of other companions), "rules" (role -> "> 0" | ">= 0" | "finite": the
    values allowed), "views" (role -> dtype the stored bytes are read as) and "params"}}
    (engine/features/quant/prequantized.py); ``concat(parts)`` / ``rows(module, start, stop)``: fused
    projections' join of same-format parts (with their joined bias; None: cannot be joined) and split (the
part's bias given); ``join(leaf, tensors, rows)``: one checkpoint
    tensor per part -> the fused tensor (a per-tensor scale repeated per row); ``packed``: the file stores the
    weight in another shape than [out, in] (messages); ``split(module, index, parts, dim)``: tensor parallel,
    rank ``index``'s share of a stored layer along its weight's ``dim`` (ValueError when it cannot be split
    there; None: a file holding this format is refused under tensor parallel); ``small_f32``: files of this
    format keep 1-D tensors (norms, biases) F32 whatever the model's dtype, so they do not vote for the "as
    stored" dtype; ``comfy_formats``: the format names of ComfyUI's per-layer tags (``X.comfy_quant``,
    ``_quantization_metadata``) whose layers this entry's ``read_layers`` takes (others are refused);
    ``prepare(modules)``: run-time preparation once the model is on its device (fp8: the ``torch._scaled_mm``
    probe), returning notes. What users read: ``help`` (a clause of the --quant / --format help; entries with the same
    text share one), ``storage`` and ``compute`` (the docs table, tools/format_docs.py)."""

    name: str
    module: type
    parse: Callable[[str], Optional[int]]
    choices: Tuple[str, ...]
    quantize: Callable[[torch.Tensor, Optional[torch.Tensor], int], Optional[nn.Module]]
    weight_bytes: Callable[[Tuple[int, int], int, torch.dtype], int]
    from_stored: Callable[[Dict[str, Optional[torch.Tensor]]], nn.Module]
    dequantize: Callable[[Dict[str, Optional[torch.Tensor]]], torch.Tensor]
    read_layers: Callable[[object, set], Dict[str, dict]]
    concat: Callable[[List[nn.Module], Optional[torch.Tensor]], Optional[nn.Module]]
    rows: Callable[[nn.Module, int, int, Optional[torch.Tensor]], nn.Module]
    join: Callable[[str, List[torch.Tensor], List[int]], torch.Tensor] = _cat_rows
    packed: bool = False
    dense_why: str = "cannot be stored in this format"  # why ``quantize`` left a layer dense (a warning)
    split: Optional[Callable[[nn.Module, int, int, int], nn.Module]] = None
    small_f32: bool = False
    comfy_formats: Tuple[str, ...] = ()
    prepare: Optional[Callable[[List[nn.Module]], List[str]]] = None
    help: str = ""
    storage: str = ""
    compute: str = ""


FORMATS: Dict[str, WeightFormat] = {}  # in registration order: the order of choices and messages


def _add(table: dict, kind: str, entry):
    if entry.name in table:
        raise ValueError(f"{kind} '{entry.name}' is registered twice")
    table[entry.name] = entry
    return entry


def register_format(fmt: WeightFormat) -> WeightFormat:
    return _add(FORMATS, "weight format", fmt)


def unregister_format(name: str) -> None:
    """Take a format out of the table (tests that register one of their own)."""
    FORMATS.pop(name, None)


def choices() -> Tuple[str, ...]:
    """Every name a user may ask for (EngineConfig.quant, ``sgld quantize --format``)."""
    return tuple(c for f in FORMATS.values() for c in f.choices)


def parse_format(fmt: Optional[str]) -> Tuple[Optional[str], int]:
    """A user's format name ("fp8", "int4", "int4-g64", ...; None / "none" / "off": no quantization) ->
    (format name, group size)."""
    if fmt is None:
        return None, 0
    text = str(fmt).lower()
    if text in ("none", "off", ""):
        return None, 0
    for f in FORMATS.values():
        group = f.parse(text)
        if group is not None:
            return f.name, group
    raise ValueError(f"quantization format '{fmt}' is not supported; choose one of {', '.join(choices())}")


def get_format(name: str) -> WeightFormat:
    """The table's entry for a format name (as ``parse_format`` gives it)."""
    if name not in FORMATS:
        raise ValueError(f"weight format '{name}' is not registered (registered: {', '.join(FORMATS)})")
    return FORMATS[name]


def format_of(module: nn.Module) -> Optional[WeightFormat]:
    """The format of a quantized layer (its class or a subclass, e.g. a LoRA side path), else None."""
    for f in FORMATS.values():
        if isinstance(module, f.module):
            return f
    return None


def quant_modules() -> Tuple[type, ...]:
    """Every registered layer class (for ``isinstance``)."""
    return tuple(f.module for f in FORMATS.values())


def describe_formats() -> str:
    """The formats as one help text ("fp8: ...; int4 / int4-g64: ..."), entries with the same ``help`` together."""
    clauses: Dict[str, List[str]] = {}
    for f in FORMATS.values():
        if f.choices:  # a format only read from files (no quantizer) is not a choice
            clauses.setdefault(f.help or f.name, []).extend(f.choices)
    return "; ".join(f"{' / '.join(names)}: {text}" if text not in names else text for text, names in clauses.items())


@dataclass(frozen=True)
class FileWriter:
    """One kind of file ``sgld quantize`` writes: ``label`` (messages), ``suffix`` (".safetensors"), ``formats()`` (the --format
    names it writes; the default writer, ``formats`` None, takes every format of the table no other writer
    claims), ``write(src, dst, fmt, dtype=None)`` -> a summary dict, ``help`` (a clause of --format's help)."""

    name: str
    label: str  # the file kind in messages ("GGUF")
    suffix: str
    write: Callable[..., dict]
    formats: Optional[Callable[[], Tuple[str, ...]]] = None
    help: str = ""


FILE_WRITERS: Dict[str, FileWriter] = {}  # in registration order


def register_writer(writer: FileWriter) -> FileWriter:
    return _add(FILE_WRITERS, "file writer", writer)


def unregister_writer(name: str) -> None:
    """Take a writer out of the table (tests that register one of their own)."""
    FILE_WRITERS.pop(name, None)


def writer_formats(writer: FileWriter) -> Tuple[str, ...]:
    """The --format names ``writer`` writes."""
    if writer.formats is not None:
        return writer.formats()
    claimed = {n for w in FILE_WRITERS.values() if w.formats is not None for n in w.formats()}
    return tuple(c for c in choices() if c not in claimed)


def writer_for(fmt: str) -> FileWriter:
    """The writer of a --format name (ValueError naming every name when no writer takes it)."""
    for w in FILE_WRITERS.values():
        if str(fmt).lower() in writer_formats(w):
            return w
    raise ValueError(f"--format '{fmt}' is not one of {', '.join(writable_formats())}")


def writable_formats() -> Tuple[str, ...]:
    """Every --format name of ``sgld quantize``, writer by writer."""
    return tuple(dict.fromkeys(n for w in FILE_WRITERS.values() for n in writer_formats(w)))
