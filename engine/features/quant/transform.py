"""The quantizing transform of the one load loop (engine/io/load.py), which the
public loader (engine/loading.py, ``engine.load_model``) hands to every load.

The transform quantizes the blocks' linear layers as they are read when a format is asked for, and
reads the layers of a pre-quantized file (sgld, ComfyUI scaled_fp8, ComfyUI mixed) as their format's
modules (registry.py), re-quantized when another format is asked for; quantized layers outside the
blocks are dequantized to the compute dtype. Under tensor parallel a pre-quantized layer is cut by its format's
``split`` (a format without one is refused: engine/loading.py), and the model records its shard
(``tensor_parallel_shard``: LoRA files are read against the full shapes and keep this rank's slices).
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import CheckpointError
from ...io.checkpoint import Checkpoint
from ...io.load import Transform, shard_tensor
from ...io.safetensors import nbytes
from ...models.family import Family
from .. import patching
from .modules import record_quant
from .prequantized import QuantPlan
from .registry import get_format, parse_format

log = logging.getLogger("sgld.quant")
SHARD = "tensor_parallel_shard"  # the model's record (patching.state): (tp degree, this rank's index)


def tensor_parallel_shard(model: nn.Module) -> Optional[Tuple[int, int]]:
    """(tp degree, rank index) of a model loaded as one tensor-parallel rank's shard, else None."""
    return patching.feature_state(model, SHARD)


