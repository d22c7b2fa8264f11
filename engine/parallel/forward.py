"""What runs on every rank: the parallel forward of the (sharded) model, tensor parallel's all-reduce,
and the cache's distance under sequence parallel. The steps of a forward are in docs/parallel.md."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..features import patching
from ..features.attention import AttentionBackend, block_lens
from ..features.cache import DBCacheRunner
from ..models import family_of
from .comm import Groups, ring_attention, ulysses_gather_heads, ulysses_scatter_heads

TP = "tensor_parallel"


# -- tensor parallel: row-parallel outputs are partial sums -------------------------------------------------
@torch.compiler.disable
def _all_reduce(out: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(out, group=group)
    return out


def _tp_class(base: type) -> type:
    """``base`` (a block submodule the family names in ``partial_sum_modules``) whose output is all-reduced over
    the tensor-parallel group. A class swap: a compiled block sees it (docs/architecture.md)."""
    def forward(self, *args, **kwargs):
        return _all_reduce(base.forward(self, *args, **kwargs), patching.state(self)[TP])

    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


class TensorParallelPatch(patching.Patch):
    name = TP

    def __init__(self, model, group):
        super().__init__(model)
        family = family_of(model)
        self.modules = [block.get_submodule(name) for block in family.blocks_of(model)
                        for name in family.partial_sum_modules]
        for m in self.modules:
            patching.state(m)[TP] = group
            patching.swap_class(m, TP, _tp_class)

    def remove(self) -> None:
        for m in self.modules:
            patching.restore_class(m, TP)
            patching.clear_state(m, TP)

    def describe(self) -> dict:
        return {"all_reduced_modules": len(self.modules)}


def apply_tensor_parallel(model, group) -> TensorParallelPatch:
    return patching.attach(model, TensorParallelPatch(model, group))


# -- Cache-DiT under sequence parallel ---------------------------------------------------------------------
class SequenceParallelDistance:
    """The cache's measure summed over the whole sequence (all-reduce over the sequence group, padding left
    out), which is what one process measures; the decision is all-reduced too (max of "compute"), so ranks
    that see different CFG branches compute exactly when one process would."""

    def __init__(self, groups: Groups):
        self.groups = groups

    def relative_l1(self, ref, cur, branches: int, valid_tokens=None) -> torch.Tensor:
        if valid_tokens is not None:
            ref, cur = ref[:, :valid_tokens], cur[:, :valid_tokens]
        br = branches if ref.shape[0] % branches == 0 else 1
        num = (ref - cur).abs().reshape(br, -1).float().sum(1)
        den = ref.abs().reshape(br, -1).float().sum(1)
        if self.groups.sp is not None:
            both = torch.stack([num, den])
            dist.all_reduce(both, group=self.groups.sp)
            num, den = both[0], both[1]
        return num / den.clamp_min(1e-12)

    def agree(self, compute: bool, device) -> bool:
        if self.groups.world <= 1:
            return compute
        flag = torch.tensor([1.0 if compute else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


def cache_runner(plan, branches: int, groups: Groups) -> DBCacheRunner:
    return DBCacheRunner(plan, branches=branches, distance=SequenceParallelDistance(groups))


# -- the parallel forward ------------------------------------------------------------------------------------
class ParallelModel:
    """One rank's view: the (sharded) model, its groups and the parallel forward."""

    def __init__(self, model, groups: Groups):
        self.model = model
        self.groups = groups
        self.plan = groups.plan
        self.tp = apply_tensor_parallel(model, groups.tp) if groups.tp is not None else None

    def close(self) -> None:
        if self.tp is not None:
            patching.detach(self.model, TP)
            self.tp = None

    def _sp_attention(self, full_mask: Optional[torch.Tensor], chunk: int, host_mask: Optional[torch.Tensor] = None):
        plan, g = self.plan, self.groups
        ulysses, ring = plan.ulysses, plan.ring
        ring_index = g.coords[1]
        base = self.model.attention  # the backend chosen at load (Ulysses runs it on its heads' whole sequence)
        backend = AttentionBackend.chosen(self.model)  # ring's blocks: its kernel with log-sum-exp, where it has one
        span = ulysses * chunk  # tokens of one ring position (a ulysses group's sequence)
        masks = [None if full_mask is None else full_mask[:, j * span:(j + 1) * span] for j in range(ring)]
        # each ring position's valid keys, from the host copy of the mask when the family gives one (else a sync)
        read = masks if host_mask is None else [host_mask[:, j * span:(j + 1) * span] for j in range(ring)]
        blocks = [block_lens(m) for m in read] if ring > 1 else None

        @torch.compiler.disable
        def attention(q, k, v, key_mask=None):
            if ulysses > 1:
                q, k, v = ulysses_scatter_heads(torch.stack([q, k, v]), g.ulysses, ulysses).unbind(0)
            if ring > 1:
                out = ring_attention(q, k, v, blocks, g.ring, g.ranks["ring"], ring_index, backend)
            else:
                out = base(q, k, v, masks[0])
            if ulysses > 1:
                out = ulysses_gather_heads(out.contiguous(), g.ulysses, ulysses)
            return out

        return attention

    def forward(self, x, timestep, text, lens, cfg_batched: bool = False):
        plan, g = self.plan, self.groups
        model = self.model
        if plan.cfg > 1 and cfg_batched:
            half = x.shape[0] // plan.cfg
            sl = slice(g.coords[0] * half, (g.coords[0] + 1) * half)
            x, text = x[sl], text[sl]
            timestep = timestep[sl] if timestep.dim() and timestep.shape[0] == 2 * half else timestep
            lens = lens[sl] if lens.dim() and lens.shape[0] == 2 * half else lens
        h, ctx = model.embed(x, timestep, text, lens)
        if plan.sp > 1:
            h = self._sequence_parallel_blocks(h, ctx)
        else:
            h = model.block_runner(model, h, ctx)
        out = model.unembed(h, ctx)
        if plan.cfg > 1 and cfg_batched:
            parts = [torch.empty_like(out) for _ in range(plan.cfg)]
            dist.all_gather(parts, out.contiguous(), group=g.cfg)
            out = torch.cat(parts, dim=0)
        return out

    def _sequence_parallel_blocks(self, h: torch.Tensor, ctx) -> torch.Tensor:
        """The blocks on this rank's chunk of the joined sequence (the family's ``chunk_context`` cuts the
        context), then the chunks gathered."""
        plan, g, model = self.plan, self.groups, self.model
        b, seq, _ = h.shape
        chunk = math.ceil(seq / plan.sp)
        pad = chunk * plan.sp - seq
        full_mask = ctx.key_mask
        host_mask = getattr(ctx, "key_mask_host", None) if full_mask is not None else None
        if pad:
            h = F.pad(h, (0, 0, 0, pad))
            if full_mask is None:
                full_mask = torch.ones(b, seq, dtype=torch.bool, device=h.device)
                host_mask = torch.ones(b, seq, dtype=torch.bool)
            full_mask = F.pad(full_mask, (0, pad), value=False)
            if host_mask is not None:
                host_mask = F.pad(host_mask, (0, pad), value=False)
        k = g.coords[1] * plan.ulysses + g.coords[2]
        sl = slice(k * chunk, (k + 1) * chunk)
        local_ctx = family_of(model).chunk_context(ctx, pad, sl, self._sp_attention(full_mask, chunk, host_mask),
                                                   max(0, min(chunk, seq - k * chunk)))
        h_local = model.block_runner(model, h[:, sl].contiguous(), local_ctx)
        parts = [torch.empty_like(h_local) for _ in range(plan.sp)]
        dist.all_gather(parts, h_local.contiguous(), group=g.sp)
        return torch.cat(parts, dim=1)[:, :seq]
