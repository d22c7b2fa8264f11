"""A LoRA written against another layout of the model's family (``Family.layouts``): its layers in our names, and
a fused layer's update cut into its parts' (engine/features/lora/formats.py reads the file)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import lycoris
from .shard import cut_lycoris


def in_our_names(groups: Dict[str, dict], layouts, kmap: Dict[str, str], prefixes: Sequence[str],
                 flat_prefixes: Sequence[str]) -> Dict[str, dict]:
    """``groups`` (a layer's name -> its parts' keys) with the layers named in another of the family's ``layouts``
    (Z-Image's original ``attention.qkv`` / ``attention.out``, under any of ``prefixes``, or kohya's flat names
    under ``flat_prefixes``: ``lora_unet_layers_0_attention_qkv``) under our names. A fused
    layer's group becomes one per part, marked ``rows`` = (i, n): its up (B) and diff are the part's rows, its down
    (A, the input side) shared, which is the fused update exactly; a LyCORIS adapter is read whole and cut
    (``part_lycoris``)."""
    out: Dict[str, dict] = {}
    unknown = layouts and any(prefix not in kmap for prefix in groups)  # the usual file names our layers only
    flat = _flat_names(layouts, kmap, flat_prefixes) if unknown else {}
    for prefix, g in groups.items():
        parts = [] if prefix in kmap else _translated(flat.get(prefix, prefix), layouts, kmap, prefixes)
        if not parts:
            out[prefix] = g
            continue
        for name, rows in parts:
            out[name] = {**g, "rows": rows} if rows else dict(g)
    return out


def _flat_names(layouts, kmap: Dict[str, str], flat_prefixes: Sequence[str]) -> Dict[str, str]:
    """Kohya's flat name of each of our layers as another layout names it -> that layout's dotted name (a flat name
    cannot be split back at its underscores, so it is looked up)."""
    out: Dict[str, str] = {}
    for name in set(kmap.values()):
        for layout in layouts:
            theirs = layout.their_name(name + ".weight")[: -len(".weight")]
            if theirs != name:
                for p in flat_prefixes:
                    out.setdefault(p + theirs.replace(".", "_"), theirs)
    return out


def _translated(prefix: str, layouts, kmap: Dict[str, str],
                prefixes: Sequence[str]) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """Our names of another layout's layer ``prefix`` (a dotted name under any of ``prefixes``), each with its
    (part, parts) of a fused layer; [] if no layout names it."""
    lead = max((p for p in prefixes if prefix.startswith(p)), key=len)
    bare = prefix[len(lead):]
    for layout in layouts:
        parts = [(name[: -len(".weight")], rows) for name, rows in layout.translate(bare + ".weight")]
        if parts and [n for n, _ in parts] != [bare] and all(n in kmap for n, _ in parts):
            return parts
    return []


def part_shapes(g: dict, shape_of):
    """``shape_of`` for a group that is one part of a fused layer: its up (B) and diff have the part's rows."""
    rows = g.get("rows")
    if not rows:
        return shape_of

    def shape(key):
        s = tuple(shape_of(key))
        if key in (g.get("up"), g.get("diff")) and s and s[0] % rows[1] == 0:
            return (s[0] // rows[1], *s[1:])
        return s
    return shape


def fused_shape(wshape: tuple, rows: Optional[Tuple[int, int]]) -> tuple:
    """The whole fused layer's weight shape, from the shape of its part (the layer a LyCORIS adapter's factors fit)."""
    return (wshape[0] * rows[1], *wshape[1:]) if rows else tuple(wshape)


def part_lycoris(ly: lycoris.Lycoris, rows: Optional[Tuple[int, int]]) -> lycoris.Lycoris:
    """Part i of n of a fused layer's LyCORIS adapter: the rows of its update, cut as tensor parallel cuts a
    column-parallel layer (engine/features/lora/shard.py: LoHa's w_a rows; a LoKr whose blocks fall on the parts'
    boundaries keeps its Kronecker form, else its part of dW is stored whole)."""
    return cut_lycoris(ly, (0, rows[1], rows[0])) if rows else ly


def part_rows(t: torch.Tensor, rows: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Part i of n of a fused layer's tensor along its first dimension (rows of B, of a difference)."""
    if not rows:
        return t
    i, n = rows
    return t.reshape(n, -1)[i].reshape(t.shape[0] // n, *t.shape[1:])
