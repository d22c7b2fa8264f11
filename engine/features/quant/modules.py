"""The "quant" feature: ``apply_quant(model, fmt)`` replaces the blocks' linear layers by the format's module
(through engine/features/patching.py) and records the patch; ``prepare_fast_paths`` runs each format's
preparation on the device (fp8: ``torch._scaled_mm`` where a probe says it runs and agrees). The layers
themselves live in their format's package (fp8/, int4/, int8/, gguf/). Why weight-only, and the compute
paths: docs/quantization.md."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...models.family import family_of
from .. import patching
from .numerics import frozen
from .registry import FILE_WRITERS, FORMATS, format_of, get_format, parse_format
from .registry import choices as quant_choices  # noqa: I001

log = logging.getLogger("sgld.quant")

# engine/features/fuse.py's per-module record (each part's rows) of a fused linear: it belongs to the module's
# place, so a quantized (or, on removal, dequantized) replacement of a fused linear carries it over. Without
# it the replacement would be a plain module at the fused place and state_dict() could not split it.
FUSE_RECORD = "fuse"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    """``patching.replace_module`` that keeps a fused linear's row record on its replacement."""
    rows = patching.feature_state(model.get_submodule(name), FUSE_RECORD)
    patching.replace_module(model, name, new)
    if rows is not None:
        patching.state(new)[FUSE_RECORD] = rows


def stored_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a file stores for a quantized layer (its own names: weight, weight_scale, ...), bias apart."""
    return {k: v for k, v in module.state_dict().items() if k != "bias"}


def prepare_fast_paths(model: nn.Module) -> List[str]:
    """Each weight format's run-time preparation on the device where the model now is (its entry's ``prepare``:
    fp8's ``torch._scaled_mm`` probe). Returns notes (info, not warnings)."""
    modules = list(model.modules())
    return [note for fmt in FORMATS.values() if fmt.prepare is not None for note in fmt.prepare(modules)]


# -- the feature ----------------------------------------------------------------------------------------------
def make_quant_linear(kind: str, group: int, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[nn.Module]:
    """A quantized layer of ``weight`` in format ``kind``, or None when the format leaves it dense."""
    return get_format(kind).quantize(weight, bias, group)


def quantized_bytes(kind: str, group: int, shape: Tuple[int, int], dense: torch.dtype) -> int:
    """Bytes of an [out, in] weight once ``make_quant_linear`` made it (``dense`` when it stays dense)."""
    return get_format(kind).weight_bytes(shape, group, dense)


class QuantPatch(patching.Patch):
    """The model's block linears are quantized: ``format`` (a format name or "mixed"), ``layers`` (how many),
    ``warnings`` (layers left dense or re-quantized). Removing it puts dense layers back (dequantized)."""

    name = "quant"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.format, self.layers, self.warnings = None, 0, []

    def describe(self) -> dict:
        return {"format": self.format, "layers": self.layers}

    def remove(self) -> None:
        model = self.model
        if model is None:
            return
        dtype = model.dtype
        for name, module in list(model.named_modules()):
            if format_of(module) is not None:
                dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
                dense.weight = frozen(module.dequantize(dtype))
                if module.bias is not None:
                    dense.bias = frozen(module.bias.to(dtype))
                _replace(model, name, dense)


def record_quant(model: nn.Module) -> Optional[QuantPatch]:
    """Register (or update) the "quant" patch from the quantized layers the model holds; None if it has none."""
    layers = [m for m in model.modules() if format_of(m) is not None]
    if not layers:
        return None
    patch = patching.get(model, QuantPatch.name) or patching.attach(model, QuantPatch(model))
    patch.format, patch.layers = model_quant_format(model), len(layers)
    return patch


def apply_quant(model: nn.Module, fmt: str) -> QuantPatch:
    """Replace the blocks' linear layers in place (one at a time, so memory only shrinks) and record the
    "quant" patch. Layers already in the requested format are kept; others are re-quantized from their
    weights. The patch's ``warnings``: layers that could not be quantized or were re-quantized."""
    kind, group = parse_format(fmt)
    if kind is None:
        raise ValueError("apply_quant needs a format: " + ", ".join(quant_choices()))
    target = get_format(kind)
    warnings = []
    skipped = []
    family = family_of(model)
    for name, mod in list(model.named_modules()):
        if not family.is_block_linear(name):
            continue
        now = format_of(mod)
        if now is target:
            continue
        if now is not None:
            dense, bias = mod.dequantize(torch.float32), mod.bias
            warnings.append(f"{name}: re-quantized from {now.name} to {kind}")
        elif isinstance(mod, nn.Linear):
            dense, bias = mod.weight.detach(), mod.bias
        else:
            continue
        new = target.quantize(dense, None if bias is None else bias.detach(), group)
        if new is None:
            skipped.append(name)
            continue
        _replace(model, name, new)  # a fused linear (fuse, then quantize) stays fused: same rows, same numbers
    if skipped:
        warnings.append(f"{kind}: {len(skipped)} linear layers {target.dense_why} and stay unquantized "
                        f"(first: {skipped[0]})")
    for w in warnings:
        log.warning(w)
    patch = record_quant(model) or patching.attach(model, QuantPatch(model))
    patch.warnings = warnings
    return patch


def remove_quant(model: nn.Module) -> bool:
    """Dense layers again (the quantized weights dequantized to the model's dtype). False if none were quantized."""
    return patching.detach(model, QuantPatch.name)


def model_quant_format(model: nn.Module) -> Optional[str]:
    """The format name ("fp8", "int4", ...), "mixed" or None, from the quantized layers."""
    kinds = {f.name for f in map(format_of, model.modules()) if f is not None}
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def weights_format(model: nn.Module) -> Optional[str]:
    """The quantized layers' formats by name for people, most layers first: "gguf q4_k + q6_k" for a Q4_K_M file (a
    file kind of its own names itself), "fp8"; None when no layer is quantized (``model_quant_format``'s "mixed" tells
    a user nothing)."""
    counts = Counter(f.name for f in map(format_of, model.modules()) if f is not None)
    if not counts:
        return None
    names = [name for name, _ in counts.most_common()]
    own = [w.name for w in FILE_WRITERS.values() if w.formats is not None and set(names) <= set(w.formats())]
    return "".join(f"{name} " for name in own[:1]) + " + ".join(names)


def weight_bytes(model: nn.Module, only_block_linears: bool = False) -> int:
    """Bytes of the weights at rest (parameters and buffers; quantized storage as stored)."""
    total = 0
    if only_block_linears:
        family = family_of(model)
        for name, mod in model.named_modules():
            if family.is_block_linear(name):
                total += sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
        return total
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
