"""What restores a merged weight exactly, and the merge / restore arithmetic, a block of rows at a time.

16-bit weights keep an ``UlpDiff`` (~1 byte per touched weight); float32 weights (or every dtype with
``SGLD_LORA_RESTORE=copy``) a CPU copy of the original. Integer arithmetic on the bit patterns makes the
restore bit-exact whatever kernels or thread counts did the merge (docs/lora.md).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from ...errors import LoRAError

MERGE_CHUNK_BYTES = 4 * 2 ** 20  # float32 rows merged at a time on the CPU (fits the cache)
MERGE_CHUNK_BYTES_GPU = 256 * 2 ** 20


class UlpDiff:
    """What turns a merged 16-bit weight back into its original, exactly, in about half the bytes of a copy:
    per element the difference of the two bit patterns (int16 views) as an int8, and, sparsely, the
    original values where that difference does not fit (sign changes, changes of 2x or more).

    Merging and restoring go a block of rows at a time, and ``state`` says at every moment what the
    weight holds, so an interrupted merge or restore can always be undone (``restore``): rows
    ``[lo, hi)`` are merged (original = bits - d), the other rows are original, except the one block
    being written (``pending``: its first row and its original rows); the exceptions, written last,
    hold original values (writing them again anywhere is harmless). ``state`` is replaced as one tuple
    (one assignment: an exception cannot land half-way)."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.dtype = dtype
        self.d = torch.empty(numel, dtype=torch.int8)
        self.exc: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (flat int32 indices, their original values)
        self.state: Tuple[int, int, Optional[Tuple[int, torch.Tensor]]] = (0, 0, None)  # (lo, hi, pending)

    @property
    def nbytes(self) -> int:
        return self.d.numel() + sum(i.numel() * 4 + v.numel() * v.element_size() for i, v in self.exc)

    def exceptions(self) -> int:
        return sum(i.numel() for i, _ in self.exc)


def restore_mode() -> str:
    """``SGLD_LORA_RESTORE``: "compact" (default; 16-bit weights keep an UlpDiff, ~1 byte per touched weight)
    or "copy" (a copy of each touched original: twice the memory, ~1.5-3x faster strength changes on CPU)."""
    mode = os.environ.get("SGLD_LORA_RESTORE", "compact").lower()
    if mode not in ("compact", "copy"):
        raise LoRAError(f"SGLD_LORA_RESTORE='{mode}' is not supported; choose compact or copy")
    return mode


def record_bytes(record) -> int:
    """Bytes kept by one restore record (an UlpDiff or a copy of the original)."""
    return record.nbytes if isinstance(record, UlpDiff) else record.numel() * record.element_size()


def _rows(w2: torch.Tensor) -> int:
    budget = MERGE_CHUNK_BYTES if w2.device.type == "cpu" else MERGE_CHUNK_BYTES_GPU
    return max(1, budget // (4 * w2.shape[1]))


def merge(w: torch.Tensor, base: torch.Tensor, items, record: Optional[UlpDiff] = None) -> Optional[UlpDiff]:
    """w = dtype(base + sum s * scale * dW) for ``items`` [(LoRAEntry, strength)] (dW: up @ down, a ``.diff``, or
    a LoKr / LoHa update computed a block of rows at a time), in float32, a block
    of rows at a time (MERGE_CHUNK_BYTES of float32: cache-sized on CPUs, a bounded temporary on GPUs).
    ``base`` may be ``w`` itself; then ``record`` gets what restores it, before each block of rows is written."""
    dev = w.device
    out = w.shape[0]
    w2, base2 = w.view(out, -1), base.view(out, -1)
    cols = w2.shape[1]
    terms = []  # (kind, a, b, factor): ("diff", dW, -), ("low_rank", up, down), ("rows", (lo, hi) -> dW rows, -)
    for e, s in items:
        if e.diff is not None:
            terms.append(("diff", e.diff.to(dev, torch.float32).reshape(out, -1), None, s))
        elif e.lycoris is not None:
            terms.append(("rows", e.lycoris.rows(dev), None, s * e.scale))
        else:
            terms.append(("low_rank", e.up.to(dev, torch.float32).flatten(1), e.down.to(dev, torch.float32).flatten(1),
                          s * e.scale))
    rows = _rows(w2)
    for i in range(0, out, rows):
        src = base2[i:i + rows].to(dev)
        acc = src.to(torch.float32, copy=True)
        for kind, a, b, s in terms:
            if kind == "diff":
                acc.add_(a[i:i + rows], alpha=s)
            elif kind == "rows":
                acc.add_(a(i, i + acc.shape[0]), alpha=s)
            else:
                acc.addmm_(a[i:i + rows], b, alpha=s)
        new = acc.to(w.dtype)
        if record is not None:
            # new - old bit patterns modulo 2**16; where that does not fit an int8, keep the old value
            d16 = new.view(torch.int16) - src.view(torch.int16)
            d8 = d16.to(torch.int8)
            pos = (d8.to(torch.int16) != d16).reshape(-1).nonzero().reshape(-1)
            if pos.numel():
                record.exc.append(((pos + i * cols).to(torch.int32).cpu(), src.reshape(-1)[pos].cpu()))
            record.d[i * cols:(i + rows) * cols].copy_(d8.reshape(-1))
            lo, hi, _ = record.state
            record.state = (lo, hi, (i, src.clone()))  # src may be a view of w: keep the originals
            w2[i:i + rows].copy_(new)
            record.state = (lo, i + new.shape[0], None)
        else:
            w2[i:i + rows].copy_(new)
    return record


def restore(w: torch.Tensor, record: UlpDiff) -> None:
    """Undo a merge recorded in ``record``, from whatever point a merge or an earlier restore reached:
    the block being written gets its originals back, the merged rows their bit patterns minus the int8
    differences (modulo 2**16), then the exceptions (whatever the subtraction gave there is overwritten)."""
    out = w.shape[0]
    w2 = w.view(out, -1)
    cols = w2.shape[1]
    bits = w2.view(torch.int16)
    lo, hi, pending = record.state
    if pending is not None:
        i, orig = pending
        w2[i:i + orig.shape[0]].copy_(orig)
        record.state = (lo, hi, None)
    rows = _rows(w2)
    while lo < hi:
        end = min(hi, lo + rows)
        d = record.d[lo * cols:end * cols].to(w.device).view(end - lo, cols)
        orig = bits[lo:end] - d.to(torch.int16)
        record.state = (end, hi, (lo, orig.view(w.dtype)))
        bits[lo:end].copy_(orig)
        lo = end
        record.state = (lo, hi, None)
    flat = w.view(-1)
    for idx, vals in record.exc:
        flat[idx.to(w.device, torch.int64)] = vals.to(w.device)
