"""The one loading loop: checkpoint -> its DiT family's model (engine/models/family.py), one tensor at a time.

``LoadPlan`` does everything the header allows before a byte is read: the configuration, the compute
dtype, the names and shapes against the configuration's state dict, the bytes at rest. ``read``
then builds the model on the meta device and takes each tensor through the per-tensor steps: this
rank's slice under tensor parallel, the compute dtype, the device, and a ``Transform`` (the
quantizing one is engine/features/quant/transform.py; ``engine.load_model`` uses it), so a load
holds about one copy of the weights. Every problem is a ``CheckpointError`` naming the file.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from ..errors import ParallelConfigError
from ..models.family import Family, family_of
from .checkpoint import Checkpoint, CheckpointError, check_architecture, open_checkpoint, parse_dtype
from .safetensors import nbytes


def build_model(cfg, device: Union[str, torch.device] = "meta") -> nn.Module:
    """The model of config ``cfg``'s family, on ``device`` (meta: nothing allocated)."""
    return family_of(cfg).build(cfg, device)


def checkpoint_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of a model of ``cfg`` by its checkpoint name, with its shape (nothing is allocated)."""
    return {k: tuple(v.shape) for k, v in build_model(cfg, "meta").state_dict().items()}


def check_keys(ckpt: Checkpoint, family: Family, missing: List[str], unexpected: List[str]) -> None:
    """Refuse a checkpoint whose tensor names do not match the model, naming the first few of each."""
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (first: {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (first: {', '.join(unexpected[:3])})")
    raise CheckpointError(f"{ckpt.describe()}: tensors do not match the {family.title} architecture: " + "; ".join(parts))


# -- tensor parallel (the family's ``shard_dims``: 0 column parallel, the heads; 1 row parallel, all-reduced) --
def shard_tensor(family: Family, key: str, t: torch.Tensor, shard: Tuple[int, int]) -> torch.Tensor:
    """Rank ``shard[1]``'s slice of ``t`` out of ``shard[0]`` (``t`` itself when ``family`` keeps it whole). A block
    linear's bias: split with a column-parallel linear's rows; a row-parallel linear's is added by rank 0 only
    (the all-reduce sums the ranks' outputs), the other ranks hold zeros."""
    dim = family.shard_dim(key)
    tp, index = shard
    if dim is None and key.endswith(".bias"):
        bias_of = family.shard_dim(key[: -len("bias")] + "weight")
        if bias_of == 0:
            return t.chunk(tp)[index].contiguous()
        if bias_of == 1:
            return t if index == 0 else torch.zeros_like(t)
    return t if dim is None else t.chunk(tp, dim=dim)[index].contiguous()


def check_shard(shard: Optional[Tuple[int, int]], cfg) -> Optional[Tuple[int, int]]:
    """``(tp_degree, tp_index)`` checked against the model (None, or a degree of 1: no sharding)."""
    if shard is None or shard[0] == 1:
        return None
    tp, index = shard
    if not 0 <= index < tp or cfg.num_attention_heads % tp or cfg.ffn_hidden_size % tp:
        raise ParallelConfigError(f"tensor parallel shard {index} of {tp}: tp must divide the heads "
                                  f"({cfg.num_attention_heads}) and the MLP width ({cfg.ffn_hidden_size}), "
                                  "and the index must be below tp")
    return tp, index


# -- the transform interface ---------------------------------------------------------------------------------
class Transform:
    """What the loop lets a feature do with the tensors (this base: nothing, each tensor is the model's)."""

    def compute_dtype(self, ckpt: Checkpoint) -> torch.dtype:
        """The compute dtype when the caller asks for the stored one."""
        return ckpt.stored_dtype()

    def check(self, ckpt: Checkpoint, expected: Dict[str, Tuple[int, ...]]) -> Set[str]:
        """Check, from the header, the tensors this transform reads itself, and return their keys: they reach
        ``take`` as stored (not cast, not sharded), and the loop leaves their names and shapes to it."""
        return set()

    def bytes_at_rest(self, key: str, stored: torch.dtype, shape: Tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes tensor ``key`` will take in the loaded model."""
        floating = stored.is_floating_point and stored.itemsize >= 2
        return nbytes(dtype if floating else stored, shape)

    def prepare(self, model: nn.Module, shard: Optional[Tuple[int, int]]) -> None:
        """Change the meta model before a tensor is read: under tensor parallel its block linears take their
        shard shapes, which only a transform of engine/features can do (modules are replaced through
        engine/features/patching.py; the quantizing transform does it, so shard through ``engine.load_model``)."""
        if shard is not None:
            raise ParallelConfigError("tensor parallel loads through engine.load_model (its transform gives the "
                                      "model's block linears their shard shapes)")

    def take(self, model: nn.Module, key: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The model tensors made from one checkpoint tensor (none when it went into a module, or while
        a layer waits for its other tensors). Floating results are cast to the compute dtype."""
        return {key: tensor}

    def finish(self, model: nn.Module) -> None:
        """After the last tensor, before the model is checked for tensors still missing."""


# -- the loop --------------------------------------------------------------------------------------------
class LoadPlan:
    """One load, decided from the header (a checkpoint opened once): ``config``, ``dtype``,
    ``bytes_at_rest()``; ``read(device)`` then reads it."""

    def __init__(self, checkpoint: Union[str, os.PathLike, Checkpoint], dtype=None,
                 shard: Optional[Tuple[int, int]] = None, transform: Optional[Transform] = None):
        self.checkpoint = ckpt = open_checkpoint(checkpoint)
        self.config = check_architecture(ckpt)
        self.family = family_of(self.config)
        self.transform = transform or Transform()
        self.dtype = parse_dtype(dtype) or self.transform.compute_dtype(ckpt)
        self.shard = check_shard(shard, self.config)
        expected = {k: tuple(v.shape) for k, v in build_model(self.config).state_dict().items()}
        self.stored = self.transform.check(ckpt, expected)
        plain = [k for k in ckpt.keys() if k not in self.stored]
        check_keys(ckpt, self.family, [k for k in expected if k not in self.stored and k not in ckpt.index],
                   sorted(k for k in plain if k not in expected))
        for k in plain:
            shape = ckpt.header(k)[1]
            if shape != expected[k]:
                raise CheckpointError(f"{ckpt.describe()}: tensor '{k}' has shape {shape}, but a model of this "
                                      f"configuration needs {expected[k]}")

    def bytes_at_rest(self) -> int:
        """Bytes the whole model takes once loaded (what the offload decision weighs); nothing is read."""
        return sum(self.transform.bytes_at_rest(k, *self.checkpoint.header(k), self.dtype) for k in self.checkpoint.keys())

    def read(self, device: Union[str, torch.device] = "cpu") -> nn.Module:
        """Build the model on the meta device and assign each tensor as it is read, in file order."""
        ckpt, transform = self.checkpoint, self.transform
        model = build_model(self.config)
        transform.prepare(model, self.shard)
        state: Dict[str, torch.Tensor] = {}
        for key, t in ckpt.tensors():
            if key not in self.stored:
                if self.shard is not None:
                    t = shard_tensor(self.family, key, t, self.shard)
                t = self._cast(t)
            for name, value in transform.take(model, key, t.to(device)).items():
                state[name] = self._cast(value)
        model.load_state_dict(state, strict=False, assign=True)
        transform.finish(model)
        missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
        if missing:
            raise CheckpointError(f"{ckpt.describe()}: tensors do not match the {self.family.title} architecture: "
                                  f"{len(missing)} missing (first: {', '.join(missing[:3])})")
        return model.eval().requires_grad_(False)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t


def read_model(checkpoint, dtype=None, device: Union[str, torch.device] = "cpu",
               shard: Optional[Tuple[int, int]] = None, transform: Optional[Transform] = None) -> nn.Module:
    """Load a plain checkpoint (no quantization: ``engine.load_model`` adds it) in one pass."""
    return LoadPlan(checkpoint, dtype, shard, transform).read(device)
