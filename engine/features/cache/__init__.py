"""Cache-DiT for the engine: DBCache block runner, TaylorSeer, step computation masks, presets.

Switch on with ``Engine.sample(..., cache=CacheConfig(preset="balanced"))``, ``EngineConfig(cache=...)``
or the environment (``SGLANG_CACHE_DIT_ENABLED=true SGLANG_CACHE_DIT_SCM_PRESET=balanced``), which the
entry points (CLI, server start, nodes, pipeline) read once through ``resolve_config``; the engine never reads it.
``Engine.sample`` attaches a ``DBCacheRunner`` as the "cache" patch (``apply_cache``: the model's
``block_runner`` slot) for the run and removes it afterwards (``remove_cache``, also on an exception), so
with the cache off nothing changes.
"""
from __future__ import annotations

import os
from typing import List, Optional

from .attach import CachePatch, apply_cache, remove_cache
from .config import (
    DEFAULTS,
    FROM_PRESET,
    PRESET_KNOBS,
    CacheConfig,
    CacheConfigError,
    ResolvedCache,
    config_from_dict,
    from_env,
    resolve_config,
    run_config,
)
from .dbcache import DBCacheRunner
from .masks import ALIASES, ALL_PRESETS, PRESETS, USER_PRESETS, longest_cached_run, mask_note, mask_str, parse_mask, preset_mask
from .taylorseer import TaylorSeer

# The presets' measured speedup and quality (bench/speed/cache_bench.py writes it; the Cache-DiT node's tooltip reads it).
MEASURED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")


def measured_speedup(call_seconds: List[float], computed: List[bool]) -> Optional[float]:
    """Speedup of the model calls against the same run with every call computed, from per-call wall
    times: (time of the computed calls + cached calls priced as computed ones) / actual time. The first
    call (allocations, warm-up) is left out of the per-call price when there are others."""
    if not call_seconds or len(call_seconds) != len(computed):
        return None
    comp = [t for t, c in zip(call_seconds, computed) if c]
    if not comp:
        return None
    price_pool = comp[1:] if len(comp) > 2 else comp
    price = sorted(price_pool)[len(price_pool) // 2]  # median: robust to a slow outlier
    actual = sum(call_seconds)
    full = sum(t if c else price for t, c in zip(call_seconds, computed))
    return round(full / actual, 3) if actual > 0 else None


def estimated_speedup(mask: List[bool], fn: int, bn: int, num_layers: int) -> float:
    """Block-compute bound: calls / (computed + cached * (fn + bn) / layers)."""
    c = sum(mask)
    s = len(mask) - c
    return len(mask) / (c + s * (fn + bn) / num_layers) if mask else 1.0


__all__ = ["run_line", "CachePatch", "apply_cache", "remove_cache", "CacheConfig", "CacheConfigError", "ResolvedCache", "DBCacheRunner", "TaylorSeer", "from_env",
           "resolve_config", "run_config", "config_from_dict", "measured_speedup", "estimated_speedup",
           "preset_mask", "mask_note", "mask_str", "parse_mask", "longest_cached_run", "PRESETS", "ALIASES",
           "ALL_PRESETS", "USER_PRESETS", "DEFAULTS", "FROM_PRESET", "MEASURED_PATH", "PRESET_KNOBS"]


def run_line(stats) -> str:
    """One log line for a run (``engine.last_run``): what the cache did and the measured speedup."""
    cache = getattr(stats, "cache", None) or {}
    if not cache:
        return f"Cache-DiT off: {stats.calls_computed}/{stats.model_calls} model calls computed"
    name = cache.get("preset") or "DBCache"
    sp = stats.speedup
    line = (f"Cache-DiT {name}: {cache['computed']}/{cache['calls']} model calls computed ({cache['cached']} cached), "
            f"measured {sp:.2f}x" if sp is not None else
            f"Cache-DiT {name}: {cache['computed']}/{cache['calls']} model calls computed ({cache['cached']} cached)")
    line += f", mask {cache['mask']}"
    if cache.get("note"):
        line += f" ({cache['note']})"
    return line
