"""The GPU check: the ERNIE-Image 8B shape with random weights at 1024x1024, one prepared run.

Measures seconds per step (one DiT forward at batch 1 = one Turbo step; a Base step with CFG is one
forward at batch 2) and peak memory for:
  bf16 eager (sdpa) · sage · flash (when installed) · fp8 · int4 · bf16 compiled (regional, inductor
  "default" mode unless --compile-mode says otherwise; the engine's own GPU default is
  max-autotune-no-cudagraphs, whose autotuning would not fit the 8 minutes)
  and whole runs: Turbo (8 steps, cfg 1) and Base (50 steps, cfg 4) with the engine's defaults;
  last, if budget is left: fp8 + the best attention + compiled together ("all-on").
Each row is printed as soon as it is measured; a failing row (missing kernel, OOM) is reported and
the check goes on; rows that would not fit the time budget are skipped with that reason. The
compiled row comes last and is cut off by an alarm when the budget runs out. At the end: one
markdown table (also written to $OUT/gpu_check.md when $OUT is set).

    bash bench/gpu_check.sh                      # GPU: 8b, 1024x1024, budget 450 s
    bash bench/gpu_check.sh --size tiny          # CPU (or GPU) smoke run: tiny model, 256x256
    bash bench/gpu_check.sh --offload            # only the offload section (bench/gpu_check_offload.py)
Options: --budget S, --width/--height, --text-tokens, --repeat, --compile-mode, --skip a,b, --offload.
Offload section (before the compiled row, budget permitting; alone with --offload): resident vs layer-wise offload
(2 and 8 buffers) for bf16 and fp8 at batch 1 and 2, bit-equality vs resident, and an Engine Base run
with offload + Cache-DiT.
"""
import argparse
import json
import math
import os
import platform
import signal
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine import attention as A  # noqa: E402
from engine import quant as Q  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader import build_model  # noqa: E402
from engine.pipeline import Engine  # noqa: E402
from engine.random_weights import SIZES  # noqa: E402

T0 = time.perf_counter()
ROWS = []


class Budget(Exception):
    pass


def left(args) -> float:
    return args.budget - (time.perf_counter() - T0)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gib(n) -> str:
    return f"{n / 2 ** 30:.1f}"


def peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak(dev) -> str:
    return gib(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else "–"


def random_model(cfg, dev, dtype, seed=0):
    """The model built straight on the device in ``dtype`` (no CPU copy, no fp32 copy), weights
    scaled like engine.random_weights so activations stay O(1) through all layers."""
    m = build_model(cfg, "meta").to(dtype).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "_ln.weight")):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02, generator=g)
            else:
                fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else 1
                std = fan_in ** -0.5 * (0.3 if name.startswith(("adaLN_modulation", "final_norm")) else 1.0)
                p.normal_(0.0, std, generator=g)
    return m.eval().requires_grad_(False)


