"""Judge evaluation of the demo model on held-out caption/seed pairs; prints a markdown table.

    python bench/eval/demo_eval.py [--n 200] [--steps 30] [--cfg C] [--sampler euler] [--weights PATH]

Pairs come from data seeds HELD_OUT_SEED_START + i (training never draws seeds that high): half
one-object, half two-object scenes. Images are sampled through ``engine.Engine.sample`` in batches;
a batch's noise comes from the seed of its first pair (``--batch`` pairs per batch).
The generator's own images of the same captions are judged too (the judge's ceiling).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine import open_demo  # noqa: E402
from engine.models.demo import DEFAULT_CFG, DEFAULT_SAMPLER, DEFAULT_STEPS  # noqa: E402
from tools.demo import data, judge  # noqa: E402


def held_out(n: int, start: int = data.HELD_OUT_SEED_START):
    """n (seed, num_objects, image, caption): the first half one object, the second half two."""
    out = []
    for i in range(n):
        k = 1 if i < n // 2 else 2
        img, cap = data.sample(start + i, num_objects=k)
        out.append((start + i, k, img, cap))
    return out


def evaluate(demo, pairs, steps: int, cfg: float, sampler: str, batch: int, scheduler: str = "simple"):
    results, t0 = [], time.time()
    uncond = demo.encode([""])
    for b in range(0, len(pairs), batch):
        chunk = pairs[b: b + batch]
        cond = demo.encode([p[3] for p in chunk])
        latent = demo.engine.sample(demo.empty_latent(len(chunk)), cond, uncond * len(chunk), seed=chunk[0][0],
                                    steps=steps, cfg=cfg, sampler=sampler, scheduler=scheduler)
        imgs = demo.decode(latent)
        for p, im in zip(chunk, imgs):
            results.append((p, im, judge.judge(im, p[3])))
    return results, time.time() - t0


def row(name, rs):
    if not rs:
        return None
    cols = [name, str(len(rs)), f"{100 * np.mean([r['pass'] for r in rs]):.1f}"]
    cols += [f"{100 * np.mean([r['checks'][a] for r in rs]):.1f}" for a in judge.ATTRIBUTES]
    return "| " + " | ".join(cols) + " |"


def table(groups) -> str:
    head = "| set | n | pass % | " + " | ".join(f"{a} %" for a in judge.ATTRIBUTES) + " |"
    lines = [head, "|" + "---|" * (3 + len(judge.ATTRIBUTES))]
    lines += [r for r in (row(n, rs) for n, rs in groups) if r]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG)
    ap.add_argument("--sampler", default=DEFAULT_SAMPLER)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--seed-start", type=int, default=data.HELD_OUT_SEED_START,
                    help="first data seed (also held out, e.g. HELD_OUT_SEED_START + 10**6 to tune cfg on other pairs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-grid", default=None, help="PNG of the first 32 samples (top) over their references")
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    demo = open_demo(args.weights)
    pairs = held_out(args.n, args.seed_start)
    gen_rs = [judge.judge(p[2], p[3]) for p in pairs]
    results, secs = evaluate(demo, pairs, args.steps, args.cfg, args.sampler, args.batch)
    one = [r for p, _, r in results if p[1] == 1]
    two = [r for p, _, r in results if p[1] == 2]
    print(f"Demo model judge evaluation: {len(pairs)} held-out caption/seed pairs (data seeds from "
          f"{args.seed_start}), sampler {args.sampler}, {args.steps} steps, cfg {args.cfg}, "
          f"scheduler simple, shift 3; {secs:.0f} s on {args.threads} CPU threads.\n")
    print(table([("model, one object", one), ("model, two objects", two), ("model, all", one + two),
                 ("generator images (judge ceiling)", gen_rs)]))
    if args.save_grid:
        from PIL import Image

        k = min(32, len(results))
        top = np.concatenate([im for _, im, _ in results[:k]], 1)
        bottom = np.concatenate([p[2] for p, _, _ in results[:k]], 1)
        Image.fromarray(np.concatenate([top, bottom], 0)).save(args.save_grid)
    if args.json:
        fig = {"n": len(pairs), "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler, "seconds": secs,
               "one_object_pass": float(np.mean([r["pass"] for r in one])) if one else None,
               "two_object_pass": float(np.mean([r["pass"] for r in two])) if two else None}
        with open(args.json, "w") as f:
            json.dump(fig, f)


if __name__ == "__main__":
    main()
