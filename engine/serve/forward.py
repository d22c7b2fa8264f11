"""One DiT forward over the model calls of several jobs, each sample computed with the shapes it has alone.

A batcher tick hands ``joint_velocity`` one ``Call`` per job (its x, sigma, padded text and lengths, as
``Engine.make_denoiser`` makes them for that job alone: cond rows, then uncond rows). Concatenating the
calls and padding every text to the longest would change a sample's bits: small-M GEMMs (the time embedding
and its modulation, the final projection, the text projection), the patch embedding and attention over a
longer, masked key sequence all round differently at other shapes. So only the row-invariant part is shared:

* per job: ``model.embed`` on its own inputs (patch embed, text projection, time embedding, positions, its
  own key mask: whatever the family's embed computes per sample) and ``model.unembed`` on its own rows;
* joined: the blocks (the big linears over every token row, the norms, the elementwise time conditioning), on
  the jobs' hidden states zero-padded to the longest sequence, with one context the family's
  ``join_contexts`` makes from the jobs' own (engine/models/family.py);
* attention grouped by each job's own sequence length (and whether it has a key mask), so a group attends
  over exactly the keys, and with exactly the mask, it has alone; the padding rows are never attended and
  never read.

On this CPU (fp32, MKL, 1 or 2 threads) a job's velocity is then bit-equal to its own forward alone
(tests/test_batcher.py). On a GPU, cuBLAS picks kernels by M, so expect the tolerance the tests state.

Per-request LoRAs: a call's ``loras`` ({adapter key: strength}, made resident by the batcher) reach its rows
through the "lora" side path's route (engine/features/lora/rows.py): its own rows in its embed and unembed, its
span of the joined rows in the blocks (of the rows that run, under Cache-DiT).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..features.cache import DBCacheRunner
from ..features.lora import routed, row_route
from ..models import family_of
from ..models.block_loop import block_loop
from ..sampling import to_timestep


@dataclass
class Call:
    """One job's model call: velocity wanted for ``x`` [rows, C, h, w] at ``sigma`` [rows] with padded
    ``text`` [rows, T, C_text] (the model's dtype and device) and its ``lens`` [rows]."""

    x: torch.Tensor
    sigma: torch.Tensor
    text: torch.Tensor
    lens: torch.Tensor
    runner: Optional[DBCacheRunner] = None  # the job's Cache-DiT (None: every block computed)
    loras: Optional[Dict[int, float]] = None  # its per-request LoRAs: adapter key -> strength (None: none)


class GroupedAttention:
    """The model's attention over a joined batch: each group of rows on its own sequence length only, with
    the key mask it has alone (None when unpadded); the padding tokens' outputs are zero."""

    def __init__(self, attention: Callable, groups: List[Tuple[int, int, int, Optional[torch.Tensor]]]):
        self.attention = attention
        self.groups = groups  # (first row, end row, sequence length, key mask [rows, length] or None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask=None) -> torch.Tensor:
        out = q.new_zeros(q.shape)
        for r0, r1, s, mask in self.groups:
            part = [t[r0:r1, :s].contiguous() for t in (q, k, v)]  # the layout it has alone
            out[r0:r1, :s] = self.attention(*part, mask)
        return out


def _pad_tokens(t: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, S, ...] zero-padded to [rows, length, ...]."""
    if t.shape[1] == length:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], length - t.shape[1]) + tuple(t.shape[2:]))], dim=1)


def _attention_groups(parts, attention) -> GroupedAttention:
    """Consecutive jobs (already ordered by length) of equal sequence length and masking share one call."""
    groups, row = [], 0
    for h, ctx in parts:
        rows, s = h.shape[0], h.shape[1]
        if groups and groups[-1][2] == s and (groups[-1][3] is None) == (ctx.key_mask is None):
            r0, _, _, mask = groups[-1]
            mask = None if mask is None else torch.cat([mask, ctx.key_mask])
            groups[-1] = (r0, row + rows, s, mask)
        else:
            groups.append((row, row + rows, s, ctx.key_mask))
        row += rows
    return GroupedAttention(attention, groups)


def _joined_context(model, parts, length: int):
    """One block context for the jobs' rows, in order, each padded to ``length`` tokens (the family's
    ``join_contexts``), attending through the grouped attention that holds each job's own key mask."""
    return family_of(model).join_contexts([c for _, c in parts], length, _attention_groups(parts, parts[0][1].attention))


def joint_velocity(model, calls: Sequence[Call], device: torch.device) -> List[torch.Tensor]:
    """Flow velocity (float32, on each call's x device) for every call, through one pass over the blocks.
    The latents must have one size (the batcher groups calls by latent size). One call alone is exactly
    ``LocalRunner.velocity`` (with its runner in the model's block-runner slot)."""
    def alone(c: Call):  # a job's own rows: its embed, its unembed
        return routed(row_route([(c.x.shape[0], c.loras)], device))

    parts = []
    for c in calls:
        with alone(c):
            parts.append(model.embed(c.x.to(device), to_timestep(c.sigma).float().to(device), c.text, c.lens))
    if len(parts) == 1:
        h, ctx = parts[0]
        blocks = calls[0].runner or model.block_runner
        with alone(calls[0]):
            return [model.unembed(blocks(model, h, ctx), ctx).float().to(calls[0].x.device)]
    order = sorted(range(len(parts)), key=lambda i: (parts[i][0].shape[1], parts[i][1].key_mask is not None))
    ordered = [parts[i] for i in order]
    runners = [calls[i].runner for i in order]
    loras = [calls[i].loras for i in order]
    length = max(h.shape[1] for h, _ in ordered)
    h = torch.cat([_pad_tokens(h, length) for h, _ in ordered])
    if any(r is not None for r in runners):  # each job's own cache decisions, its LoRAs on the rows that run
        h = block_loop(family_of(model).loop_blocks(model), h, ordered, runners,
                          lambda active: _joined_context(model, [ordered[q] for q in active], length),
                          lambda active: routed(row_route([(ordered[q][0].shape[0], loras[q]) for q in active],
                                                          device)))
    else:
        with routed(row_route([(hi.shape[0], lo) for (hi, _), lo in zip(ordered, loras)], device)):
            h = model.block_runner(model, h, _joined_context(model, ordered, length))
    out: List[Optional[torch.Tensor]] = [None] * len(parts)
    row = 0
    for i, (hi, ci) in zip(order, ordered):
        rows, s = hi.shape[0], hi.shape[1]
        with alone(calls[i]):
            out[i] = model.unembed(h[row:row + rows, :s].contiguous(), ci).float().to(calls[i].x.device)
        row += rows
    return out


__all__ = ["Call", "GroupedAttention", "joint_velocity"]
