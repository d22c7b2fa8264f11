"""Step computation masks (SCM): which model calls of a run compute the DiT and which reuse the cache.

A mask is a list of 0/1 per model call (1 = compute). Our masks come from one rule, so they are
sensible for every step count (8 and 50 included) and never contain a long run of cached steps:

* the first and the last step always computed;
* from ``FEW_STEPS`` (16) on: a warm-up run of computed steps at the start (the composition is decided
  there), then the remaining compute budget spread evenly over the rest, so cached runs differ in length
  by at most one and never exceed the preset's ``max_run``;
* below ``FEW_STEPS`` (a distilled few-step model: Turbo at 8): the preset's ``few_compute`` share of the
  calls computed, evenly spaced from the first call to the last (no warm-up run: each step of such a model
  moves the picture a lot, so a reused residual must be extrapolated from computed calls on both sides of
  the composition, which TaylorSeer order 1 does; measured on the 36-block demo-turbo, bench/RESULTS.md).

Presets (the names users are told: ``quality``, ``balanced``, ``fast``; plus cache-dit's ``slow``,
``medium`` and ``ultra``): see ``PRESETS``. ``medium`` is an alias of ``quality`` (cache-dit's medium
computes 29 of 50 steps, our quality 26) and cache-dit's ``fast`` means the same as ours (speed first;
cache-dit computes 20 of 50 steps, ours 16). The 50-step budgets (quality 26, balanced 22, fast 16)
are set so the promised wall-clock speedups (1.67x / 2.0x / 2.69x) hold on a CPU, where a cached step
still costs ~6-8% of a computed one outside the blocks (bench/speed/cache_results.md); the few-step
shares (quality 5, balanced 4, fast 3 of 8 calls) so that 1.5x / 1.8x / 2.2x hold at 8 steps. ``slow`` and
``ultra`` keep cache-dit's budgets (about 3/4 and 1/4 of the steps) with our shape. Below a
preset's ``min_steps`` caching a step costs too much of the trajectory: the mask computes every
step and ``mask_note`` says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


@dataclass(frozen=True)
class MaskSpec:
    compute_ratio: float  # fraction of the steps computed (at 50 steps; the first/last rule adds a little at few steps)
    warmup_ratio: float  # fraction of the steps in the leading computed run
    max_run: int  # longest run of cached steps allowed
    min_steps: int  # below this, the preset computes every step
    few_compute: float  # fraction of the calls computed below FEW_STEPS (distilled few-step models)
    ramp_ratio: float  # fraction cached where the ramp to the full share starts (8 steps; used from FEW_STEPS on)
    min_warmup: int = 2


FEW_STEPS = 16  # below this many steps a model is treated as few-step (distilled, e.g. Turbo at 8)
FULL_STEPS = 28  # from this many steps on a preset caches its full share


PRESETS: Dict[str, MaskSpec] = {
    "slow": MaskSpec(compute_ratio=0.74, warmup_ratio=0.16, max_run=1, min_steps=4, few_compute=0.75, ramp_ratio=0.125),
    "quality": MaskSpec(compute_ratio=0.52, warmup_ratio=0.16, max_run=2, min_steps=4, few_compute=0.625, ramp_ratio=0.0),
    "balanced": MaskSpec(compute_ratio=0.44, warmup_ratio=0.14, max_run=2, min_steps=4, few_compute=0.5,
                         ramp_ratio=0.125),
    "fast": MaskSpec(compute_ratio=0.32, warmup_ratio=0.12, max_run=4, min_steps=4, few_compute=0.375, ramp_ratio=0.25),
    "ultra": MaskSpec(compute_ratio=0.26, warmup_ratio=0.10, max_run=4, min_steps=4, few_compute=0.25,
                      ramp_ratio=0.375),
}
ALIASES: Dict[str, str] = {"medium": "quality"}
USER_PRESETS = ("quality", "balanced", "fast")
ALL_PRESETS = ("quality", "balanced", "fast", "slow", "medium", "ultra")


def canonical_preset(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def cached_fraction(spec: MaskSpec, n: int) -> float:
    """Share of the steps the preset caches from FEW_STEPS on: on the line from ``ramp_ratio`` at 8 steps to
    ``1 - compute_ratio`` at 28, that share from 28 steps on (each step of a short run is a bigger part of the
    trajectory)."""
    full = 1.0 - spec.compute_ratio
    if n >= FULL_STEPS:
        return full
    t = max(0.0, (n - 8) / (FULL_STEPS - 8))
    return spec.ramp_ratio + t * (full - spec.ramp_ratio)


def few_step_mask(spec: MaskSpec, n: int) -> List[int]:
    """Below FEW_STEPS: ``few_compute`` of the calls (more if a cached run would pass ``max_run``), evenly
    spaced from the first call to the last, a fraction rounded up (later)."""
    k = max(2, math.ceil(spec.few_compute * n - 1e-9))
    while True:
        computed = {math.ceil(j * (n - 1) / (k - 1) - 1e-9) for j in range(k)}
        mask = [1 if i in computed else 0 for i in range(n)]
        if longest_cached_run(mask) <= spec.max_run or k >= n:
            return mask
        k += 1


def preset_mask(preset: str, steps: int) -> List[int]:
    """The preset's mask for ``steps`` model calls (1 = compute, 0 = reuse the cache)."""
    name = canonical_preset(preset)
    if name not in PRESETS:
        raise ValueError(f"unknown cache preset '{preset}'; allowed: {', '.join(ALL_PRESETS)}")
    spec = PRESETS[name]
    n = int(steps)
    if n < 1:
        return []
    if n < spec.min_steps or n < 3:
        return [1] * n
    if n < FEW_STEPS:
        return few_step_mask(spec, n)
    warm = max(spec.min_warmup, int(round(spec.warmup_ratio * n)))
    # Positions warm .. n-2 may be cached; n-1 (the last step) is always computed.
    width = n - 1 - warm
    if width <= 0:
        return [1] * n
    cached = max(1, int(round(cached_fraction(spec, n) * n)))
    cached = min(cached, width)
    # No cached run longer than max_run: width - cached inner computes make (inner + 1) runs.
    while cached > 0 and math.ceil(cached / (width - cached + 1)) > spec.max_run:
        cached -= 1
    inner = width - cached
    mask = [1] * warm + [0] * (n - warm)
    mask[-1] = 1
    if inner >= cached:  # mostly computes: spread the cached steps, each one alone
        mask[warm:n - 1] = [1] * width
        for j in range(cached):
            mask[warm + int((j + 0.5) * width / cached)] = 0
    else:  # mostly cached: spread the inner computes between warm-1 and n-1
        gap = n - warm
        for j in range(1, inner + 1):
            mask[warm - 1 + int(round(j * gap / (inner + 1)))] = 1
    return mask


