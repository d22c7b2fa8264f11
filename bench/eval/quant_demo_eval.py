"""FP8 / INT4 weights end to end on the embedded demo model: PSNR of the images against the
unquantized model (same captions, same seeds) and the judge's pass rate, on held-out pairs.

    .venv/bin/python bench/eval/quant_demo_eval.py [--n 60] [--steps 30] [--formats fp8 int4 int4-g64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.metrics import psnr  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.features import quant as Q  # noqa: E402
from engine.models.demo import DEFAULT_CFG, DEFAULT_SAMPLER, DEFAULT_STEPS, load_demo  # noqa: E402
from tools.demo import data, judge  # noqa: E402


def run(demo, engine, pairs, steps, cfg, batch):
    uncond = demo.encode([""])
    imgs = []
    for b in range(0, len(pairs), batch):
        chunk = pairs[b: b + batch]
        cond = demo.encode([c for _, c in chunk])
        lat = engine.sample(demo.empty_latent(len(chunk)), cond, uncond * len(chunk), seed=chunk[0][0], steps=steps,
                            cfg=cfg, sampler=DEFAULT_SAMPLER)
        imgs.append(demo.decode(lat))
    return np.concatenate(imgs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG)
    ap.add_argument("--batch", type=int, default=30)
    ap.add_argument("--formats", nargs="+", default=["fp8", "int4", "int4-g64"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = []
    for i in range(args.n):
        seed = data.HELD_OUT_SEED_START + i
        _, cap = data.sample(seed, num_objects=1 if i < args.n // 2 else 2)
        pairs.append((seed, cap))
    rows = []
    ref_imgs = None
    for fmt in [None] + list(args.formats):
        demo = load_demo(cached=False)
        eng = Engine(demo.dit, EngineConfig(quant=fmt))
        demo.engine = eng
        t0 = time.perf_counter()
        imgs = run(demo, eng, pairs, args.steps, args.cfg, args.batch)
        secs = time.perf_counter() - t0
        passes = np.mean([judge.judge(im, cap)["pass"] for im, (_, cap) in zip(imgs, pairs)])
        if ref_imgs is None:
            ref_imgs = imgs
            ref_bytes = Q.weight_bytes(demo.dit)
        ps = [psnr(a, b, 255) for a, b in zip(imgs, ref_imgs)]
        finite = [p for p in ps if np.isfinite(p)]
        rows.append(f"| {fmt or 'float32 (reference)'} | {Q.weight_bytes(demo.dit) / ref_bytes:.3f} | "
                    f"{'–' if fmt is None else (f'{np.mean(finite):.1f}' if finite else 'inf')} | "
                    f"{'–' if fmt is None else f'{np.min(ps):.1f}'} | {100 * passes:.1f} | {secs:.0f} |")
        print(rows[-1], flush=True)
    print(f"\nDemo model, {args.n} held-out caption/seed pairs (half one object, half two), {args.steps} steps, "
          f"cfg {args.cfg}, {DEFAULT_SAMPLER}; PSNR of the 64x64 images against the float32 model's images.\n")
    print("| weights | weight bytes vs float32 | PSNR dB (mean) | PSNR dB (min) | judge pass % | seconds |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
