"""Typed engine options. Every feature is switched on here; nodes and the CLI only pass options."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from .features.cache import CacheConfig


@dataclass
class EngineConfig:
    dtype: Optional[str] = None  # "bf16" | "fp16" | "fp32" | None (as stored)
    device: str = "cpu"
    # Cache-DiT (engine.cache.CacheConfig); None = the SGLANG_CACHE_DIT_* environment decides per run.
    cache: Optional["CacheConfig"] = None
    # Attention backend (engine/features/attention.py): "auto" = sage, then flash, then sdpa (what can run here).
    attention: str = "auto"
    # Regional torch.compile of the repeated block (engine/features/compile.py): False | True (= "static") |
    # "static" (one graph per resolution) | "dynamic" (one extra, dynamic-shape graph for all new resolutions).
    compile: Union[bool, str] = False
    # Weight-only quantization of the blocks' linear layers (engine/features/quant/): None | "fp8" | "int4" (groups of
    # 128) | "int4-g64". Pre-quantized files (sgld quantize, ComfyUI fp8) load quantized whatever this says.
    quant: Optional[str] = None
    # Layer-wise offload (engine/features/offload): "none" | "layerwise" (block weights in pinned CPU memory, streamed
    # through ``resident_layers`` device buffers) | "auto" (layer-wise when the GPU's free memory is below the
    # model plus working memory).
    offload: str = "none"
    resident_layers: int = 2
    # Parallelism (engine/parallel, docs/parallel.md): ranks = tp x ulysses_degree x ring_degree x (2 if cfg_parallel).
    # More than one rank runs the DiT in worker processes (one per GPU; gloo processes on CPU). num_gpus: None =
    # the product of the degrees; a count with all degrees 1 = Ulysses over that many ranks.
    tp: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel: bool = False
    num_gpus: Optional[int] = None

    ATTENTION_CHOICES = ("auto", "sdpa", "sage", "flash", "math")
    COMPILE_CHOICES = (False, True, "static", "dynamic")
    QUANT_CHOICES = (None, "fp8", "int4", "int4-g64")
    OFFLOAD_CHOICES = ("none", "layerwise", "auto")

    def __post_init__(self):
        if not isinstance(self.attention, str) or self.attention.lower() not in self.ATTENTION_CHOICES:
            raise ValueError(f"EngineConfig.attention '{self.attention}' is not supported; "
                             f"choose one of {', '.join(self.ATTENTION_CHOICES)}")
        self.attention = self.attention.lower()
        if isinstance(self.compile, str) and self.compile.lower() in ("off", "false", "none", ""):
            self.compile = False
        if isinstance(self.compile, str) and self.compile.lower() in ("on", "true"):
            self.compile = True
        if isinstance(self.compile, str):
            self.compile = self.compile.lower()
        if not any(self.compile is c or (isinstance(c, str) and self.compile == c) for c in self.COMPILE_CHOICES):
            raise ValueError(f"EngineConfig.compile '{self.compile}' is not supported; "
                             "choose one of False, True, 'static', 'dynamic'")
        if isinstance(self.quant, str) and self.quant.lower() in ("none", "off", ""):
            self.quant = None
        if self.quant is not None and (not isinstance(self.quant, str) or self.quant.lower() not in self.QUANT_CHOICES[1:]):
            raise ValueError(f"EngineConfig.quant '{self.quant}' is not supported; choose one of None, fp8, int4, int4-g64")
        if self.quant is not None:
            self.quant = self.quant.lower()
        if self.offload is None or self.offload is False or (isinstance(self.offload, str) and self.offload.lower() in ("off", "")):
            self.offload = "none"
        if not isinstance(self.offload, str) or self.offload.lower() not in self.OFFLOAD_CHOICES:
            raise ValueError(f"EngineConfig.offload '{self.offload}' is not supported; "
                             f"choose one of {', '.join(self.OFFLOAD_CHOICES)}")
        self.offload = self.offload.lower()
        if isinstance(self.resident_layers, bool) or not isinstance(self.resident_layers, int) or self.resident_layers < 1:
            raise ValueError(f"EngineConfig.resident_layers '{self.resident_layers}' is not supported; "
                             "choose an integer >= 1 (device buffers for layer-wise offload, default 2)")
        from .parallel.plan import make_plan  # degrees: integers that multiply to num_gpus (ParallelConfigError

        make_plan(self.tp, self.ulysses_degree, self.ring_degree, self.cfg_parallel, self.num_gpus)

    @property
    def world_size(self) -> int:
        """Ranks the parallel fields ask for (1 = the single-process engine)."""
        from .parallel.plan import make_plan

        return make_plan(self.tp, self.ulysses_degree, self.ring_degree, self.cfg_parallel, self.num_gpus).world_size

    def key(self) -> tuple:
        """A hashable identity, used to cache loaded engines per (file, options)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))
