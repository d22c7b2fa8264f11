"""Fused projections: q/k/v as one GEMM and gate/up as one, attached when an engine is built.

``fuse_projections(model)`` registers the "fuse" Patch: each group of the model's family (``fuse_groups``,
engine/models/family.py: for ERNIE-Image q/k/v -> one linear and gate/up -> one) becomes one module of the
same kind (``nn.Linear``, or a quantized layer: its format's ``concat`` / ``rows`` in the format table,
engine/features/quant/registry.py) whose output rows are the parts back to back: exact, each row keeps
its own weights, fp8 scale and int4 groups. The checkpoint's names stay
outside (state_dict, load_state_dict, LoRA targets through ``linear_parts``); see
docs/attention_compile_quant.md.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..models.family import families
from . import patching
from .quant import FORMAT_TABLE, format_of
from .quant.modules import FUSE_RECORD


def _group(module: nn.Module) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """(fused child name, the parts it replaces, in output-row order) when ``module``'s class is a fuse group of
    a registered family (its ``fuse_groups``), else None."""
    cls = patching.base_class(module)
    return next((f.fuse_groups[cls] for f in families() if cls in f.fuse_groups), None)


FEATURE = FUSE_RECORD  # "fuse": quantization carries this per-module record to a fused linear's replacement


class RowView:
    """One checkpoint linear inside a fused module: rows ``start:stop`` of ``module``'s output."""

    def __init__(self, module: nn.Module, start: int, stop: int):
        self.module, self.start, self.stop = module, start, stop
        self.in_features = module.in_features
        self.out_features = stop - start

    @property
    def weight(self) -> torch.Tensor:
        """The part's rows of the fused weight (a view: in-place changes land in the fused module)."""
        return self.module.weight[self.start:self.stop]


def fused_parts(module: nn.Module) -> Optional[Tuple[Tuple[str, int], ...]]:
    """((part name, rows), ...) of a fused module, in row order; None for any other module."""
    return patching.feature_state(module, FEATURE)


def _concat(parts: List[nn.Module]) -> Optional[nn.Module]:
    """One module computing ``torch.cat([p(x) for p in parts], -1)``, or None when the parts differ in kind."""
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return None
    if any((p.bias is None) != (first.bias is None) for p in parts):
        return None
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    if type(first) is nn.Linear:
        return _linear(torch.cat([p.weight for p in parts]), bias)
    fmt = next((f for f in FORMAT_TABLE.values() if type(first) is f.module), None)  # exactly: not a LoRA subclass
    # None: e.g. a LoRA side path or another wrapper, left as it is
    return None if fmt is None else fmt.concat(parts, bias)


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _rows(fused: nn.Module, start: int, stop: int) -> nn.Module:
    """The part ``start:stop`` of a fused module as a module of its own (copies: un-fusing)."""
    bias = None if fused.bias is None else fused.bias[start:stop].clone()
    fmt = format_of(fused)
    if fmt is not None:
        return fmt.rows(fused, start, stop, bias)
    return _linear(fused.weight[start:stop].clone(), bias)


def _part_ranges(parts: Tuple[Tuple[str, int], ...]):
    start = 0
    for name, rows in parts:
        yield name, start, start + rows
        start += rows


class CheckpointNames:
    """Mixed into a fused group module's class: its state_dict gives the parts' keys (row views of the
    fused tensors, in the checkpoint's order) and loading joins a checkpoint's part keys."""

    def state_dict(self, *, destination=None, prefix="", keep_vars=False):  # torch's own calls pass keywords
        out = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return _split_state(self, out, prefix)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        _join_state(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)


def _keeps_checkpoint_names(base: type) -> type:
    return type(base.__name__, (CheckpointNames, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})


def _split_state(module, state_dict, prefix):
    fused_name = _group(module)[0]
    fused = module._modules.get(fused_name)
    if fused is None:
        return state_dict
    mine = [k for k in state_dict if k.startswith(prefix)]
    items = [(k, state_dict.pop(k)) for k in mine]
    head = prefix + fused_name + "."
    fused_items = [(k[len(head):], v) for k, v in items if k.startswith(head)]
    for k, v in items:
        if not k.startswith(head):
            state_dict[k] = v
        elif k == head + fused_items[0][0]:  # where the fused tensors were: each part with all its tensors
            for part, start, stop in _part_ranges(fused_parts(fused)):
                for leaf, t in fused_items:
                    state_dict[f"{prefix}{part}.{leaf}"] = t[start:stop] if t.dim() else t
    return state_dict


