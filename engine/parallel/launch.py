"""Several machines: ``torchrun`` launch of one sampling run (every rank runs the loop in lockstep).

One process per GPU on every machine, all started by torchrun, which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the degrees must multiply to the world size::

    # on each of 2 machines (node-rank 0 and 1), 8 GPUs each: Ulysses 8 inside a machine, Ring 2 across
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 \\
        -m engine.parallel.launch --model /models/ernie-image.safetensors --ulysses-degree 8 --ring-degree 2 \\
        --text prompt.safetensors --width 2048 --height 2048 --steps 50 --cfg 4 --out latent.safetensors

``--text``: a safetensors file with ``cond`` [T, 3072] (and ``uncond``) text features, e.g. saved from
ComfyUI's CONDITIONING; ``--random-text N`` uses random features (benchmarks). Rank 0 writes the
denoised latent ([1, 128, H/16, W/16], ComfyUI's Flux2 latent format) and prints one JSON line.
With ``--device cpu`` the ranks are gloo processes (for trying the launch without GPUs).
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

from ..config import EngineConfig
from ..errors import ParallelConfigError
from ..features.cache import CacheConfig
from ..io.checkpoint import check_architecture, open_checkpoint
from ..models.random_weights import random_checkpoint
from .plan import check_model, make_plan
from ..router import open_engine
from .ranked import LocalTransport
from .worker import WorkerState


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.parallel.launch", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="ERNIE-Image .safetensors file or diffusers folder (readable on every machine)")
    src.add_argument("--size", help="random model of a named size (tiny, small, medium, 8b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--attention", default="auto")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ulysses-degree", type=int, default=1)
    p.add_argument("--ring-degree", type=int, default=1)
    p.add_argument("--cfg-parallel", action="store_true")
    txt = p.add_mutually_exclusive_group(required=True)
    txt.add_argument("--text", help="safetensors file with 'cond' (and 'uncond') text features [T, C]")
    txt.add_argument("--random-text", type=int, help="random text features of this many tokens")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", default="euler")
    p.add_argument("--scheduler", default="simple")
    p.add_argument("--cache", default=None, help="Cache-DiT preset (quality, balanced, fast, ...)")
    p.add_argument("--out", default=None, help="safetensors file for the latent (rank 0)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    path = args.model or random_checkpoint(args.size, args.dtype)
    plan = make_plan(args.tp, args.ulysses_degree, args.ring_degree, args.cfg_parallel)
    ckpt = open_checkpoint(path)
    mcfg = check_architecture(ckpt)
    if plan.world_size != world:
        raise ParallelConfigError(f"{plan.describe()} needs {plan.world_size} processes but torchrun started {world} "
                                  "(WORLD_SIZE); make --nnodes x --nproc-per-node equal the product of the degrees")
    check_model(plan, mcfg.num_attention_heads, mcfg.ffn_hidden_size)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    torch.distributed.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=30))
    config = EngineConfig(dtype=args.dtype, device=device, attention=args.attention, tp=args.tp,
                          ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree, cfg_parallel=args.cfg_parallel)
    state = WorkerState(rank, world, device)
    state.return_all = True
    eng = open_engine(path, config, transport=LocalTransport(state))
    if args.text:
        feats = load_file(args.text)
        cond, uncond = [feats["cond"]], ([feats["uncond"]] if "uncond" in feats else None)
    else:
        g = torch.Generator().manual_seed(args.seed)
        cond = [torch.randn(args.random_text, mcfg.text_in_dim, generator=g)]
        uncond = [torch.randn(max(1, args.random_text // 2), mcfg.text_in_dim, generator=g)]
    if args.cfg == 1.0:
        uncond = None
    cache = CacheConfig(preset=args.cache) if args.cache else None
    latent = torch.zeros(1, mcfg.in_channels, args.height // 16, args.width // 16)
    t0 = time.perf_counter()
    out = eng.sample(latent, cond, uncond, seed=args.seed, steps=args.steps, cfg=args.cfg, sampler=args.sampler,
                     scheduler=args.scheduler, cache=cache)
    seconds = time.perf_counter() - t0
    if rank == 0:
        if args.out:
            save_file({"latent": out.contiguous()}, args.out)
        print(json.dumps({"parallel": plan.describe(), "backend": backend, "latent": list(out.shape),
                          "steps": args.steps, "sampling_seconds": round(seconds, 3), **eng.last_run.to_dict()}))
    state.cmd_unload()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
