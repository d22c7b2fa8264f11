"""What runs on every rank: the sharded model, the parallel forward and the Cache-DiT runner.

Forward on one rank (``ParallelModel.forward``), for the plan (cfg, ring, ulysses, tp):

1. CFG: a CFG-batched call ``[cond..., uncond...]`` is split; CFG rank c takes half c.
2. ``model.embed`` on the whole [image; text] sequence (cheap, replicated): hidden states, the
   modulation, RoPE cos/sin per token and the key mask.
3. Sequence parallel (ulysses x ring = sp > 1): the unified sequence is zero-padded to a multiple
   of sp (padded tokens are masked as keys, so they change nothing) and cut into sp contiguous
   chunks; rank (r, u) keeps chunk r*ulysses + u with its RoPE rows. Text tokens are ordinary
   sequence tokens here (ERNIE-Image is single-stream), so the text padding mask travels with them.
4. Blocks through ``model.block_runner`` (the default loop, or Cache-DiT's runner). Attention:
   Ulysses all-to-all (sequence chunk, all heads -> the ulysses group's sequence, 1/ulysses of the
   heads), then Ring over the ring group (KV passed around, partial outputs merged by LSE) or the
   engine's own attention backend when ring = 1, then the inverse all-to-all.
   Tensor parallel: q/k/v and gate/up hold 1/tp of the output features (heads split across ranks),
   to_out and fc2 hold 1/tp of the input features and their outputs are all-reduced (forward hooks
   on ``self_attention`` and ``mlp``, so quantized linears and compiled blocks keep working).
5. All-gather of the hidden states over the sp group, ``model.unembed`` (replicated), and an
   all-gather over the CFG group. Every rank ends with the full output.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from .comm import Groups, block_lens, ring_attention, ulysses_gather_heads, ulysses_scatter_heads


# -- tensor parallel (the shards themselves are read by engine/io/load.py) -------------------------------
def install_tp_hooks(model, group) -> list:
    """Row-parallel outputs are partial sums: all-reduce them over the TP group."""

    @torch.compiler.disable
    def all_reduce(module, inputs, output):
        dist.all_reduce(output, group=group)
        return output

    handles = []
    for block in model.layers:
        handles.append(block.self_attention.register_forward_hook(all_reduce))
        handles.append(block.mlp.register_forward_hook(all_reduce))
    return handles


# -- Cache-DiT under parallelism ------------------------------------------------------------------------
def make_parallel_cache_runner(rc, branches: int, groups: Groups):
    from ..features.cache import DBCacheRunner

    class ParallelDBCacheRunner(DBCacheRunner):
        """DBCache whose skip/compute decision is the same on every rank.

        The residual difference is summed over the whole sequence (all-reduce over the sp group,
        padding tokens left out), which is what one process measures; the decision is then
        all-reduced (max of "compute") over all ranks, so CFG ranks, which see different branches,
        compute exactly when one process would (it computes unless every branch is similar)."""

        def __call__(self, model, h, ctx):
            self._valid = ctx.extra.get("sp_valid")
            self._device = h.device
            return super().__call__(model, h, ctx)

        def relative_l1(self, cur):
            ref = self.reference
            valid = getattr(self, "_valid", None)
            if valid is not None:
                ref, cur = ref[:, :valid], cur[:, :valid]
            br = self.branches if ref.shape[0] % self.branches == 0 else 1
            num = (ref - cur).abs().reshape(br, -1).float().sum(1)
            den = ref.abs().reshape(br, -1).float().sum(1)
            if groups.sp is not None:
                both = torch.stack([num, den])
                dist.all_reduce(both, group=groups.sp)
                num, den = both[0], both[1]
            return num / den.clamp_min(1e-12)

        def decide(self, i, fn_res):
            compute, reason, d = super().decide(i, fn_res)
            if d is not None and groups.world > 1:  # only the data-dependent path can differ between ranks
                flag = torch.tensor([1.0 if compute else 0.0], device=self._device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0 and not compute:
                    compute, reason = True, "peer"
            return compute, reason, d

    return ParallelDBCacheRunner(rc, branches=branches)


# -- the parallel model -----------------------------------------------------------------------------------
class ParallelModel:
    """One rank's view: the (sharded) model, its groups and the parallel forward."""

    def __init__(self, model, groups: Groups):
        self.model = model
        self.groups = groups
        self.plan = groups.plan
        self.base_attention = model.attention
        self.hooks = install_tp_hooks(model, groups.tp) if groups.tp is not None else []

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # -- attention under sequence parallel ---------------------------------------------------------------
    def _sp_attention(self, full_mask: Optional[torch.Tensor], chunk: int):
        plan, g = self.plan, self.groups
        U, R = plan.ulysses, plan.ring
        c, r, u, t = g.coords
        base = self.base_attention
        span = U * chunk  # tokens of one ring position (a ulysses group's sequence)

        def block_mask(j):
            return None if full_mask is None else full_mask[:, j * span:(j + 1) * span]

        masks = [block_mask(j) for j in range(R)]
        blocks = [block_lens(m) for m in masks] if R > 1 else None

        @torch.compiler.disable
        def attention(q, k, v, key_mask=None):
            if U > 1:
                q, k, v = ulysses_scatter_heads(torch.stack([q, k, v]), g.ulysses, U).unbind(0)
            if R > 1:
                out = ring_attention(q, k, v, blocks, g.ring, g.ranks["ring"], r)
            else:
                out = base(q, k, v, masks[0])
            if U > 1:
                out = ulysses_gather_heads(out.contiguous(), g.ulysses, U)
            return out

        return attention

    def forward(self, x, timestep, text, lens, cfg_batched: bool = False):
        plan, g = self.plan, self.groups
        model = self.model
        if plan.cfg > 1 and cfg_batched:
            c = g.coords[0]
            half = x.shape[0] // plan.cfg
            sl = slice(c * half, (c + 1) * half)
            x, text = x[sl], text[sl]
            timestep = timestep[sl] if timestep.dim() and timestep.shape[0] == 2 * half else timestep
            lens = lens[sl] if lens.dim() and lens.shape[0] == 2 * half else lens
        h, ctx = model.embed(x, timestep, text, lens)
        if plan.sp > 1:
            b, S, H = h.shape
            L = math.ceil(S / plan.sp)
            pad = L * plan.sp - S
            cos, sin = ctx.rope
            full_mask = ctx.key_mask
            if pad:
                h = torch.nn.functional.pad(h, (0, 0, 0, pad))
                cos = torch.nn.functional.pad(cos, (0, 0, 0, 0, 0, pad))
                sin = torch.nn.functional.pad(sin, (0, 0, 0, 0, 0, pad))
                if full_mask is None:
                    full_mask = torch.ones(b, S, dtype=torch.bool, device=h.device)
                full_mask = torch.nn.functional.pad(full_mask, (0, pad), value=False)
            _, r, u, _ = g.coords
            k = r * plan.ulysses + u
            sl = slice(k * L, (k + 1) * L)
            local_ctx = dataclasses.replace(ctx, rope=(cos[:, sl], sin[:, sl]), key_mask=None,
                                            attention=self._sp_attention(full_mask, L), extra=dict(ctx.extra))
            local_ctx.extra["sp_valid"] = max(0, min(L, S - k * L))
            h_local = model.block_runner(model, h[:, sl].contiguous(), local_ctx)
            parts = [torch.empty_like(h_local) for _ in range(plan.sp)]
            dist.all_gather(parts, h_local.contiguous(), group=g.sp)
            h = torch.cat(parts, dim=1)[:, :S]
        else:
            h = model.block_runner(model, h, ctx)
        out = model.unembed(h, ctx)
        if plan.cfg > 1 and cfg_batched:
            parts = [torch.empty_like(out) for _ in range(plan.cfg)]
            dist.all_gather(parts, out.contiguous(), group=g.cfg)
            out = torch.cat(parts, dim=0)
        return out
