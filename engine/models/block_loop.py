"""The block loop, written once: a model's plain forward (engine/models/family.py ``run_blocks``: one job, no
runner), a sampling run under Cache-DiT (engine/features/cache/dbcache.py ``DBCacheRunner.__call__``: one job, its own
rows) and a served forward (engine/serve/forward.py: several jobs' rows joined, each with its own runner or none).
Offload wraps the blocks it calls, sequence parallel calls it on a chunk of the tokens. The blocks it is given
(``Family.loop_blocks``) are called as ``(h, ctx) -> h`` whatever their list's pattern (``TwoStreams``), and a
family's loop over several lists is one sequence (``LoopBlocks``).

Each job's runner takes its own decision after its first ``fn`` blocks, on its own rows (the shapes it has alone);
a cached job's rows get its saved residual and skip the middle blocks, which run on the other rows only; every row
runs the last ``bn`` blocks."""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

# How a list's blocks are called (cache-dit's forward patterns, the two this engine runs)
SINGLE_STREAM = "single"  # block(h, ctx) -> h: one sequence of image and text tokens (ERNIE-Image, Z-Image)
TWO_STREAMS = "two_streams"  # block(text, image, ctx) -> (text, image): each stream its own weights (MMDiT)
PATTERNS = (SINGLE_STREAM, TWO_STREAMS)


class TwoStreams:
    """A two-stream block as the block loop calls every block, ``(h, ctx) -> h``: ``h`` holds the image's tokens,
    then the text's (a single-stream sequence's order, so the server's padding at the end and sequence parallel's
    chunks stay the loop's business), and ``ctx.image_tokens`` says where the text starts (in this chunk, under
    sequence parallel: the family's ``chunk_context`` sets it). The block's joint attention takes its tokens in
    that order too, so that the key mask and the chunks line up with them."""

    __slots__ = ("block",)

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, h: torch.Tensor, ctx) -> torch.Tensor:
        n = ctx.image_tokens
        text, image = self.block(h[:, n:], h[:, :n], ctx)
        return torch.cat([image, text], dim=1)


class TwoStreamBlocks:
    """A list of two-stream blocks as the block loop takes it: each block through ``TwoStreams``, and slices that
    iterate the ModuleList's own (whose iteration tells layer-wise offload which blocks run next)."""

    def __init__(self, blocks: nn.ModuleList):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index):
        return TwoStreamBlocks(self.blocks[index]) if isinstance(index, slice) else TwoStreams(self.blocks[index])

    def __iter__(self):
        return (TwoStreams(block) for block in self.blocks)


