"""Our DiT forward vs diffusers' ErnieImageTransformer2DModel on the same weights and inputs.

Runs both in one process, interleaved (ours fused, ours in the release layout, theirs, ...),
single-threaded, and measures the process's CPU time (not wall time), so other work on a shared
machine hardly moves the figures; reports the minimum over repeats, the ratios and the parity error.
"fused" is what an Engine runs (q/k/v and gate/up as one GEMM each, engine/features/fuse.py); "release" is
the model as loaded, with the checkpoint's separate projections.

    .venv/bin/python bench/speed/forward_bench.py [--sizes small medium] [--dtypes fp32 bf16] [--tokens 1024]
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from diffusers import ErnieImageTransformer2DModel  # noqa: E402

from bench.metrics import max_rel_err  # noqa: E402
from engine.features.fuse import fuse_projections  # noqa: E402
from engine.models.random_weights import SIZES, random_model, random_state_dict  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def diffusers_model(cfg, sd, dtype):
    m = ErnieImageTransformer2DModel(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
        ffn_hidden_size=cfg.ffn_hidden_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
        text_in_dim=cfg.text_in_dim, rope_axes_dim=tuple(cfg.rope_axes_dim))
    m.load_state_dict(sd)
    return m.to(dtype).eval().requires_grad_(False)


def run(size, dtype_name, tokens, text_tokens, repeat):
    cfg, dtype = SIZES[size], DTYPES[dtype_name]
    side = int(tokens ** 0.5)
    fused = random_model(cfg, seed=0, dtype=dtype)
    fuse_projections(fused)
    release = random_model(cfg, seed=0, dtype=dtype)
    ref = diffusers_model(cfg, random_state_dict(cfg, seed=0), dtype)
    g = torch.Generator().manual_seed(0)
    b = 2  # a CFG-style batch: two prompts of different lengths
    x = torch.randn(b, cfg.in_channels, side, side, generator=g).to(dtype)
    t = torch.tensor([700.0, 700.0])
    text = torch.randn(b, text_tokens, cfg.text_in_dim, generator=g).to(dtype)
    lens = torch.tensor([text_tokens, text_tokens // 3])
    runs = {"fused": lambda: fused(x, t, text, lens), "release": lambda: release(x, t, text, lens),
            "diffusers": lambda: ref(x, t, text, lens, return_dict=False)[0]}
    timings = {k: [] for k in runs}
    with torch.no_grad():
        r = runs["diffusers"]().float()
        err = max_rel_err(runs["fused"](), r)
        for _ in range(repeat):
            for name, fn in runs.items():
                # CPU time of this (single-threaded) process: robust to other processes on a shared machine
                s = time.process_time()
                fn()
                timings[name].append(time.process_time() - s)
    # min over interleaved repeats: the least disturbed run of each (noise only ever adds time)
    mf, mr, md = (min(timings[k]) for k in ("fused", "release", "diffusers"))
    params = sum(p.numel() for p in fused.parameters())
    return (f"| {size} ({params / 1e6:.0f}M) | {dtype_name} | {b}×{side * side}+{text_tokens} | {1000 * mf:.0f} | "
            f"{1000 * mr:.0f} | {1000 * md:.0f} | **{mf / md:.2f}** | {mr / md:.2f} | {err:.1e} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=["small", "medium"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--tokens", type=int, default=1024, help="image tokens (a square latent)")
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="1 keeps timings robust on a shared machine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d')} · {platform.processor() or platform.machine()} · {args.threads} threads · torch {torch.__version__}")
    print("| model | dtype | batch × tokens | fused CPU ms | release layout CPU ms | diffusers CPU ms | fused / diffusers "
          "| release / diffusers | max err / max ref (fused) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for dt in args.dtypes:
            print(run(size, dt, args.tokens, args.text_tokens, args.repeat), flush=True)


if __name__ == "__main__":
    main()
