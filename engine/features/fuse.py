"""Fused projections: q/k/v as one GEMM and gate/up as one, attached when an engine is built.

The model class keeps the release's modules, so checkpoint files, quantization at load and
tensor-parallel sharding see the checkpoint's names. ``fuse_projections`` then replaces each group
(``self_attention.to_q/to_k/to_v`` -> ``self_attention.qkv``, ``mlp.gate_proj/up_proj`` ->
``mlp.gate_up``) by one module of the same kind (``nn.Linear``, ``FP8Linear`` or ``Int4Linear``)
whose output rows are the parts back to back. This is exact: each output row has its own weights,
fp8 scale and int4 groups, so concatenating rows changes no value (a per-tensor fp8 scale becomes
the same scale on every row of its part).

From outside, the checkpoint's names stay: ``state_dict()`` gives each part as a row view of the
fused tensors under its own key and in the checkpoint's order, ``load_state_dict`` accepts the
parts, and ``linear_parts(model)`` gives LoRA every checkpoint linear, a fused part as a
``RowView`` (its rows of the fused module).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..models.ernie_image import Attention, GeGLU
from .quant import FP8Linear, Int4Linear

# module class -> (fused child name, the parts it replaces, in output-row order)
GROUPS = {Attention: ("qkv", ("to_q", "to_k", "to_v")), GeGLU: ("gate_up", ("gate_proj", "up_proj"))}


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


def _concat(parts: List[nn.Module]) -> Optional[nn.Module]:
    """One module computing ``torch.cat([p(x) for p in parts], -1)``, or None when the parts differ in kind."""
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return None
    if any((p.bias is None) != (first.bias is None) for p in parts):
        return None
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    if type(first) is nn.Linear:
        fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return fused
    if type(first) is FP8Linear:
        scales = [p.weight_scale.reshape(-1).expand(p.out_features) for p in parts]
        return FP8Linear(torch.cat([p.weight for p in parts]), torch.cat(scales), bias)
    if type(first) is Int4Linear:
        if any(p.group_size != first.group_size for p in parts):
            return None
        return Int4Linear(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]),
                          torch.cat([p.weight_zero for p in parts]), bias)
    return None  # e.g. a LoRA side path or another wrapper: left as it is


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of ``model`` in place (idempotent). Returns the groups fused."""
    fused_groups = 0
    with torch.inference_mode(False):  # normal tensors, whatever mode the engine is built in (ComfyUI)
        for module in model.modules():
            group = GROUPS.get(type(module))
            if group is None or group[0] in module._modules:
                continue
            fused_name, part_names = group
            parts = [module._modules[n] for n in part_names]
            fused = _concat(parts)
            if fused is None:
                continue
            fused.fused_parts = tuple((n, p.out_features) for n, p in zip(part_names, parts))
            # the fused child takes the first part's place, so parameters keep the checkpoint's order
            children = {}
            for name, child in module._modules.items():
                if name == part_names[0]:
                    children[fused_name] = fused
                elif name not in part_names:
                    children[name] = child
            module._modules.clear()
            module._modules.update(children)
            module._register_state_dict_hook(_split_state)
            module._register_load_state_dict_pre_hook(_join_state, with_module=True)
            fused_groups += 1
    return fused_groups


def _part_ranges(fused: nn.Module):
    start = 0
    for name, rows in fused.fused_parts:
        yield name, start, start + rows
        start += rows


def linear_parts(model: nn.Module) -> Dict[str, object]:
    """Checkpoint linear name -> its module, or a ``RowView`` for a part of a fused module."""
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "fused_parts", None) is None:
            out[name] = m
            continue
        parent = name.rsplit(".", 1)[0]
        for part, start, stop in _part_ranges(m):
            out[f"{parent}.{part}"] = RowView(m, start, stop)
    return out


def _split_state(module, state_dict, prefix, local_metadata):
    """state_dict hook: the fused tensors as the parts' keys (row views), in the checkpoint's order."""
    fused_name = GROUPS[type(module)][0]
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
            for part, start, stop in _part_ranges(fused):
                for leaf, t in fused_items:
                    state_dict[f"{prefix}{part}.{leaf}"] = t[start:stop] if t.dim() else t
    return state_dict


def _join_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: the parts' keys (a checkpoint's) joined into the fused module's."""
    fused_name, part_names = GROUPS[type(module)]
    fused = module._modules.get(fused_name)
    if fused is None:
        return
    leaves = {k[len(prefix + part_names[0]) + 1:] for k in list(state_dict) if k.startswith(prefix + part_names[0] + ".")}
    for leaf in leaves:
        keys = [f"{prefix}{p}.{leaf}" for p in part_names]
        if all(k in state_dict for k in keys):
            tensors = [state_dict.pop(k) for k in keys]
            if leaf == "weight_scale":  # a per-tensor fp8 scale becomes the same scale on every row of its part
                tensors = [t.reshape(-1).expand(rows) for t, (_, rows) in zip(tensors, fused.fused_parts)]
            state_dict[f"{prefix}{fused_name}.{leaf}"] = torch.cat(tensors)


def fused_groups(model: nn.Module) -> Tuple[int, int]:
    """(groups fused, groups in the model)."""
    total = fused = 0
    for module in model.modules():
        group = GROUPS.get(type(module))
        if group is not None:
            total += 1
            fused += group[0] in module._modules
    return fused, total