class LoopBlocks:
    """Several lists the block loop runs one after the other (Flux's double-stream blocks, then its single-stream
    ones) as one sequence: iterated lazily, each list's iteration announcing its blocks when it starts (layer-wise
    offload prefetches the next list's first block at the end of one: ``Family.block_lists``' order)."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __iter__(self):
        return itertools.chain.from_iterable(self.parts)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            for part in self.parts:
                if 0 <= index < len(part):
                    return part[index]
                index -= len(part)
            raise IndexError("block index out of range")
        start, stop, _ = index.indices(len(self))
        cut, offset = [], 0
        for part in self.parts:
            lo, hi = max(start - offset, 0), min(stop - offset, len(part))
            if lo < hi:
                cut.append(part[lo:hi])
            offset += len(part)
        return LoopBlocks(cut)


def block_loop(layers: Sequence[Callable], h: torch.Tensor, parts: Sequence[Tuple[torch.Tensor, object]],
               runners: Sequence, context_of: Callable[[Tuple[int, ...]], object],
               around: Optional[Callable[[Tuple[int, ...]], object]] = None) -> torch.Tensor:
    """``layers``: the blocks as the loop calls them, ``(h, ctx) -> h`` (``Family.loop_blocks``: a sequence whose
    slices, iterated, announce their blocks to layer-wise offload, which then prefetches them); ``h``: the jobs'
    rows, in order [rows, tokens, C] (one job: its own hidden states); ``parts``: each job's (hidden states,
    context) as its embed made them; ``runners``: each job's ``DBCacheRunner`` (None: always computed);
    ``context_of(active)``: the block context of the jobs ``active`` (indices into ``parts``) together;
    ``around(active)``: what the blocks run inside for those jobs' rows (a served forward's LoRA routes).

    The blocks run in spans between the runners' events (a decision after ``fn`` blocks, the end of the cached
    span before the last ``bn``); the blocks known to run from a span on (up to a decision still to take, or a span
    every job skips) are iterated as one slice, so layer-wise offload prefetches across the spans' ends and never
    loads a block no job runs."""
    n = len(layers)
    events = sorted({0, n} | {e for r in runners if r is not None for e in (r.rc.fn, n - r.rc.bn)})
    spans, row = [], 0
    for hi, _ in parts:
        spans.append((row, row + hi.shape[0], hi.shape[1]))
        row += hi.shape[0]
    calls = [None if r is None else r.start(hi, ci) for r, (hi, ci) in zip(runners, parts)]
    decisions: List = [None] * len(parts)
    fn_res: List = [None] * len(parts)
    h_mid: List = [None] * len(parts)
    skipping = [False] * len(parts)
    contexts = {}

    def running(a: int) -> Tuple[int, ...]:
        """The jobs whose rows run the span starting at block ``a``, by the decisions taken so far."""
        return tuple(q for q, r in enumerate(runners) if not (skipping[q] and a < n - r.rc.bn))

    def known_end(j: int) -> int:
        """Where the blocks known to run from ``j`` end: a decision still to take, or a span no job runs."""
        limit = min([r.rc.fn for r in runners if r is not None and r.rc.fn > j], default=n)
        return next((a for a in events if j < a < limit and not running(a)), limit)

    blocks, at, stop = None, None, None  # the announced slice's iterator, the block it yields next, its end
    for j, end in zip(events, events[1:] + [None]):
        for q, runner in enumerate(runners):
            if runner is None:
                continue
            r0, r1, s = spans[q]
            if j == runner.rc.fn:
                mine = h[r0:r1, :s].contiguous()
                fn_res[q] = runner.fn_residual(parts[q][0], mine)
                decisions[q] = runner.decide(calls[q], fn_res[q])
                if decisions[q][0]:
                    h_mid[q] = mine.clone()
                else:
                    h = _put(h, r0, r1, s, runner.reuse(calls[q], mine))
                    skipping[q] = True
            if j == n - runner.rc.bn:
                if decisions[q][0]:
                    runner.keep(calls[q], h[r0:r1, :s].contiguous() - h_mid[q], fn_res[q])
                skipping[q] = False
        if end is None:
            break
        active = running(j)
        if not active:
            continue
        if at != j or j == stop:  # a plain forward iterates the list itself
            stop = known_end(j)
            blocks, at = iter(layers if (j, stop) == (0, n) else layers[j:stop]), j
        ctx = contexts.get(active)
        if ctx is None:
            ctx = contexts[active] = context_of(active)
        with around(active) if around is not None else nullcontext():
            if len(active) == len(parts):
                for _ in range(end - j):
                    h = next(blocks)(h, ctx)
            else:
                rows = torch.cat([torch.arange(spans[q][0], spans[q][1], device=h.device) for q in active])
                for _ in range(end - j):
                    h = h.index_copy(0, rows, next(blocks)(h[rows], ctx))
        at = end
    for runner, decision in zip(runners, decisions):
        if runner is not None:
            runner.record(*decision)
    return h


def _put(h: torch.Tensor, r0: int, r1: int, s: int, value: torch.Tensor) -> torch.Tensor:
    """``h`` with rows r0:r1, tokens :s replaced by ``value``: a new tensor when that is all of ``h`` (one job: its
    input may be the caller's), else written in place (joined rows: this forward's own tensor)."""
    if r0 == 0 and r1 == h.shape[0] and s == h.shape[1]:
        return value
    h[r0:r1, :s] = value
    return h