def mask_note(preset: str, steps: int) -> Optional[str]:
    """A sentence when the preset computes every step at this step count, else None."""
    name = canonical_preset(preset)
    spec = PRESETS.get(name)
    if spec is not None and 0 < steps < max(spec.min_steps, 3):
        return (f"cache preset '{preset}' computes every step at {steps} steps: caching needs at least "
                f"{spec.min_steps} steps for this preset to keep the image (no speedup)")
    return None


def parse_mask(text) -> List[int]:
    """'1110101' / '1,1,1,0' / [1, 1, 0] -> list of 0/1."""
    if isinstance(text, str):
        s = text.replace(",", "").replace(" ", "").strip()
        if not s or any(c not in "01" for c in s):
            raise ValueError(f"a step mask is a string of 0 and 1 (1 = compute), got '{text}'")
        return [int(c) for c in s]
    out = [int(v) for v in text]
    if any(v not in (0, 1) for v in out):
        raise ValueError(f"a step mask holds only 0 and 1 (1 = compute), got {list(text)}")
    return out


def fit_mask(mask: Sequence[int], steps: int) -> List[int]:
    """A custom mask for ``steps`` calls: cut or padded with computes; first and last computed."""
    m = list(mask[:steps]) + [1] * max(0, steps - len(mask))
    if m:
        m[0] = 1
        m[-1] = 1
    return m


def mask_str(mask: Sequence[int]) -> str:
    return "".join("1" if v else "0" for v in mask)


def longest_cached_run(mask: Sequence[int]) -> int:
    best = run = 0
    for v in mask:
        run = 0 if v else run + 1
        best = max(best, run)
    return best
