"""Collectives for sequence parallelism: Ulysses all-to-all, Ring attention with the log-sum-exp
merge, and the process groups of a plan.

Layouts follow the engine's attention contract: q, k, v are [B, S, heads, head_dim].
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

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


# -- attention with log-sum-exp ------------------------------------------------------------------
def attention_with_lse(q, k, v, key_mask: Optional[torch.Tensor], max_scores: int = 1 << 26):
    """Softmax attention of q [B, Sq, H, D] over one block k, v [B, Sk, H, D] in float32.

    Returns (out [B, Sq, H, D] float32, lse [B, Sq, H] float32). A query whose block keys are all
    masked gets out = 0 and lse = -inf (no NaN), so it merges away. Queries are processed in
    chunks so the score matrix stays below ``max_scores`` elements."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    kf = k.float().permute(0, 2, 3, 1)  # [B, H, D, Sk]
    vf = v.float().transpose(1, 2)  # [B, H, Sk, D]
    mask = None if key_mask is None else ~key_mask[:, None, None, :]
    step = max(1, max_scores // max(1, b * h * sk))
    outs, lses = [], []
    for i in range(0, sq, step):
        qf = q[:, i:i + step].float().transpose(1, 2)  # [B, H, sq', D]
        s = torch.matmul(qf, kf) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, sq']
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        outs.append(torch.matmul(p, vf).transpose(1, 2))  # [B, sq', H, D]
        lses.append(lse.transpose(1, 2))  # [B, sq', H]
    return torch.cat(outs, 1), torch.cat(lses, 1)


# -- fast kernels that return the log-sum-exp ----------------------------------------------------------
log = logging.getLogger("sgld.parallel")
_KERNELS: Dict[tuple, Callable] = {}


def _flash_cuda(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), 0.0, False)[:2]
    return out.transpose(1, 2).float(), lse[..., : q.shape[1]].transpose(1, 2).float()


def _flash_cpu(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.transpose(1, 2), k.transpose(1, 2),
                                                                          v.transpose(1, 2), 0.0, False)[:2]
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float()


def _math(q, k, v):
    return attention_with_lse(q, k, v, None)


def lse_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable:
    """The fastest unmasked attention-with-LSE that agrees with the float32 reference here: torch's
    flash kernel (CUDA fp16/bf16, or CPU), checked once per (device, dtype) on a small input
    against ``attention_with_lse``; anything that fails or disagrees falls back to it (logged)."""
    key = (device.type, dtype, head_dim)
    if key in _KERNELS:
        return _KERNELS[key]
    candidates = []
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        candidates.append(("flash (aten, CUDA)", _flash_cuda))
    if device.type == "cpu":
        candidates.append(("flash (aten, CPU)", _flash_cpu))
    chosen, name = _math, "float32 reference (math)"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 37, 2, head_dim, generator=g).to(device, dtype) for _ in range(3))
    ref_o, ref_l = attention_with_lse(q, k, v, None)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for cand_name, fn in candidates:
        try:
            o, lse = fn(q, k, v)
            if o.shape == ref_o.shape and lse.shape == ref_l.shape and \
                    (o - ref_o).abs().max().item() <= tol and (lse - ref_l).abs().max().item() <= tol:
                chosen, name = fn, cand_name
                break
            log.warning("parallel: ring attention kernel %s disagrees with the reference; not used", cand_name)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            log.warning("parallel: ring attention kernel %s unavailable (%s); using the next", cand_name, e)
    log.info("parallel: ring attention blocks on %s/%s: %s", device.type, str(dtype).replace("torch.", ""), name)
    _KERNELS[key] = chosen
    return chosen


def block_lens(mask: Optional[torch.Tensor]):
    """A block's key mask -> None (all valid), per-sample valid-prefix lengths, or the mask itself
    when a row is not a prefix. ERNIE-Image's masks are prefixes (text padding at the end of the
    unified sequence), and so is any contiguous block of them. One host sync per forward."""
    if mask is None:
        return None
    lens = mask.sum(dim=1)
    ar = torch.arange(mask.shape[1], device=mask.device)
    if not bool((mask == (ar[None] < lens[:, None])).all()):
        return mask
    lens = [int(n) for n in lens.tolist()]
    return None if all(n == mask.shape[1] for n in lens) else lens


def block_attention(q, k, v, block, kernel: Callable):
    """Attention with LSE of q over one K/V block; ``block`` from ``block_lens``."""
    if block is None:
        return kernel(q, k, v)
    if isinstance(block, torch.Tensor):
        return attention_with_lse(q, k, v, block)
    outs, lses = [], []
    b, sq, h, d = q.shape
    for i, n in enumerate(block):
        if n == 0:  # nothing to attend to in this block: weight 0 in the merge
            outs.append(torch.zeros(1, sq, h, d, dtype=torch.float32, device=q.device))
            lses.append(torch.full((1, sq, h), float("-inf"), device=q.device))
        else:
            o, lse = kernel(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n])
            outs.append(o)
            lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def merge_lse(out, lse, block_out, block_lse):
    """Merge two partial softmax results by their log-sum-exp (exact; -inf safe).

    new_lse = log(exp(lse) + exp(block_lse)); out = exp(lse - new) * out + exp(block_lse - new) * block_out."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    a = torch.exp(lse - safe).unsqueeze(-1)
    c = torch.exp(block_lse - safe).unsqueeze(-1)
    return a * out + c * block_out, new


def ring_attention(q, k, v, blocks: list, group, ranks: List[int], my_index: int, kernel: Optional[Callable] = None):
    """Ring attention: this rank's queries against every rank's K/V block.

    K/V (and nothing else) travel around the ring: at step i this rank holds the block of ring
    position (my_index - i) mod R and sends it on to the next position while it computes. Every
    block's partial output is merged by log-sum-exp. ``blocks[j]``: ring position j's key validity
    (``block_lens``: None = all valid, per-sample prefix lengths, or a bool mask [B, Sk]); it is
    known on every rank, so it is not sent.
    """
    kernel = kernel or lse_kernel(q.device, q.dtype, q.shape[-1])
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
