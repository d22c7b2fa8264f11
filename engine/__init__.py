"""SGLDiffusion engine: ERNIE-Image DiT inference without ComfyUI.

Public API: ``load_model``, ``Engine``, ``EngineConfig``. Importable as the top-level package
``engine`` (from the repository root) and as a subpackage of the ComfyUI pack.
"""
from .config import EngineConfig
from .errors import CheckpointError
from .features.quant import load_model
from .engine import Engine, InputError, RunStats

__all__ = ["CheckpointError", "Engine", "EngineConfig", "InputError", "RunStats", "load_model"]
