"""DiT forward on CPU per attention backend, torch.compile on/off and FP8 / INT4 weights on/off.

Every variant is built from the same random bf16 weights and run on the same inputs; timings are
the minimum over interleaved repeats (A, B, C, A, B, C, ...) so machine noise hits all alike.
Error = ||out - ref|| / ||ref|| against the bf16 eager SDPA model. Weight bytes are those at rest
(quantized storage included), against the same model in bf16; the 8B rows are computed on the meta
device (no memory). GPU-only backends (sage, flash) are listed with the reason they cannot run.

    .venv/bin/python bench/speed/attn_compile_quant_bench.py [--size small] [--latent 16] [--repeat 5]
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.metrics import rel_err  # noqa: E402
from engine.features import attention as A  # noqa: E402
from engine.features import quant as Q  # noqa: E402
from engine.features.compile import compile_blocks, graph_count, reset_counters  # noqa: E402
from engine.io.load import build_model  # noqa: E402
from engine.models.random_weights import SIZES, random_model  # noqa: E402

VARIANTS = [  # (attention, compile, quant)
    ("sdpa", False, None),
    ("math", False, None),
    ("sdpa", True, None),
    ("sdpa", False, "fp8"),
    ("sdpa", False, "int4"),
    ("sdpa", True, "fp8"),
    ("sdpa", True, "int4"),
]


def make(size, attention, compiled, quant):
    m = random_model(SIZES[size], seed=0, dtype=torch.bfloat16)
    if quant:
        Q.apply_quant(m, quant)
    m.attention = A.FUNCTIONS[attention]
    if compiled:
        compile_blocks(m, "static")
    return m


def bytes_rows(size):
    ref = build_model(SIZES[size], "meta").to(torch.bfloat16)
    base, base_lin = Q.weight_bytes(ref), Q.weight_bytes(ref, True)
    rows = []
    for fmt in ("fp8", "int4", "int4-g64"):
        m = build_model(SIZES[size], "meta").to(torch.bfloat16)
        Q.apply_quant(m, fmt)
        rows.append(f"| {size} | {fmt} | {Q.weight_bytes(m) / 2**20:,.1f} MiB | {Q.weight_bytes(m) / base:.3f} | "
                    f"{Q.weight_bytes(m, True) / base_lin:.3f} |")
    return base, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=[s for s in SIZES if s != "8b"])
    ap.add_argument("--latent", type=int, default=16, help="latent side (image tokens = side^2)")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = SIZES[args.size]
    g = torch.Generator().manual_seed(0)
    b = 2  # CFG batch, prompts of different lengths (padded text -> key mask)
    x = torch.randn(b, cfg.in_channels, args.latent, args.latent, generator=g).to(torch.bfloat16)
    t = torch.tensor([700.0] * b)
    text = torch.randn(b, args.text_tokens, cfg.text_in_dim, generator=g).to(torch.bfloat16)
    lens = torch.tensor([args.text_tokens, args.text_tokens // 2])
    models, compile_s, outs = {}, {}, {}
    with torch.no_grad():
        for v in VARIANTS:
            m = make(args.size, *v)
            reset_counters()
            s = time.perf_counter()
            outs[v] = m(x, t, text, lens)  # warm-up (and the compile)
            compile_s[v] = (time.perf_counter() - s, graph_count())
            models[v] = m
        times = {v: [] for v in VARIANTS}
        for _ in range(args.repeat):
            for v in VARIANTS:
                s = time.perf_counter()
                models[v](x, t, text, lens)
                times[v].append(time.perf_counter() - s)
    base = VARIANTS[0]
    ref_bytes = Q.weight_bytes(models[base])
    params = sum(p.numel() for p in models[base].parameters())
    print(f"{time.strftime('%Y-%m-%d')} · {platform.processor() or platform.machine()} · {args.threads} thread(s) · "
          f"torch {torch.__version__} · {args.size} ({params / 1e6:.0f}M params, bf16) · batch {b} × "
          f"({args.latent ** 2} image + {args.text_tokens} text) tokens · min of {args.repeat} interleaved repeats\n")
    print("| attention | compile | weights | forward ms | vs eager sdpa bf16 | weight bytes vs bf16 | rel. error vs bf16 | first call s (graphs) |")
    print("|---|---|---|---|---|---|---|---|")
    tb = min(times[base])
    for v in VARIANTS:
        att, comp, qt = v
        ms = 1000 * min(times[v])
        first, graphs = compile_s[v]
        print(f"| {att} | {'inductor' if comp else 'off'} | {qt or 'bf16'} | {ms:.0f} | {min(times[v]) / tb:.2f}x | "
              f"{Q.weight_bytes(models[v]) / ref_bytes:.3f} | {rel_err(outs[v], outs[base]):.1e} | "
              f"{first:.1f}{f' ({graphs})' if comp else ''} |")
    for name in ("sage", "flash"):
        ok, why = A.check_backend(name, "cpu", torch.bfloat16, cfg.head_dim)
        print(f"| {name} | – | – | n/a | – | – | – | not on this machine: {why} |")
    print("\nWeight bytes at rest (all weights; block linears only):\n")
    print("| model | format | total | vs bf16 | block linears vs bf16 |")
    print("|---|---|---|---|---|")
    for size in (args.size, "8b"):
        base_b, rows = bytes_rows(size)
        print(f"| {size} | bf16 | {base_b / 2**20:,.1f} MiB | 1.000 | 1.000 |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
