"""SGLDiffusion engine: ERNIE-Image DiT inference without ComfyUI.

Public API: ``ErnieImagePipeline`` (prompt in, picture out, as diffusers' pipeline), ``open_engine`` (every engine: a file, a diffusers folder or the demo, on one device or
several ranks), ``accelerate`` / ``restore`` (a diffusers pipeline's
transformer on the engine), ``open_demo``, ``Engine``, ``EngineConfig``, ``load_model`` (the bare DiT) and the
error types. Importable as the top-level package ``engine`` (from the repository root) and as a
subpackage of the ComfyUI pack. Layout and rules: docs/architecture.md.
"""
from .accelerate import accelerate, restore
from .config import EngineConfig
from .engine import Engine, RunStats
from .errors import (
    CacheConfigError,
    CheckpointError,
    InputError,
    LoRAError,
    ModelOutputError,
    ParallelConfigError,
    ParallelWorkerError,
)
from .features.cache import from_env
from .loading import load_model
from .models import demo as _demo_model
from .pipeline import ErnieImagePipeline, ErnieImagePipelineOutput
from .router import open_engine
from .sampling_options import SampleRequest, SamplingOptions

DEMO = "demo"  # open_engine("demo"): the embedded demo model's DiT


def open_demo(path=None, cached: bool = True) -> "_demo_model.DemoModel":
    """The demo model's parts (text encoder, codec, DiT; the shipped weights unless ``path``; cached per process
    unless ``cached=False``) with ``demo.engine``, an Engine on its DiT with the default options and the
    SGLANG_CACHE_DIT_* environment's cache (read here, when the engine is opened: the demo's Python entry). For
    other options open ``open_engine(DEMO, config)``."""
    demo = _demo_model.load_demo(path, cached=cached)
    if demo.engine is None:
        demo.engine = open_engine(demo.dit, EngineConfig(cache=from_env()), label=demo.path)
    return demo


__all__ = ["CacheConfigError", "CheckpointError", "DEMO", "Engine", "EngineConfig", "ErnieImagePipeline",
           "ErnieImagePipelineOutput", "InputError", "LoRAError",
           "ModelOutputError", "ParallelConfigError", "ParallelWorkerError", "RunStats", "SampleRequest", "SamplingOptions", "load_model", "open_demo",
           "open_engine", "accelerate", "restore"]
