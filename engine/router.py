"""open_engine: the one way to open an engine, for every entry point (CLI, nodes, server, benchmarks).

It reads the checkpoint's header once, decides layer-wise offload before loading (an offloaded model
is loaded into CPU memory, never whole onto the GPU), quantizes while reading, and starts worker
ranks when the parallel degrees ask for more than one. The embedded demo model is a file like any
other (``DEMO_WEIGHTS``), so it takes the same path, several ranks included.
"""
from __future__ import annotations

import os
from typing import Optional

from .config import EngineConfig
from .engine import Engine
from .local import open_local
from .models import demo as demo_model
from .parallel import open_remote_forward

DEMO = "demo"  # open_engine("demo"): the embedded demo model's DiT


def open_engine(source, config: Optional[EngineConfig] = None) -> Engine:
    """An Engine for ``source``: an ERNIE-Image .safetensors file or diffusers folder, or ``"demo"``."""
    config = config or EngineConfig()
    path = demo_model.DEMO_WEIGHTS if source == DEMO else os.fspath(source)
    if config.world_size > 1:  # several ranks: the DiT runs in worker processes (engine/parallel)
        return Engine(open_remote_forward(path, config), config, source=path)
    return Engine(open_local(path, config), config, source=path)


def open_demo(path: Optional[str] = None, cached: bool = True) -> demo_model.DemoModel:
    """The demo model's parts (text encoder, codec, DiT; the shipped weights unless ``path``; cached per process
    unless ``cached=False``) with ``demo.engine``, an Engine on its DiT with the default options. For other
    options open ``open_engine(DEMO, config)``."""
    demo = demo_model.load_demo(path, cached=cached)
    if demo.engine is None:
        demo.engine = Engine(demo.dit, EngineConfig(), source=demo.path)
    return demo
