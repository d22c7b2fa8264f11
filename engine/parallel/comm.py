"""Collectives for sequence parallelism: Ulysses all-to-all, Ring attention (its blocks' kernel, the
attention with log-sum-exp and the merge come from engine/features/attention), and the process groups of a plan.

Layouts follow the engine's attention contract: q, k, v are [B, S, heads, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from ..features.attention import block_attention, lse_kernel, merge_lse
from .plan import ParallelPlan


@dataclass
class Groups:
    """This rank's groups. ``*_ranks`` are global ranks in group order."""

    plan: ParallelPlan
    rank: int
    world: int
    tp: Optional[object] = None
    ulysses: Optional[object] = None
    ring: Optional[object] = None
    sp: Optional[object] = None
    cfg: Optional[object] = None
    ranks: dict = field(default_factory=dict)

    @property
    def coords(self):
        return self.plan.coords(self.rank)


def build_groups(plan: ParallelPlan, rank: int) -> Groups:
    """Create every group of the plan (collective: all ranks call this with the same plan)."""
    g = Groups(plan, rank, plan.world_size)
    for kind, lists in plan.groups().items():
        for ranks in lists:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(g, kind, pg)
                g.ranks[kind] = ranks
    return g


def destroy_groups(g: Optional[Groups]) -> None:
    if g is None:
        return
    seen = set()
    for kind in ("tp", "ulysses", "ring", "sp", "cfg"):
        pg = getattr(g, kind)
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            try:
                dist.destroy_process_group(pg)
            except Exception:  # pragma: no cover - best effort
                pass


# -- Ulysses -----------------------------------------------------------------------------------
def ulysses_scatter_heads(qkv: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[N, B, s, H, D] (sequence chunk, all heads) -> [N, B, degree*s, H/degree, D] (whole
    sequence of the group, this rank's heads). One all-to-all for q, k and v together."""
    n, b, s, h, d = qkv.shape
    x = qkv.reshape(n, b, s, degree, h // degree, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # out[j]: rank j's sequence chunk, my heads
    return out.permute(1, 2, 0, 3, 4, 5).reshape(n, b, degree * s, h // degree, d)


def ulysses_gather_heads(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """Inverse: [B, degree*s, h, D] (whole sequence, my heads) -> [B, s, degree*h, D]."""
    b, S, h, d = x.shape
    s = S // degree
    x = x.reshape(b, degree, s, h, d).permute(1, 0, 2, 3, 4).contiguous()  # chunk j goes to rank j
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # out[j]: rank j's heads of my sequence chunk
    return out.permute(1, 2, 0, 3, 4).reshape(b, s, degree * h, d)


def ring_attention(q, k, v, blocks: list, group, ranks: List[int], my_index: int, backend: Optional[str] = None):
    """Ring attention: this rank's queries against every rank's K/V block.

    K/V (and nothing else) travel around the ring: at step i this rank holds the block of ring
    position (my_index - i) mod R and sends it on to the next position while it computes. Every
    block's partial output is merged by log-sum-exp. ``blocks[j]``: ring position j's key validity
    (``block_lens``: None = all valid, per-sample prefix lengths, or a bool mask [B, Sk]); it is
    known on every rank, so it is not sent. Each block runs the attention backend ``backend``'s kernel with
    log-sum-exp where the table has one, else sdpa's (``lse_kernel``).
    """
    kernel = lse_kernel(q.device, q.dtype, q.shape[-1], backend)
    R = len(ranks)
    nxt, prv = ranks[(my_index + 1) % R], ranks[(my_index - 1) % R]
    kv = torch.stack([k, v]).contiguous()
    out = lse = None
    for i in range(R):
        reqs = None
        if i < R - 1:
            recv = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            reqs = dist.batch_isend_irecv(ops)
        src = (my_index - i) % R
        bo, bl = block_attention(q, kv[0], kv[1], blocks[src], kernel)
        out, lse = merge_lse(out, lse, bo, bl)
        if reqs is not None:
            for r in reqs:
                r.wait()
            kv = recv
    return out.to(q.dtype)