def _join_state(module, state_dict, prefix) -> None:
    fused_name, part_names = _group(module)
    fused = module._modules.get(fused_name)
    if fused is None:
        return
    leaves = {k[len(prefix + part_names[0]) + 1:] for k in list(state_dict) if k.startswith(prefix + part_names[0] + ".")}
    for leaf in leaves:
        keys = [f"{prefix}{p}.{leaf}" for p in part_names]
        if all(k in state_dict for k in keys):
            tensors = [state_dict.pop(k) for k in keys]
            fmt = format_of(fused)  # a quantized fused module joins its tensors its format's way (an fp8 scale)
            rows = [n for _, n in fused_parts(fused)]
            state_dict[f"{prefix}{fused_name}.{leaf}"] = torch.cat(tensors) if fmt is None else fmt.join(leaf, tensors, rows)


class FusedProjections(patching.Patch):
    """The "fuse" Patch: which group modules were fused, and their children before (names, in order)."""

    name = FEATURE

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.groups: List[Tuple[nn.Module, Tuple[str, ...]]] = []

    def fuse(self, module: nn.Module) -> bool:
        fused_name, part_names = _group(module)
        if fused_name in module._modules:
            return False
        parts = [module._modules[n] for n in part_names]
        fused = _concat(parts)
        if fused is None:
            return False
        patching.state(fused)[FEATURE] = tuple((n, p.out_features) for n, p in zip(part_names, parts))
        # the fused child takes the first part's place, so parameters keep the checkpoint's order
        children = {}
        for name, child in module._modules.items():
            if name == part_names[0]:
                children[fused_name] = fused
            elif name not in part_names:
                children[name] = child
        before = patching.set_children(module, children)
        patching.swap_class(module, FEATURE, _keeps_checkpoint_names)
        self.groups.append((module, tuple(before)))
        return True

    @torch.no_grad()
    def remove(self) -> None:
        """Every fused module split back into its parts (copies of its rows), in the original order."""
        model = self.model
        later = [name for name in patching.attached(model) if name in ("offload", "lora", "compile")] if model else []
        if later:
            raise ValueError(f"the fused projections cannot be removed while {', '.join(later)} is attached; remove it first")
        with torch.inference_mode(False):
            while self.groups:
                module, order = self.groups.pop()
                fused_name = _group(module)[0]
                fused = module._modules[fused_name]
                parts = {n: _rows(fused, start, stop) for n, start, stop in _part_ranges(fused_parts(fused))}
                patching.set_children(module, {n: parts[n] if n in parts else module._modules[n] for n in order})
                patching.restore_class(module, FEATURE)

    def describe(self) -> dict:
        model = self.model
        fused, total = fused_groups(model) if model is not None else (0, 0)
        return {"groups_fused": fused, "groups": total}


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every group (q/k/v, gate/up ...) of ``model`` in place (idempotent). Returns the groups fused now."""
    patch = patching.get(model, FEATURE) or FusedProjections(model)
    count = 0
    with torch.inference_mode(False):  # normal tensors, whatever mode the engine is built in (ComfyUI)
        for module in model.modules():
            if _group(module) is not None:
                count += patch.fuse(module)
    if count and patching.get(model, FEATURE) is None:
        patching.attach(model, patch)
    return count


def remove_fused_projections(model: nn.Module) -> bool:
    """Split every fused module back into the checkpoint's linears. False when nothing was fused."""
    return patching.detach(model, FEATURE)


def linear_parts(model: nn.Module) -> Dict[str, object]:
    """Checkpoint linear name -> its module, or a ``RowView`` for a part of a fused module."""
    out = {}
    for name, m in model.named_modules():
        parts = fused_parts(m)
        if parts is None:
            out[name] = m
            continue
        parent = name.rsplit(".", 1)[0]
        for part, start, stop in _part_ranges(parts):
            out[f"{parent}.{part}"] = RowView(m, start, stop)
    return out


def fused_groups(model: nn.Module) -> Tuple[int, int]:
    """(groups fused, groups in the model)."""
    total = fused = 0
    for module in model.modules():
        group = _group(module)
        if group is not None:
            total += 1
            fused += group[0] in module._modules
    return fused, total
