"""ComfyUI's quantized formats (engine/features/quant/comfy) on one layer-size matmul, side by side in one run:
weight bytes vs bf16, output relative error vs the bf16 layer, and this process's CPU time (1 thread by default,
median of interleaved repeats), bf16 activations. Also comfy-kitchen's own eager ``int8_linear`` on the same
int8_tensorwise weights, against the engine's ``torch._int_mm`` W8A8 path (which the layer uses on CPU) and
the engine's per-channel "int8" W8A8.

    .venv/bin/python bench/speed/comfy_formats_bench.py [--tokens 1088] [--inp 1024] [--out 3072] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from engine.features import quant as Q  # noqa: E402
from engine.features.quant.comfy import Int8TensorwiseLinear, MXFP8Linear, NVFP4Linear  # noqa: E402
from engine.features.quant.comfy.numerics import kitchen  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1088)
    ap.add_argument("--inp", type=int, default=1024)
    ap.add_argument("--out", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.out, args.inp, generator=g) * 0.02
    x = torch.randn(args.tokens, args.inp, generator=g).to(torch.bfloat16)
    dense = w.to(torch.bfloat16)
    ck = kitchen()
    int8 = Int8TensorwiseLinear.from_dense(w)
    rows = {
        "bf16": (lambda: F.linear(x, dense), dense.numel() * 2),
        "nvfp4": NVFP4Linear.from_dense(w),
        "mxfp8": MXFP8Linear.from_dense(w),
        "int8-tensorwise (torch._int_mm W8A8, the layer on CPU)": int8,
        "int8-tensorwise via comfy-kitchen eager int8_linear": (
            lambda: ck.int8_linear(x, int8.weight, int8.weight_scale, None, torch.bfloat16), None),
        "int8-tensorwise full_precision_matrix_mult (dequantized)": Int8TensorwiseLinear(
            int8.weight, int8.weight_scale, full_precision=True),
        "engine int8 (per-channel W8A8)": Q.Int8Linear.from_dense(w),
        "engine fp8 (dequantized)": Q.FP8Linear.from_dense(w),
    }
    calls = {}
    for label, row in rows.items():
        if isinstance(row, tuple):
            calls[label] = row
        else:
            calls[label] = ((lambda m: lambda: m(x))(row), sum(t.numel() * t.element_size() for t in row.parameters()))
    with torch.inference_mode():
        ref = calls["bf16"][0]().float()
        outs = {label: f().float() for label, (f, _) in calls.items()}  # also the warm-up
        times = {label: [] for label in calls}
        for _ in range(args.reps):
            for label, (f, _) in calls.items():
                s = time.process_time()
                f()
                times[label].append(time.process_time() - s)
    bf16_ms = statistics.median(times["bf16"]) * 1e3
    print(f"[{args.tokens} x {args.inp}] x [{args.inp} x {args.out}], bf16 activations, {args.threads} thread(s), "
          f"process CPU time, median of {args.reps}; torch {torch.__version__}")
    print("| weights | bytes vs bf16 | rel. error vs bf16 | CPU ms | vs bf16 |")
    print("|---|---|---|---|---|")
    for label, (_, nbytes) in calls.items():
        ms = statistics.median(times[label]) * 1e3
        size = f"{nbytes / calls['bf16'][1]:.3f}" if nbytes else "(as above)"
        print(f"| {label} | {size} | {Q.relative_error(outs[label], ref):.1e} | {ms:.1f} | {bf16_ms / ms:.2f}x |")


if __name__ == "__main__":
    main()
