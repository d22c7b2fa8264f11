"""Several machines: ``torchrun`` launch of one sampling run (every rank runs the loop in lockstep).

One process per GPU on every machine, all started by torchrun, which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the degrees must multiply to the world size::

    # on each of 2 machines (node-rank 0 and 1), 8 GPUs each: Ulysses 8 inside a machine, Ring 2 across
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 \\
        -m engine.parallel.launch --model /models/ernie-image.safetensors --ulysses-degree 8 --ring-degree 2 \\
        --text prompt.safetensors --width 2048 --height 2048 --steps 50 --cfg 4 --out latent.safetensors

``--text``: a safetensors file with ``cond`` [T, C] (and ``uncond``) text features (ERNIE-Image: C = 3072), e.g.
saved from ComfyUI's CONDITIONING; ``--random-text N`` uses random features (benchmarks). Rank 0 writes the
denoised latent (the model family's: [1, channels, H/stride, W/stride]; ERNIE-Image's is ComfyUI's Flux2 latent,
[1, 128, H/16, W/16]) and prints one JSON line.
With ``--device cpu`` the ranks are gloo processes (for trying the launch without GPUs). The engine's
flags (--quant, --offload, --compile, --sp, ...) and the sampling flags are EngineConfig's and
SamplingOptions' declarations (engine/options.py), as in ``sgld generate``; --steps / --cfg default
to the model's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
from safetensors.torch import load_file, save_file

from .. import device as device_rt
from .. import options
from ..config import PARALLEL, EngineConfig
from ..errors import ParallelConfigError
from ..features.cache import CacheConfig, resolve_config
from ..io.checkpoint import check_architecture, open_checkpoint
from ..models import family_of
from ..models.random_weights import random_checkpoint
from ..router import open_engine
from ..sampling import cfg_on
from ..sampling_options import SamplingOptions, from_flags
from .plan import check_model
from .ranked import LocalTransport, plan_from_config
from .worker import WorkerState

SAMPLING = ("seed", "steps", "cfg", "sampler", "scheduler", "shift")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.parallel.launch", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="DiT .safetensors file (ERNIE-Image ...) or diffusers folder (readable on every machine)")
    src.add_argument("--size", help="random model of a named size (tiny, small, medium, 8b)")
    options.add_arguments(p, EngineConfig, {PARALLEL: "parallel: the degrees multiply to torchrun's world size"})
    p.set_defaults(device="cuda" if device_rt.available() else "cpu")  # the ranks' device type (index: LOCAL_RANK)
    txt = p.add_mutually_exclusive_group(required=True)
    txt.add_argument("--text", help="safetensors file with 'cond' (and 'uncond') text features [T, C]")
    txt.add_argument("--random-text", type=int, help="random text features of this many tokens")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    options.add_arguments(p, SamplingOptions, names=SAMPLING)
    p.add_argument("--cache", default=None, help="Cache-DiT preset (quality, balanced, fast, ...)")
    p.add_argument("--out", default=None, help="safetensors file for the latent (rank 0)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    try:  # every flag checked before anything starts: one line naming the flag (exit 2)
        engine_options = options.from_args(EngineConfig, args)
        plan = plan_from_config(EngineConfig(**engine_options))
        run = from_flags(args, args.model or f"random:{args.size}", SAMPLING)  # a random model: Base's defaults
        cache = resolve_config(CacheConfig(preset=args.cache) if args.cache else None)  # the environment's: read here
    except ValueError as e:  # InputError, ParallelConfigError are ValueErrors
        parser.error(str(e))
    path = args.model or random_checkpoint(args.size, engine_options.get("dtype"))
    ckpt = open_checkpoint(path)
    mcfg = check_architecture(ckpt)
    if plan.world_size != world:
        raise ParallelConfigError(f"{plan.describe()} needs {plan.world_size} processes but torchrun started {world} "
                                  "(WORLD_SIZE); make --nnodes x --nproc-per-node equal the product of the degrees")
    check_model(plan, mcfg.num_attention_heads, mcfg.ffn_hidden_size)
    if engine_options["device"].startswith("cuda"):
        device_rt.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    torch.distributed.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=30))
    config = EngineConfig(**{**engine_options, "device": device})
    state = WorkerState(rank, world, device)
    state.return_all = True
    eng = open_engine(path, config, transport=LocalTransport(state))
    if args.text:
        feats = load_file(args.text)
        cond, uncond = [feats["cond"]], ([feats["uncond"]] if "uncond" in feats else None)
    else:
        g = torch.Generator().manual_seed(run["seed"])
        cond = [torch.randn(args.random_text, mcfg.text_in_dim, generator=g)]
        uncond = [torch.randn(max(1, args.random_text // 2), mcfg.text_in_dim, generator=g)]
    if not cfg_on(run["cfg"], uncond):
        uncond = None
    stride = family_of(mcfg).latent.stride
    latent = torch.zeros(1, mcfg.in_channels, args.height // stride, args.width // stride)
    t0 = time.perf_counter()
    out = eng.sample(latent, cond, uncond, cache=cache, **run)
    seconds = time.perf_counter() - t0
    if rank == 0:
        if args.out:
            save_file({"latent": out.contiguous()}, args.out)
        described = eng.describe()  # what the ranks run with (the engine flags reached them)
        print(json.dumps({"parallel": plan.describe(), "backend": backend, "latent": list(out.shape),
                          **{k: described.get(k) for k in ("quant", "offload", "compile")},
                          "steps": run["steps"], "cfg": run["cfg"], "sampling_seconds": round(seconds, 3), **eng.last_run.to_dict()}))
    state.cmd_unload()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
