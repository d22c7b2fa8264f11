"""Typed engine options. Every feature is switched on here; nodes and the CLI only pass options."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .cache import CacheConfig


@dataclass
class EngineConfig:
    dtype: Optional[str] = None  # "bf16" | "fp16" | "fp32" | None (as stored)
    device: str = "cpu"
    # Cache-DiT (engine.cache.CacheConfig); None = the SGLANG_CACHE_DIT_* environment decides per run.
    cache: Optional["CacheConfig"] = None

    def key(self) -> tuple:
        """A hashable identity, used to cache loaded engines per (file, options)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))
