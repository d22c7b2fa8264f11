"""DBCache as a block runner: ``model.block_runner = DBCacheRunner(...)`` for one sampling run.

Per model call (= one "step" of the mask; heun makes two per step):

1. the first ``fn`` blocks always run; ``fn_res = h_after_fn - h_in``;
2. decide: compute or reuse (first / last call, mask, warm-up, max cached, max consecutive, threshold);
3. compute: run the middle blocks, save their residual (and feed TaylorSeer), keep ``fn_res`` as the
   reference; reuse: ``h = h_after_fn + saved residual`` (or TaylorSeer's prediction);
4. the last ``bn`` blocks always run.

The threshold test is the relative L1 change of ``fn_res`` against the reference saved at the last
*computed* call, measured separately for every CFG branch (the batch is ``[cond..., uncond...]``,
each half against its own reference); the call is cached only if every branch is below ``rdt``:
one decision for the batch, one host sync (``bool(...)``) at most per call, none at all with a
static mask. All state lives in the runner, so a new run (new resolution, batch, step count)
starts clean. Blocks are called one by one from the model's blocks, so per-layer hooks (offload) and
per-block torch.compile keep working; the skipped calls change no shapes, so nothing recompiles.

Differences from cache-dit, on purpose: the max-consecutive counter resets on every computed step
(cache-dit only resets it when the limit fires); the first and last calls are always computed.
"""
from __future__ import annotations

from collections import Counter
from typing import List, Optional

import torch

from ...models.block_loop import block_loop
from ...models.family import family_of
from .config import ResolvedCache
from .masks import mask_str
from .taylorseer import TaylorSeer


class LocalDistance:
    """The cache's measure in one process: per CFG branch, mean|ref - cur| / mean|ref| over the whole batch
    half (no host sync). Sequence parallel injects its own (engine/parallel/forward.py), which sums over
    every rank's chunk and makes every rank take the same decision."""

    def relative_l1(self, ref: torch.Tensor, cur: torch.Tensor, branches: int, valid_tokens=None) -> torch.Tensor:
        br = branches if ref.shape[0] % branches == 0 else 1
        num = (ref - cur).abs().reshape(br, -1).float().mean(1)
        den = ref.abs().reshape(br, -1).float().mean(1).clamp_min(1e-12)
        return num / den

    def agree(self, compute: bool, device) -> bool:
        """The decision every process takes (here: this one's)."""
        return compute