def inputs(cfg, args, dev, dtype, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = args.height // 16, args.width // 16
    x = torch.randn(batch, cfg.in_channels, h, w, generator=g).to(dev, dtype)
    t = torch.full((batch,), 700.0, device=dev)
    text = torch.randn(batch, args.text_tokens, cfg.text_in_dim, generator=g).to(dev, dtype)
    lens = torch.tensor([args.text_tokens] * batch, device=dev)
    return x, t, text, lens


def time_forward(model, inp, dev, repeat):
    peak_reset(dev)
    with torch.no_grad():
        s = time.perf_counter()
        out = model(*inp)
        sync(dev)
        first = time.perf_counter() - s
        times = []
        for _ in range(repeat):
            s = time.perf_counter()
            model(*inp)
            sync(dev)
            times.append(time.perf_counter() - s)
    finite = bool(torch.isfinite(out).all())
    time_forward.last = out.float()
    return min(times), first, peak(dev), finite


def err_vs(state, key="eager_out") -> str:
    ref = state.get(key)
    out = getattr(time_forward, "last", None)
    if ref is None or out is None:
        return ""
    return f"; rel. error vs bf16 eager {((out - ref).norm() / ref.norm()).item():.1e}"


def row(what, attention, weights, s_step, peak_gb, notes=""):
    r = {"what": what, "attention": attention, "weights": weights,
         "s_per_step": None if s_step is None else round(s_step, 4), "peak_gib": peak_gb, "notes": notes}
    ROWS.append(r)
    step = "–" if s_step is None else f"{s_step:.3f}"
    print(f"| {what} | {attention} | {weights} | {step} | {peak_gb} | {notes} |", flush=True)
    print("JSON " + json.dumps(r), file=sys.stderr, flush=True)


def guarded(name, args, need_s, fn):
    """Run one measurement; report failures and budget skips as rows instead of stopping."""
    if name in args.skip:
        row(name, "–", "–", None, "–", "skipped (--skip)")
        return
    if left(args) < need_s:
        row(name, "–", "–", None, "–", f"skipped: {left(args):.0f} s of the budget left, needs ~{need_s:.0f} s")
        return
    try:
        fn()
    except Budget:
        row(name, "–", "–", None, "–", f"stopped by the time budget ({args.budget:.0f} s)")
    except Exception as e:  # noqa: BLE001 - report and go on
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row(name, "–", "–", None, "–", f"failed: {msg}")
        traceback.print_exc(file=sys.stderr)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def header(args, dev, cfg):
    lines = [f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · torch {torch.__version__} · python {platform.python_version()}"]
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        lines.append(f"GPU {p.name} (sm{cap[0]}{cap[1]}, {p.total_memory / 2 ** 30:.0f} GiB) · CUDA {torch.version.cuda}")
    else:
        lines.append(f"CPU {platform.processor() or platform.machine()} · {torch.get_num_threads()} threads (no CUDA GPU)")
    for mod in ("triton", "sageattention", "flash_attn"):
        ok, ver = A._package_version(mod)
        lines.append(f"{mod}: {ver if ok else 'not available'}")
    n = sum(p.numel() for p in build_model(cfg, "meta").parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines.append(f"model: {args.size} shape ({size} params), random weights · {args.width}x{args.height} "
                 f"-> {(args.width // 16) * (args.height // 16)} image + {args.text_tokens} text tokens · budget {args.budget:.0f} s")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="8b (default on a GPU) or tiny/small/medium (default tiny on CPU)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode of the compiled row: default (plain inductor: compiles in well under a "
                         "minute, fits the budget) or auto = the engine's GPU default, max-autotune-no-cudagraphs "
                         "(autotuning adds minutes at the 8B shape)")
    ap.add_argument("--skip", default="", help="comma-separated rows to skip: eager,sage,flash,turbo,base,fp8,int4,compiled,all-on,"
                                               "offload (the whole offload section) or off-bf16,off-bf16-8buf,off-fp8,off-engine")
    ap.add_argument("--device", default=None)
    ap.add_argument("--offload", action="store_true",
                    help="run only the offload section (bench/gpu_check_offload.py: resident vs layer-wise offload, "
                         "bf16 and fp8, Turbo and Base steps); without it the section runs last if budget is left")
    args = ap.parse_args()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.size is None:
        args.size = "8b" if dev.type == "cuda" else "tiny"
    if args.size not in SIZES:
        raise SystemExit(f"--size must be one of {', '.join(SIZES)}")
    px = 1024 if args.size == "8b" else 256
    args.width, args.height = args.width or px, args.height or px
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cfg = SIZES[args.size]
    dtype = torch.bfloat16
    head = header(args, dev, cfg)
    print("\n".join("  " + h for h in head), flush=True)
    print("\n| what | attention | weights | s/step | peak GiB | notes |\n|---|---|---|---|---|---|", flush=True)
    state = {}

    def fresh():
        state.pop("model", None)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        s = time.perf_counter()
        state["model"] = random_model(cfg, dev, dtype)
        sync(dev)
        return time.perf_counter() - s

    init_s = fresh()
    inp1 = inputs(cfg, args, dev, dtype, 1)

    def eager():
        m = state["model"]
        m.attention = A.sdpa
        s, first, pk, ok = time_forward(m, inp1, dev, args.repeat)
        row("bf16 eager", "sdpa", "bf16", s, pk, f"first call {first:.2f} s; model init {init_s:.1f} s" + ("" if ok else "; NON-FINITE output"))
        state["eager_s"] = s
        state["eager_out"] = time_forward.last

    def kernel(name):
        def run():
            ok, why = A.check_backend(name, dev, dtype, cfg.head_dim)
            if not ok:
                row(f"{name} attention", name, "bf16", None, "–", f"n/a: {why}")
                return
            m = state["model"]
            q, k, v = _qkv(cfg, dev)
            mask = torch.arange(q.shape[1], device=dev)[None] < torch.tensor([q.shape[1], 300], device=dev)[:, None]
            with torch.no_grad():
                ref = A.sdpa(q, k, v, mask).float()
                par = ((A.FUNCTIONS[name](q, k, v, mask).float() - ref).norm() / ref.norm()).item()
            m.attention = A.FUNCTIONS[name]
            s, first, pk, fin = time_forward(m, inp1, dev, args.repeat)
            m.attention = A.sdpa
            sp = f"; {state['eager_s'] / s:.2f}x vs eager sdpa" if state.get("eager_s") else ""
            row(f"{name} attention", name, "bf16", s, pk, f"{why}{sp}; masked-attention parity vs sdpa {par:.1e}{err_vs(state)}"
                + ("" if fin else "; NON-FINITE output"))
        return run

    def whole(name, steps, cfg_scale):
        def run():
            eng = Engine(state["model"], EngineConfig(device=str(dev), attention="auto"))
            g = torch.Generator().manual_seed(1)
            cond = [torch.randn(args.text_tokens, cfg.text_in_dim, generator=g)]
            uncond = [torch.randn(max(1, args.text_tokens // 4), cfg.text_in_dim, generator=g)] if cfg_scale != 1.0 else None
            lat = torch.zeros(1, cfg.in_channels, args.height // 16, args.width // 16)
            peak_reset(dev)
            s = time.perf_counter()
            out = eng.sample(lat, cond, uncond, seed=0, steps=steps, cfg=cfg_scale)
            sync(dev)
            total = time.perf_counter() - s
            fin = bool(torch.isfinite(out).all())
            row(f"{name} run ({steps} steps, cfg {cfg_scale:g})", eng.attention_backend, "bf16", total / steps, peak(dev),
                f"total {total:.2f} s" + ("" if fin else "; NON-FINITE output"))
        return run

    def quantized(fmt):
        def run():
            if state.get("fmt") not in (None, fmt):
                fresh()
            m = state["model"]
            s = time.perf_counter()
            Q.quantize_model(m, fmt)
            notes = Q.prepare_fast_paths(m)
            sync(dev)
            q_s = time.perf_counter() - s
            state["fmt"] = fmt
            m.attention = A.sdpa
            st, first, pk, fin = time_forward(m, inp1, dev, args.repeat)
            sp = f"; {state['eager_s'] / st:.2f}x vs bf16" if state.get("eager_s") else ""
            row(f"{fmt} weights", "sdpa", f"{fmt} ({gib(Q.weight_bytes(m))} GiB)", st, pk,
                f"quantize {q_s:.1f} s; {notes[0] if notes else 'dequantize path'}{sp}{err_vs(state)}" + ("" if fin else "; NON-FINITE output"))
        return run

    def compiled():
        fresh()
        state["fmt"] = None
        m = state["model"]
        m.attention = A.sdpa
        from engine.compile import compile_blocks, graph_count, reset_counters

        mode = args.compile_mode
        compile_blocks(m, "static", mode=mode)
        reset_counters()
        s, first, pk, fin = within_budget(lambda: time_forward(m, inp1, dev, args.repeat))
        sp = f"; {state['eager_s'] / s:.2f}x vs eager" if state.get("eager_s") else ""
        row(f"bf16 compiled ({m._sgld_compile['mode']})", "sdpa", "bf16", s, pk,
            f"mode {m._sgld_compile['mode']}, compile + first call {first:.0f} s, {graph_count()} graph(s){sp}{err_vs(state)}" + ("" if fin else "; NON-FINITE output"))
        state["compiled"] = True

    def within_budget(fn):
        """Run fn, stopped by SIGALRM when the budget runs out (compiles cannot be bounded otherwise)."""
        remaining = int(left(args)) - 5
        if remaining <= 0:
            raise Budget()
        use_alarm = hasattr(signal, "SIGALRM")
        if use_alarm:
            def on_alarm(signum, frame):
                raise Budget()
            signal.signal(signal.SIGALRM, on_alarm)
            signal.alarm(remaining)
        try:
            return fn()
        finally:
            if use_alarm:
                signal.alarm(0)

    def all_on():
        """The fastest combination: fp8 weights + the best attention + the compiled block (one recompile)."""
        if not state.get("compiled"):
            row("fp8 + auto attention + compiled", "–", "–", None, "–", "skipped: the compiled row did not finish")
            return
        from engine.compile import graph_count, reset_counters

        m = state["model"]
        Q.quantize_model(m, "fp8")
        notes = Q.prepare_fast_paths(m)
        state["fmt"] = "fp8"
        choice = A.select_backend("auto", dev, dtype, cfg.head_dim)
        m.attention = choice.fn
        reset_counters()
        s, first, pk, fin = within_budget(lambda: time_forward(m, inp1, dev, args.repeat))
        sp = f"; {state['eager_s'] / s:.2f}x vs bf16 eager sdpa" if state.get("eager_s") else ""
        row(f"fp8 + {choice.name} + compiled", choice.name, "fp8", s, pk,
            f"{notes[0] if notes else ''}; recompile + first call {first:.0f} s, {graph_count()} new graph(s){sp}{err_vs(state)}"
            + ("" if fin else "; NON-FINITE output"))

    if not args.offload:
        guarded("eager", args, 5, eager)
        guarded("sage", args, 5, kernel("sage"))
        guarded("flash", args, 5, kernel("flash"))
        est = state.get("eager_s", 0.2)
        guarded("turbo", args, 8 * est * 1.5 + 5, whole("Turbo", 8, 1.0))
        guarded("base", args, 50 * 2 * est * 1.3 + 5, whole("Base", 50, 4.0))
        guarded("fp8", args, 20, quantized("fp8"))
        guarded("int4", args, 30, quantized("int4"))

    # -- offload section (bench/gpu_check_offload.py; --offload runs only this, --skip offload leaves it out) --
    from gpu_check_offload import run_offload_section

    run_offload_section(sys.modules[__name__], args, dev, cfg, dtype, state)

    if not args.offload:  # last: its compile time is the least predictable (an alarm stops it at the budget)
        guarded("compiled", args, 40, compiled)
        guarded("all-on", args, 40, all_on)

    lines = ["# gpu_check", "", *[f"- {h}" for h in head], "",
             "| what | attention | weights | s/step | peak GiB | notes |", "|---|---|---|---|---|---|"]
    for r in ROWS:
        step = "–" if r["s_per_step"] is None else f"{r['s_per_step']:.3f}"
        lines.append(f"| {r['what']} | {r['attention']} | {r['weights']} | {step} | {r['peak_gib']} | {r['notes']} |")
    lines.append(f"\nwall time {time.perf_counter() - T0:.0f} s")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if os.environ.get("OUT"):  # the device runner's result folder
        try:
            with open(os.path.join(os.environ["OUT"], "gpu_check.md"), "w") as f:
                f.write(text)
        except OSError:
            pass


def _qkv(cfg, dev):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 512, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dev, torch.bfloat16) for _ in range(3)]


if __name__ == "__main__":
    main()
