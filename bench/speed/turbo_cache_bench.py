"""Cache-DiT at few steps: the presets on the demo-turbo (36 blocks, 8 steps at cfg 1) and on the demo, side by side.

    .venv/bin/python bench/speed/turbo_cache_bench.py [--pairs 12] [--repeats 5] [--write] [--peer]

For each model and step count (demo-turbo: 4, 6, 8, 9 steps at cfg 1; the demo: 8, 30, 50 steps at its cfg 3) one
batch of ``--pairs`` held-out captions (seed 0) runs uncached and with each preset, interleaved, ``--repeats`` times;
a configuration's time is the median of its process-CPU times at one thread (the steadiest measure on a shared
machine), its speedup the uncached median over its own. Reported: model calls and transformer blocks computed per
image, speedup, PSNR of the decoded pictures against the uncached ones (mean and worst), the demo judge's passes.
``--peer`` adds cache-dit 1.5.3 (``pip install -r bench/requirements.txt``) on the same DiT: its DBCache F1B0 with
TaylorSeer order 1, the step mask of its own ``fast`` policy and its dynamic threshold (the settings its docs give for
few steps). ``--write`` puts the table into bench/RESULTS.md (the Cache-DiT node's tooltip reads cache_bench.py's
figures, engine/features/cache/measured.json).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.metrics import psnr  # noqa: E402
from bench.results_md import write_section  # noqa: E402
from engine import open_demo  # noqa: E402
from engine.features.cache import CacheConfig  # noqa: E402
from engine.models import demo as demo_model  # noqa: E402
from tools.demo import data  # noqa: E402
from tools.demo.judge import passes  # noqa: E402

PRESETS = ("quality", "balanced", "fast")
GOALS_8 = {"quality": (1.5, 30.0), "balanced": (1.8, 28.0), "fast": (2.2, 26.0)}  # issue 45: speedup, PSNR floor
RUNS = [("demo-turbo", demo_model.DEMO_TURBO_WEIGHTS, (4, 6, 8, 9)), ("demo", demo_model.DEMO_WEIGHTS, (8, 30, 50))]
HEADING = """## Turbo at 8 steps: Cache-DiT presets on the demo-turbo (issue 45)

`.venv/bin/python bench/speed/turbo_cache_bench.py --write --peer` (its docstring says what it measures). The
demo-turbo is the demo distilled into ERNIE-Image's depth, 36 narrow blocks, 8 steps at cfg 1
(tools/demo/distill_turbo.py), so a cached call saves what it does at the release's depth; the presets' few-step rule
is in docs/cache_dit.md. Goals at 8 steps on the demo-turbo: quality / balanced / fast at least 1.5x / 1.8x / 2.2x
with PSNR at least 30 / 28 / 26 dB, and the judge's passes those of the uncached pictures."""


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{datetime.date.today()} · {os.cpu_count()}-core {cpu} · torch {torch.__version__} · 1 thread"


class Case:
    """One model at one step count: the batch of captions, its uncached pictures, and a runner per configuration."""

    def __init__(self, demo, steps: int, pairs: int):
        self.demo, self.steps = demo, steps
        self.cfg = demo.default_cfg
        self.captions = data.batch([data.HELD_OUT_SEED_START + i for i in range(pairs)])[1]
        self.cond = [c for caption in self.captions for c in demo.encode([caption])]
        self.uncond = demo.encode([""]) * pairs
        self.latent = demo.empty_latent(pairs)
        self.layers = demo.dit.config.num_layers

    def run(self, cache=None, runner=None):
        """(pictures, process seconds, calls computed, blocks computed per picture)."""
        model = self.demo.engine.model
        default = model.block_runner
        if runner is not None:
            model.block_runner = runner
        try:
            t0 = time.process_time()
            out = self.demo.engine.sample(self.latent, self.cond, self.uncond, seed=0, steps=self.steps, cfg=self.cfg,
                                          sampler="euler", cache=cache or CacheConfig(enabled=False))
            seconds = time.process_time() - t0
        finally:
            model.block_runner = default
        last = self.demo.engine.last_run
        if runner is not None:  # cache-dit: the calls it cached, from its own summary
            cached = runner.cached_indices() or set()
            computed = [i not in cached for i in range(last.model_calls)]
            fn, bn = 1, 0
        else:
            computed = list(last.step_mask)
            rc = (cache or CacheConfig(enabled=False))
            fn, bn = (rc.knob("fn"), rc.knob("bn")) if rc.enabled else (0, 0)
        blocks = sum(self.layers if c else fn + bn for c in computed)
        return self.demo.decode(out), seconds, sum(computed), blocks


