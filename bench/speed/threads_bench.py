"""What the second CPU thread pays (issue 50 item 2): one DiT forward of a random ERNIE-Image model (hidden 1024,
--blocks blocks of the release's width; 512², 64 text tokens) per weights format, at 1 and 2 threads, quiet and
with another process spinning on one core ("busy"); each configuration in a fresh process, the engine's default
compute dtype unless --dtype. Reports wall and process CPU seconds per forward (median of --repeat after one
warm-up), the 1 -> 2 thread wall speedup, and on the busy box the CPU time at 2 threads against 1.

Usage: python bench/speed/threads_bench.py [--blocks 8] [--repeat 3] [--formats fp32 q8_0 q4_k int8] [--dtype bf16]
           [--profile]   (--profile: torch's profiler, op table at 1 and 2 threads, for the first format)"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = r"""
import json, sys, time, torch
from engine import EngineConfig, open_engine
path, quant, threads, repeat, dtype, profile = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5] or None, sys.argv[6] == "1"
torch.set_num_threads(threads)
eng = open_engine(path, EngineConfig(quant=quant, dtype=dtype))
cfg = eng.model_config
g = torch.Generator().manual_seed(0)
x, t = torch.randn(1, cfg.in_channels, 32, 32, generator=g), torch.tensor([500.0])
text, lens = torch.randn(1, 64, cfg.text_in_dim, generator=g).to(eng.runner.dtype), torch.tensor([64])
walls, cpus = [], []
with torch.inference_mode():
    eng.dit_forward(x, t, text, lens)
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        eng.dit_forward(x, t, text, lens)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            eng.dit_forward(x, t, text, lens)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
med = lambda v: sorted(v)[len(v) // 2]
print(json.dumps({"wall": med(walls), "cpu": med(cpus), "dtype": eng.describe()["dtype"]}))
"""


def model_files(folder: str, blocks: int) -> dict:
    """A random model (hidden 1024, ``blocks`` blocks) in fp32 and its GGUF copies; path per weights name."""
    sys.path.insert(0, ROOT)
    from engine.features.quant import writer_for
    from engine.models.ernie_image_config import ErnieImageConfig
    from engine.models.random_weights import save_random_checkpoint

    cfg = ErnieImageConfig(hidden_size=1024, num_layers=blocks, num_attention_heads=8, ffn_hidden_size=3072,
                           in_channels=128, out_channels=128, text_in_dim=3072, rope_axes_dim=(32, 48, 48))
    files = {"fp32": os.path.join(folder, "fp32.safetensors")}
    save_random_checkpoint(files["fp32"], cfg, seed=0)
    for fmt in ("q8_0", "q4_k"):
        files[fmt] = os.path.join(folder, f"{fmt}.gguf")
        writer_for(fmt).write(files["fp32"], files[fmt], fmt)
    return files


def measure(path, quant, threads, repeat, dtype, profile=False, busy=False) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, path, quant or "", str(threads), str(repeat), dtype or "",
                              "1" if profile else "0"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads)}, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if profile:
        print(f"# profile: {quant or os.path.basename(path)}, {threads} thread(s)\n{out.stderr}", flush=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--formats", nargs="+", default=["fp32", "q8_0", "q4_k", "int8"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-busy", action="store_true", help="skip the busy-box rows")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="sgld-threads-")
    files = model_files(folder, args.blocks)
    print("| weights | dtype | 1 thread wall s | 2 threads wall s | speedup | 1 thread CPU s | busy: 2 threads CPU s | "
          "busy CPU ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for i, fmt in enumerate(args.formats):
        path, quant = (files["fp32"], fmt) if fmt not in files else (files[fmt], None)
        one = measure(path, quant, 1, args.repeat, args.dtype, profile=args.profile and i == 0)
        two = measure(path, quant, 2, args.repeat, args.dtype, profile=args.profile and i == 0)
        busy = None if args.no_busy else measure(path, quant, 2, args.repeat, args.dtype, busy=True)
        cells = [fmt, one["dtype"], f"{one['wall']:.2f}", f"{two['wall']:.2f}", f"{one['wall'] / two['wall']:.2f}x",
                 f"{one['cpu']:.2f}", f"{busy['cpu']:.2f}" if busy else "-",
                 f"{busy['cpu'] / one['cpu']:.2f}x" if busy else "-"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
