"""Per-step overhead of ComfyUI's sampler loop on the Model Loader's ``comfy_model`` (MODEL) output against
SGLDiffusion KSampler on its ``model`` (SGLD_MODEL) output, in one real ComfyUI 0.3.75 server (issue 20, item 8;
target: B at most 5% slower than A).

    .venv/bin/python bench/speed/comfy_model_bench.py [--widths 256 384] [--steps 20 4] [--repeats 9] [--threads 1]

  A  SGLDiffusion KSampler on SGLD_MODEL (the engine's own sampling loop)
  B  ComfyUI's KSampler on comfy_model (ComfyUI's loop; the engine does each DiT call)

Both run the same random ERNIE-shaped checkpoint (tests/comfy_server.py's tiny size with ERNIE-Image's 128
latent channels: hidden 64, 2 blocks; at 1 thread one CFG call takes ~20 ms at 256x256 and ~50 ms at 384x384,
so a few ms of loop overhead per step shows), the same seed, steps, sampler (euler / simple), cfg with a
negative prompt, fp32, with Cache-DiT off and with the preset ``fast`` (B through SGLDiffusion Apply Cache-DiT).
After a warm-up of every configuration (model loading, ComfyUI's first-run work) the runs alternate
A B A B ...; each repeat has a new seed (ComfyUI would otherwise return its cached output), the same for A
and B. A run's time is ComfyUI's own: the ``timestamp`` of the prompt's ``execution_start`` and
``execution_success`` status messages in /history (ms resolution); the prompt holds only the sampler and
SaveLatent besides nodes ComfyUI has cached. Reported per configuration: median s per run and ms per step
for A and B, the overhead ``median B / median A - 1`` and the median of B/A - 1 over the A B pairs. On a
shared machine wall time moves with the other jobs, so the server process's CPU time per prompt (user +
system, 10 ms ticks) is reported too: with one torch thread it is the work done, whoever else runs. Prompts
are awaited on the websocket, not by polling /history, which would load the server while it samples. The
latents of A and B are checked equal, and the calls computed of both are shown, so both did the same work.

Prints one JSON line, then the machine, the command line and a markdown table (for bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import comfy_server as cs  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from bench.metrics import max_rel_err  # noqa: E402

MODEL = "bench-tiny-ernie.safetensors"
KINDS = ("A", "B")
LABELS = {"A": "SGLDiffusion KSampler on SGLD_MODEL", "B": "ComfyUI KSampler on comfy_model"}
TARGET_PERCENT = 5.0


def graph(kind: str, *, width: int, seed: int, steps: int, cfg: float, cache: str) -> dict:
    """A: loader -> SGLDiffusion KSampler (5) -> SaveLatent (6); B: loader's comfy_model [-> Apply Cache-DiT (11)]
    -> KSampler (7) -> SaveLatent (8). The loader, text and latent nodes are the same in both, so ComfyUI keeps
    their outputs between prompts."""
    g = cs.tiny_graph(MODEL, seed=seed, steps=steps, cfg=cfg, sampler="euler", scheduler="simple", width=width,
                      height=width, weight_dtype="fp32", prefix=f"bench/{kind}")
    if cache != "off":
        g["10"] = {"class_type": "SGLDiffusionCacheDiT", "inputs": {"enabled": True, "preset": cache, "advanced": False}}
    if kind == "A":
        if cache != "off":
            g["5"]["inputs"]["cache"] = ["10", 0]
        return g
    sampler = g.pop("5")
    del g["6"]
    model = ["1", 1]
    if cache != "off":
        g["11"] = {"class_type": "SGLDiffusionApplyCacheDiT", "inputs": {"model": model, "cache": ["10", 0]}}
        model = ["11", 0]
    g["7"] = {"class_type": "KSampler", "inputs": dict(sampler["inputs"], model=model)}
    g["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"bench/{kind}"}}
    return g


def execution_seconds(entry: dict) -> float:
    """execution_start -> execution_success of a finished prompt, from ComfyUI's own timestamps."""
    stamps = {kind: data["timestamp"] for kind, data in entry["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000.0


class Runner:
    """Queues prompts and waits on the websocket (no /history polling loading the server while it samples);
    measures the server process's CPU time of each prompt besides ComfyUI's timestamps."""

    def __init__(self, server):
        self.server = server
        self.process = psutil.Process(server.proc.pid)
        self.ws = server.websocket(timeout=600)

    def cpu_seconds(self) -> float:
        t = self.process.cpu_times()
        return t.user + t.system

    def run(self, prompt: dict) -> tuple:
        """(the /history entry, server CPU seconds) of a prompt that must succeed."""
        before = self.cpu_seconds()
        prompt_id = self.server.queue(prompt)
        while True:  # ComfyUI sends "executing" with node None once the prompt is in /history
            message = self.ws.recv()
            if isinstance(message, str):
                data = json.loads(message)
                if data.get("type") == "executing" and data["data"].get("node") is None \
                        and data["data"].get("prompt_id") == prompt_id:
                    break
        cpu = self.cpu_seconds() - before
        entry = self.server.get(f"/history/{prompt_id}").json()[prompt_id]
        if entry["status"]["status_str"] != "success":
            raise RuntimeError(f"prompt failed: {cs.error_message(entry)}\n{self.server.log()[-3000:]}")
        return entry, cpu


def calls_computed(server, kind: str) -> str:
    """The last run's computed / total model calls: A from /sgldiffusion/last_runs, B from the server log."""
    if kind == "A":
        timeline = server.get("/sgldiffusion/last_runs", params={"workflow": ""}).json()["runs"]["5"]["timeline"]
        return f"{sum(map(bool, timeline))}/{len(timeline)}"
    logged = [m for m in server.log().splitlines() if "model calls computed" in m]
    return logged[-1].split("SGLDiffusion: ", 1)[1].split(",")[1].split()[0] if logged else "?"


def machine() -> dict:
    def sh(cmd):
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    return {"nproc": sh("nproc"), "lscpu": sh("lscpu | head"), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def summary(a_runs: list, b_runs: list, steps: int, center=statistics.median) -> dict:
    """``center`` (median / mean) per run and per step, and B's overhead over A: of the centers and the median
    over the A B pairs."""
    a, b = center(a_runs), center(b_runs)
    paired = statistics.median(y / x for x, y in zip(a_runs, b_runs))
    return {"A_s": a, "B_s": b, "A_ms_per_step": 1000 * a / steps, "B_ms_per_step": 1000 * b / steps,
            "overhead_ms_per_step": 1000 * (b - a) / steps, "overhead_percent": 100 * (b / a - 1),
            "paired_overhead_percent": 100 * (paired - 1), "A_runs": a_runs, "B_runs": b_runs}


def measure(server, args) -> list:
    runner = Runner(server)
    configs = list(itertools.product(args.steps, args.widths, args.caches))
    for steps, width, cache in configs:  # warm-up: engine load, ComfyUI's first sampling, the cache node
        for kind in KINDS:
            for i in range(args.warmup):
                runner.run(graph(kind, width=width, seed=10_000 + i, steps=steps, cfg=args.cfg, cache=cache))
    wall = {(*c, k): [] for c in configs for k in KINDS}
    cpu = {(*c, k): [] for c in configs for k in KINDS}
    checks = {}
    for r in range(args.repeats):
        for config in configs:
            steps, width, cache = config
            latents, calls = {}, {}
            for kind in KINDS:
                entry, cpu_s = runner.run(graph(kind, width=width, seed=r, steps=steps, cfg=args.cfg, cache=cache))
                wall[(*config, kind)].append(execution_seconds(entry))
                cpu[(*config, kind)].append(cpu_s)
                if r == 0:
                    latents[kind] = cs.saved_latent(server, entry, "6" if kind == "A" else "8")
                    calls[kind] = calls_computed(server, kind)
            if r == 0:
                a, b = latents["A"], latents["B"]
                checks[config] = {"max_rel_diff": max_rel_err(b, a), "calls": calls}
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows = []
    for config in configs:
        steps, width, cache = config
        rows.append({"steps": steps, "width": width, "latent": f"128x{width // 16}x{width // 16}", "cache": cache,
                     "wall": summary(wall[(*config, "A")], wall[(*config, "B")], steps),
                     # CPU time comes in 10 ms ticks: means (sum B / sum A) average the rounding out
                     "server_cpu": summary(cpu[(*config, "A")], cpu[(*config, "B")], steps, statistics.mean), **checks[config]})
    return rows


def table(rows: list) -> str:
    lines = ["| steps | latent (image) | Cache-DiT | calls computed A / B | A s/run | B s/run | A ms/step | B ms/step "
             "| B-A ms/step | overhead B/A-1 | paired | server CPU: A s | B s | B-A ms/step | overhead | A=B (max rel diff) |",
             "|" + "---|" * 16]
    for r in rows:
        w, c = r["wall"], r["server_cpu"]
        lines.append(f"| {r['steps']} | {r['latent']} ({r['width']}x{r['width']}) | {r['cache']} "
                     f"| {r['calls']['A']} / {r['calls']['B']} | {w['A_s']:.3f} | {w['B_s']:.3f} "
                     f"| {w['A_ms_per_step']:.1f} | {w['B_ms_per_step']:.1f} | {w['overhead_ms_per_step']:+.2f} "
                     f"| {w['overhead_percent']:+.1f}% | {w['paired_overhead_percent']:+.1f}% "
                     f"| {c['A_s']:.3f} | {c['B_s']:.3f} | {c['overhead_ms_per_step']:+.2f} | {c['overhead_percent']:+.1f}% "
                     f"| {r['max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 384], help="image sides (latent = side / 16)")
    ap.add_argument("--caches", nargs="+", default=["off", "fast"], help="'off' or Cache-DiT presets")
    ap.add_argument("--steps", type=int, nargs="+", default=[20], help="several: per-run costs show apart")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=9, help="measured runs of each of A and B per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each before measuring")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    args = ap.parse_args()
    if args.repeats < 1 or args.warmup < 1:
        ap.error("--repeats and --warmup must be at least 1")

    info = machine()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sgld-comfy-bench-") as base:
        cs.make_base_dir(base)
        cs.write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", MODEL))
        server = cs.start_server(base)
        try:
            rows = measure(server, args)
        finally:
            server.stop()
    info["loadavg_end"] = os.getloadavg()
    wall_s = time.monotonic() - started
    command = ".venv/bin/python bench/speed/comfy_model_bench.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    print(json.dumps({"bench": "comfy_model", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "command": command.strip(), "A": LABELS["A"], "B": LABELS["B"], "cfg": args.cfg,
                      "sampler": "euler/simple", "threads": args.threads, "model": dataclasses.asdict(cs.tiny_config()),
                      "target_percent": TARGET_PERCENT, "wall_s": wall_s, "machine": info, "rows": rows},
                     default=str))
    print()
    print(f"`{command.strip()}` ({wall_s:.0f} s; load average {info['loadavg_start'][0]:.1f} at the start, "
          f"{info['loadavg_end'][0]:.1f} at the end); `nproc` {info['nproc']}; torch {info['torch']}; `lscpu | head`:")
    print("\n".join("    " + line for line in info["lscpu"].splitlines()))
    print()
    print(f"A = {LABELS['A']}, B = {LABELS['B']}; euler/simple, cfg {args.cfg} with a negative, "
          f"fp32, {args.threads} thread(s), medians of {args.repeats} alternating runs; s/run and ms/step from "
          "ComfyUI's execution_start / execution_success timestamps; paired: the median of B/A-1 over the A B "
          "pairs; server CPU: mean user + system seconds of the server process per run, overhead = sum B / sum A - 1")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
