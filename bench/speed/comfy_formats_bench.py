"""ComfyUI's quantized formats (engine/features/quant/comfy) on one layer-size matmul, side by side in one run:
weight bytes vs bf16, output relative error vs the bf16 layer, and this process's CPU time (1 thread by default,
median of interleaved repeats), bf16 activations. Also comfy-kitchen's own eager ``int8_linear`` on the same
int8_tensorwise weights, against the engine's ``torch._int_mm`` W8A8 path (which the layer uses on CPU) and
the engine's per-channel "int8" W8A8; and for the 4-bit layouts and int8 with ConvRot rotation, comfy-kitchen's
eager linears (ComfyUI's CPU compute, the CUDA kernels' reference) against the layer's CPU path.

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
from engine.features.quant.comfy import (  # noqa: E402
    AWQW4A16Linear,
    ConvRotW4A4Linear,
    Int8TensorwiseLinear,
    MXFP8Linear,
    NVFP4Linear,
    W4A8Linear,
)
from engine.features.quant.comfy.numerics import kitchen  # noqa: E402


def awq_round_to_nearest(w: torch.Tensor, group: int = 64) -> AWQW4A16Linear:
    """AWQ's layout without its calibration (comfy-kitchen has no AWQ quantizer): asymmetric round-to-nearest,
    w = (q - 8) * scale + zero per group of inputs, scale and zero in bf16."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(-1)
    scale = ((g.amax(-1) - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    q = ((g - lo[..., None]) / scale.float()[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    return AWQW4A16Linear(packed, scale.t().contiguous(), zero.t().contiguous(), group)


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
    rotation = 256
    layout = ck.tensor.TensorWiseINT8Layout
    q, params = layout.quantize(w, per_channel=True, convrot=True, convrot_groupsize=rotation)
    int8_rot = Int8TensorwiseLinear(q, params.scale, rotation=rotation)
    w4a4, w4a8, awq = ConvRotW4A4Linear.from_dense(w), W4A8Linear.from_dense(w), awq_round_to_nearest(w)
    rows = {
        "bf16": (lambda: F.linear(x, dense), dense.numel() * 2),
        "nvfp4": NVFP4Linear.from_dense(w),
        "mxfp8": MXFP8Linear.from_dense(w),
        "int8-tensorwise (torch._int_mm W8A8, the layer on CPU)": int8,
        "int8-tensorwise via comfy-kitchen eager int8_linear": (
            lambda: ck.int8_linear(x, int8.weight, int8.weight_scale, None, torch.bfloat16), None),
        "int8-tensorwise full_precision_matrix_mult (dequantized)": Int8TensorwiseLinear(
            int8.weight, int8.weight_scale, full_precision=True),
        "int8-tensorwise ConvRot (torch._int_mm W8A8 on rotated activations, the layer on CPU)": int8_rot,
        "int8-tensorwise ConvRot via comfy-kitchen eager int8_linear": (
            lambda: ck.int8_linear(x, int8_rot.weight, int8_rot.weight_scale, None, torch.bfloat16, convrot=True,
                                   convrot_groupsize=rotation), None),
        "convrot-w4a4 (dequantized, the layer on CPU)": w4a4,
        "convrot-w4a4 via comfy-kitchen eager convrot_w4a4_linear (int4 activations)": (
            lambda: w4a4.kitchen_forward(x, None), None),
        "asym-w4a8-int8 (dequantized, the layer on CPU)": w4a8,
        "asym-w4a8-int8 via comfy-kitchen eager w4a8_int8_linear (int8 activations)": (
            lambda: w4a8.kitchen_forward(x, None), None),
        "awq-w4a16 round-to-nearest (the layer: comfy-kitchen gemv_awq_w4a16 on bf16 activations)": awq,
        "awq-w4a16 dequantized in float32 (the layer on float32 activations) + bf16 GEMM": (
            lambda: F.linear(x, awq.dequantize(torch.bfloat16)), None),
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
