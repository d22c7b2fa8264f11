"""Peak RSS while loading a >= 1 GB checkpoint, above the process baseline (target <= 1.3x file size).

Writes a random ERNIE-Image checkpoint of ~1.3 GB (fp32) into a temp folder, then loads it in fresh
subprocesses: with engine.load_model, and, for comparison, the usual safetensors.load_file +
load_state_dict into a normally initialised model.

    .venv/bin/python bench/speed/load_memory.py
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from engine import load_model
from engine.io.checkpoint import check_architecture, open_checkpoint
from engine.models.ernie_image import ErnieImageTransformer

def status_kb(field):
    # VmHWM (peak RSS of this address space) is reset by exec, unlike getrusage's ru_maxrss,
    # which carries the parent's peak over into the child.
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

base = status_kb("VmRSS")
t = time.perf_counter()
if sys.argv[3] == "engine":
    model = load_model(sys.argv[2])
else:
    from safetensors.torch import load_file
    cfg = check_architecture(open_checkpoint(sys.argv[2]))
    model = ErnieImageTransformer(cfg)
    model.load_state_dict(load_file(sys.argv[2]))
secs = time.perf_counter() - t
peak = status_kb("VmHWM")
print(json.dumps({"baseline_mb": base / 1024, "peak_mb": peak / 1024, "seconds": secs,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def main():
    import torch

    from engine.models.ernie_image import ErnieImageConfig
    from engine.models.random_weights import save_random_checkpoint

    cfg = ErnieImageConfig(hidden_size=1024, num_layers=24, num_attention_heads=16, ffn_hidden_size=3072,
                           in_channels=128, out_channels=128, text_in_dim=1024, rope_axes_dim=(16, 24, 24))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "big.safetensors")
        save_random_checkpoint(path, cfg, seed=0, dtype=torch.float32)
        size_mb = os.path.getsize(path) / 2 ** 20
        print(f"{time.strftime('%Y-%m-%d')} · checkpoint {size_mb:.0f} MiB (fp32, {cfg.num_layers} layers × {cfg.hidden_size})")
        print("| loader | peak RSS above baseline | × file size | seconds |")
        print("|---|---|---|---|")
        for how in ("engine", "load_file+load_state_dict"):
            out = subprocess.run([sys.executable, "-c", CHILD, ROOT, path, how], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            above = r["peak_mb"] - r["baseline_mb"]
            print(f"| {how} | {above:.0f} MiB | **{above / size_mb:.2f}** | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
