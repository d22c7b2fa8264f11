"""Typed engine options. Every feature is switched on here; nodes and the CLI only pass options."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class EngineConfig:
    dtype: Optional[str] = None  # "bf16" | "fp16" | "fp32" | None (as stored)
    device: str = "cpu"

    def key(self) -> tuple:
        """A hashable identity, used to cache loaded engines per (file, options)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))
