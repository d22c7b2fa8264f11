"""The "cache" Patch: a Cache-DiT runner in the model's ``block_runner`` slot for one sampling run, attached and
removed through the patch registry (engine/features/patching.py) like every other feature."""
from __future__ import annotations

from torch import nn

from .. import patching

FEATURE = "cache"


class CachePatch(patching.Patch):
    """The runner (a ``DBCacheRunner``, or the parallel ranks' variant) in the slot, the runner before kept."""

    name = FEATURE

    def __init__(self, model: nn.Module, runner):
        super().__init__(model)
        self.runner = runner
        self.previous = patching.set_slot(model, "block_runner", runner)

    def remove(self) -> None:
        model = self.model
        if model is not None:
            patching.set_slot(model, "block_runner", self.previous)

    def describe(self) -> dict:
        return {"runner": type(self.runner).__name__, "calls_so_far": len(getattr(self.runner, "computed", []))}


def apply_cache(model: nn.Module, runner) -> CachePatch:
    """Run the model's blocks through ``runner`` until ``remove_cache``; a runner left by a run that never
    finished (an exception before its end) is replaced."""
    patching.detach(model, FEATURE)
    return patching.attach(model, CachePatch(model, runner))


def remove_cache(model: nn.Module) -> bool:
    """The model's own block runner back. False when no cache runner was attached."""
    return patching.detach(model, FEATURE)
