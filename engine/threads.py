"""CPU threads for a sampling run: one rule for every entry point (``sgld generate`` / ``serve``, the ComfyUI nodes,
``ErnieImagePipeline``). The demo's DiT (its shapes, any file format) runs on the demo's thread count on a CPU; any
other model on torch's own default (one per core); ``--threads`` / ``Engine.threads`` overrides (docs/python.md)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .models import demo as demo_model


def default_threads(model_config, device) -> Optional[int]:
    """The rule: the demo's thread count for a DiT of the demo's shapes on a CPU; None (torch's choice) otherwise."""
    if torch.device(device).type == "cpu" and model_config is not None and demo_model.has_demo_shapes(model_config):
        return demo_model.THREADS
    return None


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
