"""Layer-wise offload under Cache-DiT: how many block loads a run waits for (a load the offloader did not prefetch,
so on a GPU the copy cannot overlap the compute), for the embedded demo-turbo (36 blocks, 8 steps) with 2 and 4
buffers, uncached and at each preset, under torch.inference_mode() as ComfyUI runs it; also the plain forward's
process time at one thread (the block loop's own cost). ``--tree DIR`` runs the same on another checkout (an older
commit in a git worktree), each tree in a fresh process, so the two are measured side by side in one run.

Usage: python bench/speed/offload_cache_bench.py [--tree /tmp/old] [--repeat 20]"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = r"""
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.models.demo import load_demo
repeat = int(sys.argv[2])
demo = load_demo()  # the shipped text encoder (the demo-turbo carries the same)
cond = demo.encode(["a small green square at the top, on a white background"])
rows = []
for buffers in (2, 4):
    for preset in (None, "quality", "balanced", "fast"):
        cache = CacheConfig(enabled=False) if preset is None else CacheConfig(enabled=True, preset=preset)
        eng = open_engine("demo-turbo", EngineConfig(offload="layerwise", resident_layers=buffers))
        with torch.inference_mode():
            eng.sample(demo.empty_latent(1), cond, None, seed=0, steps=8, cfg=1.0, cache=cache)
        off = eng.offload
        rows.append({"buffers": buffers, "cache": preset or "off", "waits": off.stalls, "loads": off.transfers,
                     "computed": sum(eng.last_run.step_mask), "calls": len(eng.last_run.step_mask)})
eng = open_engine("demo-turbo", EngineConfig())
g = torch.Generator().manual_seed(0)
x, t = torch.randn(1, 48, 16, 16, generator=g), torch.tensor([500.0])
with torch.inference_mode():
    eng.dit_forward(x, t, cond[0][None], torch.tensor([cond[0].shape[0]]))
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        eng.dit_forward(x, t, cond[0][None], torch.tensor([cond[0].shape[0]]))
        times.append(time.process_time() - t0)
times.sort()
print(json.dumps({"rows": rows, "forward_ms": 1000 * times[len(times) // 2]}))
"""


def run(tree: str, repeat: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLD_CPU_BF16": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, tree, str(repeat)], cwd=tree, env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", help="another checkout to measure beside this one (e.g. a git worktree of an old commit)")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    trees = [("this tree", ROOT)] + ([("--tree", os.path.abspath(args.tree))] if args.tree else [])
    results = {name: run(path, args.repeat) for name, path in trees}
    print("| tree | buffers | cache | computed calls | loads | loads waited for |")
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        for r in res["rows"]:
            print(f"| {name} | {r['buffers']} | {r['cache']} | {r['computed']}/{r['calls']} | {r['loads']} | "
                  f"{r['waits']} |")
    for name, res in results.items():
        print(f"{name}: plain forward {res['forward_ms']:.2f} ms process time at 1 thread (median of {args.repeat})")


if __name__ == "__main__":
    main()