class QuantTransform(Transform):
    """Quantize-on-read (``quant``) and pre-quantized layers (``plan``, the file's QuantPlan) in the load loop.
    ``family``: whose block linears are quantized (default: the plan's checkpoint's)."""

    def __init__(self, plan: Optional[QuantPlan], quant: Optional[str], family: Optional[Family] = None):
        self.plan = plan
        self.family = family or (plan.ckpt.family if plan is not None else None)
        self.kind, self.group = parse_format(quant)
        self.format = get_format(self.kind) if self.kind else None  # the format asked for
        self.quant = quant
        layers = plan.layers if plan is not None else {}
        self.layer_of = {k: layer for layer in layers for k in plan.keys_of(layer)}  # stored key -> its layer
        self.stored_layers = set(layers)
        self.ignored = set(plan.ignored) if plan is not None else set()
        self.parts: Dict[str, Dict[str, torch.Tensor]] = {}  # layer -> its tensors read so far
        self.shard: Optional[Tuple[int, int]] = None
        self.biases: Dict[str, torch.Tensor] = {}  # a block linear's bias read before its weight -> its module
        self.replaced: Set[str] = set()  # block linears now quantized modules

    def compute_dtype(self, ckpt: Checkpoint) -> torch.dtype:
        return self.plan.compute_dtype()

    def prepare(self, model: nn.Module, shard: Optional[Tuple[int, int]]) -> None:
        self.shard = shard
        if shard is not None:
            shard_skeleton(model, self.family, shard[0])
            patching.state(model)[SHARD] = tuple(shard)

    def check(self, ckpt: Checkpoint, expected: Dict[str, Tuple[int, ...]]) -> Set[str]:
        """Pre-quantized layers: their weights must be the model's, in its shapes (as stored, unpacked)."""
        unexpected = []
        for layer, info in self.plan.layers.items():
            wkey = layer + ".weight"
            if wkey not in expected:
                unexpected.append(wkey)
            elif tuple(info["shape"]) != expected[wkey]:
                packed = get_format(info["kind"]).packed
                stored = f" (stored packed as {list(ckpt.header(wkey)[1])})" if packed else ""
                raise CheckpointError(f"{ckpt.describe()}: {info['kind']} tensor '{wkey}' has shape {tuple(info['shape'])}"
                                      f"{stored}, but a model of this configuration needs {expected[wkey]}")
        if unexpected:
            raise CheckpointError(f"{ckpt.describe()}: quantized tensors do not match the {self.family.title} architecture "
                                  f"({len(unexpected)} unexpected, first: {unexpected[0]})")
        return set(self.layer_of) | self.ignored

    def _keeps(self, layer: str) -> bool:
        """Does a pre-quantized layer stay in its stored format (a block linear, no other format asked)?"""
        return self.family.is_block_linear(layer) and self.kind in (None, self.plan.layers[layer]["kind"])

    def bytes_at_rest(self, key: str, stored: torch.dtype, shape: Tuple[int, ...], dtype: torch.dtype) -> int:
        if key in self.ignored:
            return 0
        layer, _, leaf = key.rpartition(".")
        if key in self.layer_of:
            layer = self.layer_of[key]
            if self._keeps(layer):  # a packed layer's header shape is [out, in]: its bytes are in the plan
                return self.plan.layers[layer].get("stored_bytes", nbytes(stored, shape))
            if key != layer + ".weight":
                return 0  # a scale or zero of a layer that is dequantized or re-quantized
            stored, shape = dtype, self.plan.layers[layer]["shape"]  # dequantized
        if self.kind and leaf == "weight" and self.family.is_block_linear(layer):
            return self.format.weight_bytes(shape, self.group, dtype)
        return super().bytes_at_rest(key, stored, shape, dtype)

    def _replace(self, model: nn.Module, layer: str, module: nn.Module) -> Dict[str, torch.Tensor]:
        """Put quantized ``module`` at ``layer``, with the linear's bias if it was read first (a family's block
        linears may have biases; the quantized modules take one)."""
        bias = self.biases.pop(layer, None)
        if bias is not None:
            module.bias = nn.Parameter(bias, requires_grad=False)
        patching.replace_module(model, layer, module)
        self.replaced.add(layer)
        return {}

    def _dense(self, layer: str, weight: torch.Tensor) -> Dict[str, torch.Tensor]:
        """A block linear left dense: its weight, and its bias if it was held for a quantized module."""
        bias = self.biases.pop(layer, None)
        return {layer + ".weight": weight, **({layer + ".bias": bias} if bias is not None else {})}

    def take(self, model: nn.Module, key: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        if key in self.ignored:
            return {}
        layer = self.layer_of.get(key)
        if layer is not None:
            parts = self.parts.setdefault(layer, {})
            parts[key] = tensor
            if len(parts) < len(self.plan.keys_of(layer)):
                return {}
            return self._stored_layer(model, layer, self.parts.pop(layer))
        layer, _, leaf = key.rpartition(".")
        if leaf == "bias" and self.family.is_block_linear(layer) and (self.kind or layer in self.stored_layers):
            if layer in self.replaced:  # its weight came first: the quantized module takes it now
                model.get_submodule(layer).bias = nn.Parameter(tensor, requires_grad=False)
            else:
                self.biases[layer] = tensor
            return {}
        if self.kind and leaf == "weight" and self.family.is_block_linear(layer):
            module = self.format.quantize(tensor, None, self.group)
            return self._dense(layer, tensor) if module is None else self._replace(model, layer, module)
        return {key: tensor}

    def _stored_layer(self, model: nn.Module, layer: str, parts: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A pre-quantized layer, all its tensors read: a quantized module, or a dense weight for the state."""
        info, wkey = self.plan.layers[layer], layer + ".weight"
        if self._keeps(layer):
            module = get_format(info["kind"]).from_stored(self.plan.stored(layer, parts))
            dim = self.family.shard_dim(wkey)
            if self.shard is not None and dim is not None:  # a format with a split (engine/loading.py's plan_load)
                try:
                    module = get_format(info["kind"]).split(module, self.shard[1], self.shard[0], dim)
                except ValueError as e:
                    raise CheckpointError(f"{self.plan.ckpt.where(wkey)}: {e}") from None
            return self._replace(model, layer, module)
        dense = self.plan.dequantize(layer, parts)
        if self.shard is not None:  # a layer of a format that splits, dequantized: this rank's slice
            dense = shard_tensor(self.family, wkey, dense, self.shard)
        if self.family.is_block_linear(layer):  # stored in another format than the one asked for: re-quantized
            module = self.format.quantize(dense, None, self.group)
            if module is not None:
                return self._replace(model, layer, module)
        return self._dense(layer, dense)  # cast to the compute dtype by the loop

    def finish(self, model: nn.Module) -> None:
        record_quant(model)
        if self.plan.quantized or self.kind:
            log.info("loaded %s: %s%s", self.plan.ckpt.describe(), self.plan.describe(),
                     f", quantized to {self.quant} at load" if self.kind else "")


def shard_skeleton(model: nn.Module, family: Family, tp: int) -> None:
    """Give a meta model's block linears their tensor-parallel shard shapes (through ``replace_module``) and
    its attention (the family's ``heads_module``) its share of the heads."""
    with torch.device("meta"):
        for i, block in enumerate(family.blocks_of(model)):
            block.get_submodule(family.heads_module).heads //= tp
            for name, dim in family.shard_dims.items():
                old = block.get_submodule(name)
                shape = (old.in_features, old.out_features // tp) if dim == 0 else (old.in_features // tp, old.out_features)
                bias = old.bias is not None  # a column-parallel bias is split with its rows (io/load.py's shard_tensor)
                patching.replace_module(model, family.block_key(i, name), nn.Linear(*shape, bias=bias))
