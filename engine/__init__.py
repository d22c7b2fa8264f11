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
from .loading import load_model
from .pipeline import ErnieImagePipeline, ErnieImagePipelineOutput
from .router import DEMO, open_demo, open_engine
from .sampling_options import SampleRequest, SamplingOptions

__all__ = ["CacheConfigError", "CheckpointError", "DEMO", "Engine", "EngineConfig", "ErnieImagePipeline",
           "ErnieImagePipelineOutput", "InputError", "LoRAError",
           "ModelOutputError", "ParallelConfigError", "ParallelWorkerError", "RunStats", "SampleRequest", "SamplingOptions", "load_model", "open_demo",
           "open_engine", "accelerate", "restore"]
