"""LoRA on a tensor-parallel rank's shard: a file is checked against the full layer shapes, then each entry keeps
this rank's slice of its update dW, so the merge and the side path run on the shard unchanged and the ranks'
all-reduce adds up the row-parallel parts. Column-parallel layers (split by output rows) take the rows of B, of
a ``.diff``, of LoHa's w_a; row-parallel layers (split by inputs) the columns of A, of a ``.diff``, of LoHa's w_b.
A LoKr keeps its Kronecker form when the cut falls between whole blocks of its second factor, else its slice of
dW is stored as a full term (kron([[1]], dW slice))."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import nn

from ...models.family import family_of
from ..quant import tensor_parallel_shard
from .lycoris import Lycoris

Cut = Tuple[int, int, int]  # (dim, parts, index): this rank's slice of a split layer


def layer_cut(model: nn.Module, name: str) -> Optional[Cut]:
    """How layer ``name`` of ``model`` is split under tensor parallel, or None (kept whole, or not a shard)."""
    shard = tensor_parallel_shard(model)
    if shard is None:
        return None
    dim = family_of(model).shard_dim(name + ".weight")
    return None if dim is None else (dim, shard[0], shard[1])


def full_shape(wshape: tuple, cut: Optional[Cut]) -> tuple:
    """The shape of the whole layer whose rank-local weight has shape ``wshape``."""
    if cut is None:
        return tuple(wshape)
    dim, parts, _ = cut
    return tuple(n * parts if d == dim else n for d, n in enumerate(wshape))


def _part(size: int, cut: Cut) -> slice:
    _, parts, index = cut
    step = size // parts
    return slice(index * step, (index + 1) * step)


def cut_entry(e, cut: Optional[Cut]):
    """The rank's slice of LoRAEntry ``e`` (``e`` itself for a layer kept whole)."""
    if cut is None:
        return e
    dim = cut[0]
    if e.diff is not None:
        d = e.diff.reshape(e.diff.shape[0], -1)
        return dataclasses.replace(e, diff=(d[_part(d.shape[0], cut)] if dim == 0 else d[:, _part(d.shape[1], cut)]).clone())
    if e.lycoris is not None:
        return dataclasses.replace(e, lycoris=cut_lycoris(e.lycoris, cut))
    if dim == 0:
        return dataclasses.replace(e, up=e.up[_part(e.up.shape[0], cut)].clone())
    return dataclasses.replace(e, down=e.down[:, _part(e.down.shape[1], cut)].clone())


def cut_lycoris(ly: Lycoris, cut: Cut) -> Lycoris:
    """The ``cut`` slice of a LyCORIS adapter's update (also a fused layer's part: engine/features/lora/fused.py)."""
    dim = cut[0]
    rows, cols = (_part(ly.out_features, cut), slice(None)) if dim == 0 else (slice(None), _part(ly.in_flat, cut))
    out = rows.stop - rows.start if dim == 0 else ly.out_features
    n_in = cols.stop - cols.start if dim == 1 else ly.in_flat
    if ly.kind == "loha":
        t = dict(ly.t)
        for i in (1, 2):
            a, b = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"]
            if dim == 0:  # a: [out, r] (Tucker: [r, out])
                t[f"hada_w{i}_a"] = (a[:, rows] if f"hada_t{i}" in t else a[rows]).clone()
            else:
                t[f"hada_w{i}_b"] = b.flatten(1)[:, cols].clone()
        return dataclasses.replace(ly, t=t, out_features=out, in_flat=n_in)
    dev = torch.device("meta" if any(t.is_meta for t in ly.t.values()) else "cpu")  # a header's: shapes only
    w1, w2 = ly._lokr_factors(dev)
    a2, c2 = w2.shape
    span = (rows.start, rows.stop) if dim == 0 else (cols.start, cols.stop)
    block = a2 if dim == 0 else c2
    if span[0] % block == 0 and span[1] % block == 0:  # whole blocks of w2: still a Kronecker product
        lo, hi = span[0] // block, span[1] // block
        t = {"lokr_w1": (w1[lo:hi] if dim == 0 else w1[:, lo:hi]).contiguous(), "lokr_w2": w2}
    else:
        dense = ly.rows(dev)(0, ly.out_features)[rows, cols]
        t = {"lokr_w1": torch.ones(1, 1), "lokr_w2": dense.contiguous()}
    return dataclasses.replace(ly, t=t, out_features=out, in_flat=n_in)
