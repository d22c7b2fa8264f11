"""open_engine: the one way to open an engine, for every entry point (CLI, nodes, server, benchmarks,
the parallel ranks and the torchrun launch).

For a file it reads the checkpoint's header once, decides layer-wise offload before loading (an
offloaded model is loaded into CPU memory, never whole onto the GPU), quantizes while reading, and
starts worker ranks when the parallel degrees ask for more than one (or uses the ranks a ``transport``
reaches: torchrun). The embedded demo model is a file like any other (its name stands for its file), so it
takes the same path, several ranks included. A model already in memory gets its features attached here too.
"""
from __future__ import annotations

import os
from typing import Optional

from torch import nn

from .compute_dtype import with_compute_dtype
from .config import EngineConfig
from .engine import Engine
from .errors import ParallelConfigError
from .io.checkpoint import open_checkpoint
from .local import LocalRunner, open_local
from .models.bundle import named_file
from .parallel import open_ranked_runner


def open_engine(source, config: Optional[EngineConfig] = None, *, label: Optional[str] = None,
                offload_decision: Optional[tuple] = None, transport=None) -> Engine:
    """An Engine for ``source``: an ERNIE-Image .safetensors file or diffusers folder, ``"demo"``, or an
    ERNIE-Image model already in memory (an ``nn.Module``: ``config``'s features are attached to it in this
    process; ``label`` names it, ``offload_decision`` is ("none" | "layerwise", why) when the caller decided
    before building it). ``transport``: ranks that already run (torchrun: ``parallel.ranked.LocalTransport``)."""
    config = config or EngineConfig()
    if isinstance(source, nn.Module):
        if config.world_size > 1 or transport is not None:
            raise ParallelConfigError(f"a model in memory runs in this process; {config.world_size} ranks load their "
                                      "weights from a file: open the engine on its checkpoint path")
        return Engine(LocalRunner(source, config, offload_decision=offload_decision), config, source=label or "")
    path = os.fspath(named_file(source))  # "demo", "demo-turbo": the embedded files (engine/models/bundle.py)
    if config.world_size > 1 or transport is not None:  # several ranks: the DiT runs on them (engine/parallel)
        config, why = with_compute_dtype(config, open_checkpoint(path).family)  # the ranks load in the same dtype
        engine = Engine(open_ranked_runner(path, config, transport), config, source=label or path)
    else:
        runner = open_local(path, config)  # the compute dtype decided from the header it reads
        engine, why = Engine(runner, runner.config, source=label or path), runner.dtype_reason
    engine.dtype_reason = why
    return engine
