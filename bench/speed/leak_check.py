"""Leak check: the tiny ERNIE-Image graph run N times (default 50) through a real ComfyUI server.

Prints the server's RSS after run 1 and after run N and their ratio; the target is a ratio within
5% (exit code 1 if it is above 1.05). Each run uses a new seed, so the SGLDiffusion KSampler runs
every time while the loaded model stays cached, as it does for a user pressing "Queue" repeatedly.

    .venv/bin/python bench/speed/leak_check.py [--runs 50] [--steps 4] [--size 256] [--json out.json]

Needs ComfyUI 0.3.75 from scripts/comfyui.sh (installed on first use, as in the tests).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import comfy_server as cs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=256, help="image size in pixels (latent = size/16)")
    ap.add_argument("--limit", type=float, default=1.05, help="largest acceptable RSS ratio run N / run 1")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary ComfyUI base directory")
    args = ap.parse_args(argv)

    base = tempfile.mkdtemp(prefix="sgld-leak-")
    cs.make_base_dir(base)
    cs.write_tiny_checkpoint(os.path.join(base, "models", "diffusion_models", "tiny-ernie.safetensors"))
    server = cs.start_server(base)
    rss, times = [], []
    try:
        for i in range(args.runs):
            t0 = time.perf_counter()
            entry = server.run(cs.tiny_graph("tiny-ernie.safetensors", seed=1000 + i, steps=args.steps,
                                             width=args.size, height=args.size, prefix="leak/run"), timeout=600)
            times.append(time.perf_counter() - t0)
            if entry["status"]["status_str"] != "success":
                print(f"run {i + 1} failed: {cs.error_message(entry)}", file=sys.stderr)
                return 2
            rss.append(server.rss())
            if (i + 1) in (1, args.runs) or (i + 1) % 10 == 0:
                print(f"run {i + 1:3d}: RSS {rss[-1] / 2**20:8.1f} MiB   ({times[-1]:.2f} s)", flush=True)
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    ratio = rss[-1] / rss[0]
    result = {
        "runs": args.runs, "steps": args.steps, "size": args.size,
        "rss_run1_mib": round(rss[0] / 2**20, 1), "rss_last_mib": round(rss[-1] / 2**20, 1),
        "rss_max_mib": round(max(rss) / 2**20, 1), "ratio": round(ratio, 4),
        "median_run_s": round(sorted(times)[len(times) // 2], 3), "limit": args.limit,
    }
    print(f"RSS after run 1: {result['rss_run1_mib']} MiB; after run {args.runs}: {result['rss_last_mib']} MiB; "
          f"ratio {ratio:.4f} (target <= {args.limit}) -> {'PASS' if ratio <= args.limit else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ratio <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
