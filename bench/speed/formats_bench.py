"""Every weight format of the table (engine/features/quant/registry.py) side by side, in one run, on a 36-block
ERNIE-Image-shaped random model: weight bytes vs bf16, forward relative error vs the bf16 and the fp32 model,
forward time vs fp32 and vs bf16 (median of interleaved repeats; ``--clock cpu``: this process's CPU time, which
other jobs on a shared machine hardly move; ``--clock wall``: wall time).

TABLE-DRIVEN: the rows are ``registry.choices()`` (fp8, int4, int4-g64, int8, int8-weight, and whatever else
is registered, e.g. the GGUF types), each quantized from the same bf16 weights with ``apply_quant`` and run
with bf16 activations; ``--fp32-act`` adds each format with fp32 activations. A format whose ``quantize``
cannot take a dense weight is listed as n/a with the reason. Projections are fused (as an Engine runs).

The release width (hidden 4096, ffn 12288) is 8B parameters, 32 GB in fp32: too big for this 24 GiB CPU
machine next to a bf16 copy and the formats. So: the real 36 blocks, the real head size (128), ffn = 3x
hidden, real in/out channels and text width, at ``--hidden`` (default 1024; say so when quoting figures).

    .venv/bin/python bench/speed/formats_bench.py [--hidden 1024] [--tokens 1024] [--reps 3] [--write]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.results_md import write_section  # noqa: E402
from engine.features import quant as Q  # noqa: E402
from engine.features.fuse import fuse_projections  # noqa: E402
from engine.features.quant import registry  # noqa: E402
from engine.models.ernie_image import ErnieImageConfig  # noqa: E402
from engine.models.random_weights import random_model  # noqa: E402


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        out = ""
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    have = [f for f in ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(have) or 'no VNNI / AMX'})"


def config(hidden: int) -> ErnieImageConfig:
    return ErnieImageConfig(hidden_size=hidden, num_layers=36, num_attention_heads=hidden // 128,
                            ffn_hidden_size=3 * hidden)


def build(base: torch.nn.Module, fmt, dtype):
    """A copy of ``base`` (fp32) in ``dtype``, its block linears in ``fmt`` (None: dense), fused."""
    m = copy.deepcopy(base).to(dtype)
    if fmt:
        Q.apply_quant(m, fmt)
    fuse_projections(m)
    return m.eval().requires_grad_(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="width (the release: 4096); heads of 128")
    ap.add_argument("--tokens", type=int, default=1024, help="image tokens (a square latent), plus 64 text tokens")
    ap.add_argument("--reps", type=int, default=3, help="timed forwards per row, interleaved (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (robust on a shared machine; use with --threads 1)")
    ap.add_argument("--formats", nargs="*", default=None, help="default: every name in the formats table")
    ap.add_argument("--fp32-act", action="store_true", help="also each format with fp32 activations")
    ap.add_argument("--profile", action="store_true", help="torch.profiler of one forward of bf16, int8 (top ops)")
    ap.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config(args.hidden)
    formats = list(args.formats) if args.formats is not None else list(registry.choices())
    side = int(args.tokens ** 0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.in_channels, side, side, generator=g)
    t = torch.tensor([700.0])
    text = torch.randn(1, 64, cfg.text_in_dim, generator=g)
    lens = torch.tensor([64])

    base = random_model(cfg, seed=0, dtype=torch.float32).eval().requires_grad_(False)
    params = sum(p.numel() for p in base.parameters())
    rows = [("fp32", None, torch.float32), ("bf16", None, torch.bfloat16)]
    rows += [(f, f, torch.bfloat16) for f in formats]
    if args.fp32_act:
        rows += [(f"{f} (fp32 act.)", f, torch.float32) for f in formats]
    models, skipped = {}, {}
    for label, fmt, dtype in rows:
        try:
            models[label] = (build(base, fmt, dtype), dtype)
        except (NotImplementedError, ValueError) as e:  # a format that cannot quantize a dense weight
            skipped[label] = f"{type(e).__name__}: {e}"
        print(f"built {label}", file=sys.stderr, flush=True)
    del base

    def forward(label):
        m, dtype = models[label]
        with torch.inference_mode():
            return m(x.to(dtype), t, text.to(dtype), lens).float()

    outs = {label: forward(label) for label in models}  # the warm-up forward, also the error's output
    times = {label: [] for label in models}
    load = [os.getloadavg()[0]]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for _ in range(args.reps):
        for label in models:
            s = clock()
            forward(label)
            times[label].append(clock() - s)
    load.append(os.getloadavg()[0])

    bf16_bytes = Q.weight_bytes(models["bf16"][0])
    bf16_lin = Q.weight_bytes(models["bf16"][0], only_block_linears=True)
    med = {label: statistics.median(v) for label, v in times.items()}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        f"{date} · {machine()} · {args.threads} threads · torch {torch.__version__} · 36 blocks, hidden "
        f"{cfg.hidden_size} (release: 4096), ffn {cfg.ffn_hidden_size}, heads {cfg.num_attention_heads}×128 · "
        f"{params / 1e6:.0f}M params · batch 1 × ({side * side} image + 64 text) tokens · median of {args.reps} "
        f"interleaved repeats, {'process CPU' if args.clock == 'cpu' else 'wall'} time · load average {load[0]:.1f} → {load[1]:.1f}",
        "",
        "| weights | activations | weight bytes vs bf16 (block linears) | rel. error vs bf16 | rel. error vs fp32 "
        f"| forward {args.clock} s | vs fp32 | vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, fmt, dtype in rows:
        if label in skipped:
            lines.append(f"| {label} | – | – | – | – | n/a | – | – |  <!-- {skipped[label][:120]} -->")
            continue
        m = models[label][0]
        wb = Q.weight_bytes(m) / bf16_bytes
        lb = Q.weight_bytes(m, only_block_linears=True) / bf16_lin
        e16 = Q.relative_error(outs[label], outs["bf16"])
        e32 = Q.relative_error(outs[label], outs["fp32"])
        lines.append(f"| {fmt or label} | {'fp32' if dtype == torch.float32 else 'bf16'} | {wb:.3f} ({lb:.3f}) | "
                     f"{e16:.1e} | {e32:.1e} | {med[label]:.2f} | {med['fp32'] / med[label]:.2f}x | "
                     f"{med['bf16'] / med[label]:.2f}x |")
    lines += ["", "(vs fp32 / vs bf16: how many times faster than that row; above 1 is faster.)"]
    table = "\n".join(lines)
    print(table)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for label in [r for r in ("bf16", "int8", "fp32") if r in models]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                forward(label)
            print(f"\n### profile: {label}\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

    if args.write:
        write_section("formats_bench", table, "## Weight formats side by side (CPU)\n\n`.venv/bin/python "
                      "bench/speed/formats_bench.py --write`")

if __name__ == "__main__":
    main()
