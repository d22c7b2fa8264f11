"""What the commands share: the engine's and the cache's flags (derived from EngineConfig's and CacheConfig's
declarations, engine/options.py), the options they become, and the checks made before anything loads."""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from .. import device as device_rt
from .. import options
from ..config import PARALLEL, EngineConfig
from ..errors import CheckpointError
from ..features.cache import CacheConfig
from ..models import families
from ..models.external import PLACEMENTS
from ..models.prompt_enhancer import MAX_NEW_TOKENS_CAP
from ..release import dit_family
from ..sampling import MAX_IMAGE_SIDE
from ..sampling_options import SamplingOptions

MAX_THREADS = 1024  # --threads: generous; more only oversubscribes the cores
TITLES = {PARALLEL: "parallel (docs/parallel.md): ranks = tp x ulysses x ring x (2 with --cfg-parallel)"}
CACHE_TITLE = "Cache-DiT (default: the SGLANG_CACHE_DIT_* environment)"
AT_LEAST_HINTS = {"num_gpus": "; leave it out for the product of the degrees"}



def file_families() -> str:
    """"ERNIE-Image or Z-Image": the families whose text encoder and VAE sgld loads (``Family.companions``)."""
    return " or ".join(f.title for f in families() if f.companions)

def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig flag, and --threads."""
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default 0: the model's: 1 for the demo model, whose matrices are too "
                        "small to share; torch's choice, one per core, for any other model)")
    options.add_arguments(p, EngineConfig, TITLES)


def use_threads(engine, args) -> None:
    """The CPU threads the command runs on, set for the whole process (the server's batcher takes them from it):
    --threads, else the engine's rule (engine/threads.py: 1 for the demo's shapes, torch's choice otherwise)."""
    if getattr(args, "threads", 0):
        engine.threads = args.threads
    if engine.threads:
        torch.set_num_threads(engine.threads)


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


def check_image_sides(args) -> None:
    """--width / --height (None: the command's default) from 1 to MAX_IMAGE_SIDE pixels, before anything loads;
    the multiple of the model's latent stride is checked where its family is known (inputs.empty_latent_shape)."""
    for name in ("width", "height"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_IMAGE_SIDE:
            raise ValueError(f"--{name} must be from 1 to {MAX_IMAGE_SIDE} pixels (got {value}; ERNIE-Image's "
                             "largest documented size is 2048x2048)")


def check_common_args(args, devices_here: bool = True) -> None:
    """The options every command shares, checked before anything loads: --device names a device this machine
    has (``devices_here``; under `sgld serve --ray` the replicas' nodes check it), --threads is 0 (the model's
    choice) or a count, the engine's counts (degrees, --resident-layers) are at least their declared minimum."""
    for name, opt in options.declared(EngineConfig).items():
        value = getattr(args, options.flag_dest(opt), None) if opt.flag else None
        if opt.kind is int and opt.low is not None and value is not None and value < opt.low:
            raise ValueError(f"{opt.flag} must be at least {opt.low} (got {value}{AT_LEAST_HINTS.get(name, '')})")
    threads = getattr(args, "threads", 0)
    if threads < 0 or threads > MAX_THREADS:
        raise ValueError(f"--threads must be 0 (the model's default) or a count from 1 to {MAX_THREADS} (got {threads})")
    device = getattr(args, "device", "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device '{device}' is not a torch device (cpu, cuda, cuda:N)") from None
    if not devices_here:
        return
    if dev.type == "cuda":
        count = device_rt.device_count()
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is available here (use --device cpu)")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"--device {device}: no '{dev.type}' device is available here (use cpu or cuda)")


MIX_PARALLEL_HELP = ("accepted for SGLang's spelling; nothing to switch on here: --tp with --sp (--ulysses-degree) "
                     "already mixes tensor and sequence parallelism (ranks = tp x sp x ring)")


def add_release_arguments(group) -> None:
    """SGLang's spellings shared by generate and serve: --model-path (engine/release.py resolves it) and
    --enable-mix-parallel (accepted; the degrees already mix)."""
    group.add_argument("--model-path", default=None,
                       help="an ERNIE-Image release folder (diffusers' layout) or a Hugging Face repo id found in the "
                            "local Hugging Face cache (never downloaded), or 'demo' / 'demo-turbo': its transformer/, text_encoder/, "
                            "vae/ (and pe/ for --pe) are found there; --text-encoder / --vae replace single parts")
    group.add_argument("--enable-mix-parallel", action="store_true", help=MIX_PARALLEL_HELP)


def add_text_encoder_arguments(group, folder_help: str) -> None:
    """--text-encoder and where it computes, for generate and serve."""
    group.add_argument("--text-encoder", help=folder_help)
    group.add_argument("--text-encoder-device", default="auto", choices=PLACEMENTS,
                       help="where the text encoder computes: auto (on --device, in bf16 on a GPU; its weights wait in "
                            "host memory while the DiT samples), cpu (on the CPU, in its dtype), resident (stays on "
                            "--device)")


def add_pe_arguments(p) -> None:
    """The prompt enhancer's flags (engine/models/prompt_enhancer.py)."""
    g = p.add_argument_group("prompt enhancer (ERNIE-Image's PE; costs seconds per prompt)")
    g.add_argument("--pe", nargs="?", const="", default=None, metavar="PATH",
                   help="rewrite the prompt with the PE first: PATH is its folder (the release's pe/) or a "
                        ".safetensors file with its config.json beside it; no PATH: the --model-path release's pe/. "
                        "Sampled as the release's generation_config.json says, seeded by the image's seed")
    g.add_argument("--pe-tokenizer", default=None,
                   help="the PE's tokenizer folder (default: the release's pe_tokenizer/ beside pe/, else PATH itself)")
    g.add_argument("--pe-device", default=None, help="torch device of the PE (default: --device)")
    g.add_argument("--pe-dtype", default=None, choices=("fp32", "bf16", "fp16"), help="dtype of the PE (default: bf16 where the device computes it natively, else fp32; as the text encoder)")
    g.add_argument("--pe-max-new-tokens", type=int, default=None,
                   help="most tokens the PE writes (default: its tokenizer's model_max_length, as diffusers; "
                        "at most 8192)")


def check_pe_args(args) -> None:
    """The PE's flags, before anything loads."""

    limit = getattr(args, "pe_max_new_tokens", None)
    if limit is not None and not 1 <= limit <= MAX_NEW_TOKENS_CAP:
        raise ValueError(f"--pe-max-new-tokens must be from 1 to {MAX_NEW_TOKENS_CAP} (got {limit})")
    if getattr(args, "pe", None) is None and any(getattr(args, n, None) is not None for n in
                                                 ("pe_tokenizer", "pe_device", "pe_dtype", "pe_max_new_tokens")):
        raise ValueError("--pe-tokenizer, --pe-device, --pe-dtype and --pe-max-new-tokens set up the prompt "
                         "enhancer: give --pe [PATH] too")


def load_prompt_enhancer(args, dit: str, release=None):
    """The PE the flags name (None without --pe), of the kind the family of ``dit`` (the DiT's file or folder) names:
    --pe PATH, else the release's pe/ (CheckpointError naming what is missing; ValueError for a family whose release
    ships none)."""
    if getattr(args, "pe", None) is None:
        return None
    family = dit_family(dit, companions=False)
    enhancer = family.companions.prompt_enhancer if family.companions is not None else None
    if enhancer is None:
        raise ValueError(f"--pe: a {family.title} model has no prompt enhancer (its release ships none); run without "
                         "--pe, with the prompt written out")
    path, tokenizer = args.pe, args.pe_tokenizer
    if not path:
        if release is None or release.pe is None:
            where = f"the release '{release.source}' has no pe/ folder" if release is not None else "no --model-path"
            raise CheckpointError(f"--pe without a PATH uses the --model-path release's pe/, but {where}; give "
                                  "--pe PATH (the PE folder, or ernie-image-prompt-enhancer.safetensors with its config)")
        path, tokenizer = release.pe, tokenizer or release.pe_tokenizer
    return enhancer.from_pretrained(path, tokenizer=tokenizer, device=args.pe_device or args.device,
                                    dtype=args.pe_dtype)
