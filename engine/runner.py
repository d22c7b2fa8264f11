"""What ``Engine`` asks of where the DiT runs, declared once: ``LocalRunner`` (engine/local.py: the model in this
process) and ``RankedRunner`` (engine/parallel/ranked.py: worker ranks over gloo / NCCL) both follow ``Runner``, and
a run of either follows ``Run``. tests/test_engine.py checks that both provide every member."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple

import torch

from .config import EngineConfig


class Run(Protocol):
    """One sampling run's model calls (the run's Cache-DiT plan attached, if any)."""

    def call(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor,
             lens: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """(velocity in float32 on x's device, whether the DiT was computed at this call)."""

    def finish(self) -> Optional[dict]:
        """The run's cache summary (None when the cache is off); the model as it was before the run."""


class Runner(Protocol):
    config: EngineConfig
    model: Optional[torch.nn.Module]  # the DiT when it runs in this process, else None
    model_config: Any  # the family's configuration (engine/models/family.py)
    dtype: torch.dtype  # the compute dtype
    device: torch.device  # where the sampling loop's tensors live
    attention_backend: str
    warnings: List[str]  # what was asked but could not be done here
    notes: List[str]  # what was chosen at load and why
    lora_report: List[str]

    def describe(self) -> dict: ...

    def set_loras(self, loras) -> List[str]: ...

    def check_lora(self, path) -> List[str]: ...

    def active_loras(self) -> list: ...

    def release(self) -> int:
        """Free the weights (the bytes freed); the next call loads them again."""

    def make_room(self, x_shape, text_tokens: int) -> Optional[str]:
        """Before a call of this shape: move what does not fit (offload "auto"); what was done, or None."""

    def activation_room(self) -> Optional[int]:
        """The device bytes a call may use beside the weights now (None: no bound to keep)."""

    def run(self, plan, cfg_batched: bool) -> Run: ...

    def dit(self, x, timestep, text, lens) -> torch.Tensor:
        """One DiT forward, like ``model(x, timestep, text, lens)`` (no cache)."""


def members(protocol: type) -> List[str]:
    """The names a class following ``protocol`` must provide: its annotated attributes and its methods."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return sorted(names)
