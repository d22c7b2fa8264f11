"""What the commands share: the engine's and the cache's flags (derived from EngineConfig's and CacheConfig's
declarations, engine/options.py), the options they become, and the checks made before anything loads."""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from .. import options
from ..config import PARALLEL, EngineConfig
from ..features.cache import CacheConfig
from ..sampling_options import SamplingOptions

MAX_THREADS = 1024  # --threads: generous; more only oversubscribes the cores
TITLES = {PARALLEL: "parallel (docs/parallel.md): ranks = tp x ulysses x ring x (2 with --cfg-parallel)"}
CACHE_TITLE = "Cache-DiT (default: the SGLANG_CACHE_DIT_* environment)"
AT_LEAST_HINTS = {"num_gpus": "; leave it out for the product of the degrees"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig flag, and --threads."""
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    options.add_arguments(p, EngineConfig, TITLES)


def engine_config(args, **kw) -> EngineConfig:
    """The EngineConfig the flags say (``kw``: fields the command sets itself); errors name the flag."""
    return EngineConfig(**{**options.from_args(EngineConfig, args), **kw})


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    options.add_arguments(p.add_argument_group(CACHE_TITLE), CacheConfig)


def cache_config(args) -> Optional[CacheConfig]:
    """None when no --cache* flag was given (the environment decides); ``--cache off``: no cache; any other
    flag switches it on with what the flags set."""
    given = options.from_args(CacheConfig, args)
    if not given:
        return None
    if given.pop("enabled", True) is False:
        return CacheConfig(enabled=False)
    return CacheConfig(enabled=True, **given)


def add_sampling_arguments(p: argparse.ArgumentParser, names) -> None:
    """The flags of the sampling options ``names`` (SamplingOptions' declarations; steps / cfg unset: the model's,
    read back with ``sampling_options.from_flags``)."""
    options.add_arguments(p, SamplingOptions, names=names)


def check_output_path(option: str, path: str, extensions: tuple) -> None:
    """Refuse an output path that cannot be written, before any work (a folder, a missing or read-only
    parent, a parent that is a file, a name without one of ``extensions``)."""
    if os.path.isdir(path):
        raise ValueError(f"{option} '{path}' is a folder; give a file name ending in {' or '.join(extensions)}")
    if not path.lower().endswith(extensions):
        raise ValueError(f"{option} '{path}' must end in {' or '.join(extensions)} (the format this command writes)")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):  # folders that do not exist yet are created
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{option} '{path}': '{existing}' is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} '{path}': the folder '{existing}' is not writable")


def check_common_args(args) -> None:
    """The options every command shares, checked before anything loads: --device names a device this machine
    has, --threads is 0 (torch's choice) or a count, the engine's counts (degrees, --resident-layers) are
    at least their declared minimum."""
    for name, opt in options.declared(EngineConfig).items():
        value = getattr(args, options.flag_dest(opt), None) if opt.flag else None
        if opt.kind is int and opt.low is not None and value is not None and value < opt.low:
            raise ValueError(f"{opt.flag} must be at least {opt.low} (got {value}{AT_LEAST_HINTS.get(name, '')})")
    threads = getattr(args, "threads", 0)
    if threads < 0 or threads > MAX_THREADS:
        raise ValueError(f"--threads must be 0 (torch's choice) or a count from 1 to {MAX_THREADS} (got {threads})")
    device = getattr(args, "device", "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device '{device}' is not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is available here (use --device cpu)")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"--device {device}: no '{dev.type}' device is available here (use cpu or cuda)")
