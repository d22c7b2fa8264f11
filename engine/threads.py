"""CPU threads for a sampling run: one rule for every entry point (``sgld generate`` / ``serve``, the ComfyUI nodes,
``ErnieImagePipeline``). A bundled model's DiT (engine/models/bundle.py: its shapes, any file format) runs on its own
thread count on a CPU; any other model on torch's own default (one per core); ``--threads`` / ``Engine.threads``
overrides (docs/python.md)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .models.bundle import bundle_of_config


def default_threads(model_config, device) -> Optional[int]:
    """The rule: a bundled model's thread count for a DiT of its shapes on a CPU; None (torch's choice) otherwise."""
    bundle = bundle_of_config(model_config) if torch.device(device).type == "cpu" else None
    return bundle.threads if bundle is not None else None


@contextlib.contextmanager
def torch_threads(count: Optional[int]):
    """Run the block on ``count`` CPU threads and restore the caller's afterwards (None: leave them)."""
    if not count:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