class DBCacheRunner:
    def __init__(self, rc: ResolvedCache, branches: int = 1, distance=None):
        self.rc = rc
        self.branches = max(1, int(branches))
        self.distance = distance or LocalDistance()
        self.valid_tokens = None
        self.device = None
        self.calibrator = TaylorSeer(rc.ts_order) if rc.taylorseer else None
        self.need_reference = rc.mask is None or rc.scm_policy == "dynamic"
        self.reset()

    def reset(self) -> None:
        self.call = 0
        self.reference: Optional[torch.Tensor] = None  # fn residual at the last computed call
        self.residual: Optional[torch.Tensor] = None  # middle-block residual at the last computed call
        self.shape = None
        self.last_computed = -1
        self.cached = 0
        self.consecutive = 0
        self.computed: List[bool] = []
        self.reasons: List[str] = []
        self.diffs: List[Optional[torch.Tensor]] = []  # per-branch diff tensors (read once, after the run)
        if self.calibrator is not None:
            self.calibrator.reset()

    # -- decision ----------------------------------------------------------------------------------
    def relative_l1(self, cur: torch.Tensor) -> torch.Tensor:
        """Per-branch relative L1 change of the first blocks' residual, as a [branches] float32 tensor."""
        return self.distance.relative_l1(self.reference, cur, self.branches, self.valid_tokens)

    def decide(self, i: int, fn_res: Optional[torch.Tensor]) -> tuple:
        """(compute?, reason, diff tensor or None)."""
        rc = self.rc
        if self.residual is None and (self.calibrator is None or not self.calibrator.ready):
            return True, "first", None
        if i == 0 or i >= rc.calls - 1:
            return True, "first/last", None
        if rc.mask is not None:
            if i >= len(rc.mask) or rc.mask[i]:
                return True, "mask", None
            if rc.scm_policy == "static":
                return False, "mask", None
        elif i < rc.warmup:
            return True, "warmup", None
        if rc.max_cached_steps >= 0 and self.cached >= rc.max_cached_steps:
            return True, "max_cached", None
        if rc.mc >= 0 and self.consecutive >= rc.mc:
            return True, "mc", None
        if rc.rdt <= 0:
            return True, "rdt", None
        if rc.rdt >= 1.0:
            return False, "rdt>=1", None
        if self.reference is None or fn_res is None or self.reference.shape != fn_res.shape:
            return True, "no reference", None
        d = self.relative_l1(fn_res)
        compute = not bool((d < rc.rdt).all())  # the one host sync of this call
        agreed = self.distance.agree(compute, self.device)
        if agreed != compute:
            return True, "peer", d
        return compute, ("rdt" if compute else "similar"), d

    # -- the block runner ---------------------------------------------------------------------------
    def __call__(self, model, h: torch.Tensor, ctx) -> torch.Tensor:
        """One model call's blocks: the block loop (engine/models/block_loop.py) with this run's rows alone."""
        return block_loop(family_of(model).loop_blocks(model), h, [(h, ctx)], [self], lambda active: ctx)

    # The phases of one call, which the block loop runs for each job of a forward.
    def start(self, h: torch.Tensor, ctx) -> int:
        """Begin a model call on hidden states ``h``; returns its index (a new shape starts the state afresh)."""
        i = self.call
        self.call += 1
        self.valid_tokens, self.device = getattr(ctx, "valid_tokens", None), h.device  # a field of the family's block context
        if self.shape is not None and tuple(h.shape) != self.shape:  # cannot reuse across shapes
            calls = self.call
            self.reset()
            self.call = calls
        self.shape = tuple(h.shape)
        return i

    def fn_residual(self, h_in: torch.Tensor, h_fn: torch.Tensor) -> Optional[torch.Tensor]:
        """What the first ``fn`` blocks added (the threshold's measure), when the decision needs it."""
        return h_fn - h_in if self.need_reference else None

    def keep(self, i: int, res: torch.Tensor, fn_res: Optional[torch.Tensor]) -> None:
        """A computed call: save the middle blocks' residual ``res`` (or feed TaylorSeer) and the reference."""
        if self.calibrator is not None:
            self.calibrator.update(res, i)
            self.residual = None
        else:
            self.residual = res
        if self.need_reference:
            self.reference = fn_res
        self.last_computed = i
        self.consecutive = 0

    def reuse(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """A cached call: ``h`` after the first blocks plus the saved (or predicted) middle residual."""
        self.cached += 1
        self.consecutive += 1
        if self.calibrator is not None:
            return h + self.calibrator.predict(i, dtype=h.dtype)
        return h + self.residual

    def record(self, compute: bool, reason: str, diff) -> None:
        self.computed.append(bool(compute))
        self.reasons.append(reason)
        self.diffs.append(diff)

    # -- statistics ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        """What happened in the run (reads the recorded diffs: call after the run)."""
        diffs = []
        for d in self.diffs:
            diffs.append(None if d is None else [round(float(v), 5) for v in d.detach().cpu().tolist()])
        computed = sum(self.computed)
        return {
            "config": self.rc.tag(),
            "preset": self.rc.preset,
            "note": self.rc.note,
            "mask_planned": None if self.rc.mask is None else mask_str(self.rc.mask),
            "mask": mask_str(self.computed),
            "calls": len(self.computed),
            "computed": computed,
            "cached": len(self.computed) - computed,
            "reasons": dict(Counter(self.reasons)),
            "diffs": diffs,
            "warnings": list(self.rc.warnings),
        }