def peer_runner(case: Case):
    from bench.speed.cache_bench import cachedit_runner

    return cachedit_runner(case.demo.engine.model, case.steps, fn=1, bn=0, warmup=1, rdt=0.24, mc=3,
                           mask_policy="fast", policy="dynamic", taylorseer=True, order=1)


def measure(case: Case, repeats: int, peer: bool) -> list:
    configs = [("uncached", None)] + [(p, CacheConfig(preset=p)) for p in PRESETS]
    if peer:
        configs.append(("cache-dit F1B0 SCM fast dynamic +TS O1", "peer"))
    times = {name: [] for name, _ in configs}
    results = {}
    case.run()  # warm-up
    for _ in range(repeats):
        for name, cache in configs:
            if cache == "peer":  # a fresh adapter per run: cache-dit keeps state across runs
                images, seconds, calls, blocks = case.run(runner=peer_runner(case))
            else:
                images, seconds, calls, blocks = case.run(cache=cache)
            times[name].append(seconds)
            results[name] = (images, calls, blocks)
    ref = results["uncached"][0]
    base = statistics.median(times["uncached"])
    rows = []
    for name, _ in configs:
        images, calls, blocks = results[name]
        ps = [psnr(img, r, 255.0) for img, r in zip(images, ref)]
        rows.append({"config": name, "calls": calls, "blocks": blocks, "seconds": statistics.median(times[name]),
                     "speedup": base / statistics.median(times[name]),
                     "psnr": float(np.mean(ps)) if name != "uncached" else float("inf"),
                     "psnr_min": float(min(ps)) if name != "uncached" else float("inf"),
                     "judge": sum(bool(passes(img, c)) for img, c in zip(images, case.captions))})
    return rows


def table(all_rows: dict, pairs: int) -> str:
    lines = [f"{machine()} · {pairs} held-out captions a row (one batch, seed 0) · median of the repeats",
             "", "| model | steps | configuration | calls computed | blocks computed | seconds | speedup | PSNR dB "
             "(worst) | judge | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, steps), rows in all_rows.items():
        for r in rows:
            goal = ""
            if model == "demo-turbo" and steps == 8 and r["config"] in GOALS_8:
                speed, floor = GOALS_8[r["config"]]
                judged = r["judge"] >= rows[0]["judge"]
                met = r["speedup"] >= speed and r["psnr"] >= floor and judged
                goal = f"{speed}x, {floor:g} dB: {'met' if met else 'NOT met'}"
            quality = "same" if r["config"] == "uncached" else f"{r['psnr']:.1f} ({r['psnr_min']:.1f})"
            lines.append(f"| {model} | {steps} | {r['config']} | {r['calls']}/{steps} | {r['blocks']} | "
                         f"{r['seconds']:.3f} | {r['speedup']:.2f}x | {quality} | {r['judge']}/{pairs} | {goal} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=12, help="held-out captions per row (one batch)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each configuration (median)")
    ap.add_argument("--peer", action="store_true", help="also cache-dit 1.5.3 on the same DiT")
    ap.add_argument("--only", nargs="*", default=None, help="model:steps pairs, e.g. demo-turbo:8")
    ap.add_argument("--turbo", default=demo_model.DEMO_TURBO_WEIGHTS, help="the demo-turbo file (a checkpoint)")
    ap.add_argument("--write", action="store_true", help="into bench/RESULTS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    all_rows = {}
    for name, path, step_counts in RUNS:
        demo = open_demo(args.turbo if name == "demo-turbo" else path, cached=False)
        for steps in step_counts:
            if args.only and f"{name}:{steps}" not in args.only:
                continue
            all_rows[(name, steps)] = measure(Case(demo, steps, args.pairs), args.repeats, args.peer)
            print(table({(name, steps): all_rows[(name, steps)]}, args.pairs).split("\n", 2)[2], flush=True)
    text = table(all_rows, args.pairs)
    print(text)
    if args.write:
        write_section("turbo_cache_bench", text, HEADING)


if __name__ == "__main__":
    main()
