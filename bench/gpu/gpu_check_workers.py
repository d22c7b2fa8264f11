"""The GPU check's risky rows, each in a subprocess of its own (kernels outside PyTorch and compilers: a
device-side fault poisons only that process's CUDA context; the parent reports it and goes on). Every
speed-up here is against a bf16 sdpa eager forward or image timed in the same process, interleaved."""
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import torch
from gpu_check_core import Ctx, Report, err_note, finite_note, guarded, inputs, interleaved, time_forward
from gpu_check_rows import quality_note, sample
from safetensors import safe_open

from bench.metrics import rel_err
from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import attention as A
from engine.features.compile import compile_blocks, default_mode, graph_count, reset_counters


def run_worker(ctx, name, timeout_s):
    """Run one risky row in its own process (same options, the bf16 reference from a file); report its
    death (signal, exit code, timeout) as a failed row with the last lines it printed."""
    a = ctx.args
    cmd = [sys.executable, "-u", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.py"), "--worker", name,
           "--ref", a.ref, "--size", a.size, "--width", str(a.width), "--height", str(a.height), "--text-tokens",
           str(a.text_tokens), "--typical-text", str(a.typical_text), "--repeat", str(a.repeat), "--base-steps",
           str(a.base_steps), "--device", str(ctx.dev), "--compile-mode", a.compile_mode, "--compile-backend",
           a.compile_backend, "--budget", str(int(timeout_s)), "--out", a.out]
    if a.crash_row:
        cmd += ["--crash-row", a.crash_row]
    before = len(ctx.report.rows_named(name))
    tail = deque(maxlen=15)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def relay():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  [{name}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s))
        why = None if rc == 0 else (f"the worker died of {_signal_name(-rc)}" if rc < 0 else f"the worker exited with code {rc}")
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        rc, why = None, f"the worker was stopped after {timeout_s:.0f} s (its share of the budget)"
    reader.join(timeout=5)
    wrote = len(ctx.report.rows_named(name)) - before
    if why is None and wrote == 0:
        why = "the worker wrote no row"
    if why is not None:
        last = next((ln for ln in reversed(tail) if ln.strip() and not ln.startswith("|")), "")
        ctx.report.row(name, "failed", f"{name} (subprocess)", notes=f"{why} after {time.perf_counter() - started:.0f} s"
                       + (f"; last line: {last[:200]}" if last else "") + f"; {wrote} row(s) of it finished",
                       worker_rc=rc)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _kill_tree(proc):
    """Kill the worker and what it started (inductor's compile workers), by process id."""
    try:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        kids = []
    for p in [proc, *kids]:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def worker_ref(ctx):
    """The parent's bf16 eager inputs and output (saved by the eager row)."""
    if not os.path.exists(ctx.args.ref):
        return None
    with safe_open(ctx.args.ref, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    count = sum(k.startswith("input.") for k in tensors)
    x, t, text, lens = (tensors[f"input.{i}"].to(ctx.dev) for i in range(count))
    ctx.state["inp1"] = (x.to(ctx.dtype), t, text.to(ctx.dtype), lens)
    ctx.state["eager_out"] = tensors["out"].to(ctx.dev)
    return tensors


def _lengths(ctx):
    """(label, text tokens): the benchmark's length and a typical prompt's (e.g. 4096 + 77 keys)."""
    out = [("benchmark", ctx.args.text_tokens)]
    if ctx.args.typical_text != ctx.args.text_tokens:
        out.append(("typical prompt", ctx.args.typical_text))
    return out


def worker_attention(ctx, name):
    """sage / flash: availability and version, kernel parity, then at the benchmark's and a typical prompt's
    key count a forward interleaved with sdpa on the same model (and where each call ran), and a Turbo image."""
    ok, why = A.check_backend(name, ctx.dev, ctx.dtype, ctx.cfg.head_dim)
    version = A.installed_version("sageattention" if name == "sage" else "flash_attn", "flash-attn" if name == "flash" else None)
    if not ok:
        ctx.report.row(name, "n/a", f"{name} attention", notes=why, version=version)
        return
    cfg, dev = ctx.cfg, ctx.dev
    g = torch.Generator().manual_seed(0)
    s = ctx.n_img + ctx.args.text_tokens
    q, k, v = [torch.randn(2, s, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dev, ctx.dtype) for _ in range(3)]
    short = ctx.n_img + ctx.args.typical_text
    mask = torch.arange(s, device=dev)[None] < torch.tensor([s, short], device=dev)[:, None]
    A.sage_calls.update(sage=0, sdpa=0, split=0)
    with torch.no_grad():
        ref = A.sdpa(q, k, v, mask).float()
        par = [rel_err(A.FUNCTIONS[name](q, k, v, mask)[i], ref[i]) for i in range(2)]
    parity = f"kernel parity vs sdpa: {s} keys {par[0]:.1e}, {short} keys {par[1]:.1e}"
    if name == "sage":
        parity += f" (calls: {_calls()})"
    ctx.report.row(name, "measured", f"{name} attention kernel, bf16, {cfg.num_attention_heads} heads x {cfg.head_dim}",
                   notes=f"{why}; {parity}", version=version, check=True)
    m = ctx.model()
    for label, n_txt in _lengths(ctx):
        inp = ctx.state["inp1"] if n_txt == ctx.args.text_tokens else inputs(ctx, text_tokens=n_txt)

        def with_backend(fn, inp=inp):
            def call():
                m.attention = fn
                return m(*inp)
            return call

        A.sage_calls.update(sage=0, sdpa=0, split=0)
        start = ctx.start_window()
        times, outs = interleaved(ctx, {"sdpa": with_backend(A.sdpa), name: with_backend(A.FUNCTIONS[name])})
        calls = _calls() if name == "sage" else ""
        ctx.state["eager_s_here"] = times["sdpa"]
        ctx.report.row(name, "measured", f"DiT forward, {name} attention ({version}), bf16, {ctx.n_img} + {n_txt} keys ({label})",
                       times[name], None, ctx.peak(), start,
                       f"**{times['sdpa'] / times[name]:.2f}x vs sdpa** (interleaved, same process: sdpa {times['sdpa']:.3f} s); "
                       f"rel. error vs sdpa {rel_err(outs[name], outs['sdpa']):.1e}{finite_note(bool(torch.isfinite(outs[name]).all()))}"
                       + (f"; calls: {calls}" if calls else ""), version=version, keys=ctx.n_img + n_txt,
                       sage_calls=dict(A.sage_calls) if name == "sage" else None)
    m.attention = A.sdpa
    _turbo_pair(ctx, m, name, {"sdpa": "sdpa", name: name})


def _calls() -> str:
    c = A.sage_calls
    return (f"{c['sage']} ran sage whole, {c.get('split', 0)} sage + an exact sdpa tail merged by log-sum-exp, "
            f"{c['sdpa']} exact sdpa")


def _turbo_pair(ctx, m, name, engines: dict, toggles=None, weights="bf16"):
    """One Turbo image per variant (engine attention names), interleaved; the last variant is ``name``'s."""
    st = ctx.state.get("eager_s_here") or 0.0
    if ctx.left() < 2 * 8 * max(st, 0.01) * 1.5 + 2:
        ctx.report.row(name, "skipped", f"Turbo image, {name}", notes=f"{ctx.left():.0f} s left of the worker's budget")
        return
    calls = {}
    for label, attention in engines.items():
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention=attention))

        def run(eng=eng, label=label):
            if toggles:
                toggles[label]()
            out = sample(ctx, eng, 8, 1.0, None)[1]
            ctx.state[f"turbo_{label}"] = out
            return out
        calls[label] = run
    start = ctx.start_window()
    times, _ = interleaved(ctx, calls, repeat=1)
    base, mine = list(engines)[0], list(engines)[-1]
    ctx.state["turbo_latent"] = ctx.state[f"turbo_{base}"]
    ctx.report.row(name, "measured", f"Turbo image: 8 steps, cfg 1, {weights}, {mine} vs {base} (Engine.sample, interleaved)",
                   times[mine] / 8, times[mine], ctx.peak(), start,
                   f"**{times[base] / times[mine]:.2f}x vs {base}** ({times[base]:.2f} s)"
                   f"{quality_note(ctx, 'turbo_latent', ctx.state[f'turbo_{mine}']).replace('uncached', base)}",
                   ratio=round(times[mine] / times[base], 4))
    return times


def worker_compiled(ctx, fmt=None, attention="sdpa"):
    """Regional compile of the block in the mode users get (``--compile-mode auto`` = the engine's default:
    max-autotune-no-cudagraphs on a GPU), its compile time, then the compiled and the eager model interleaved
    in this process (the same blocks, their compiled call switched off and on): forward, Turbo image, which wins."""
    name = "all-on" if fmt else "compiled"
    m = ctx.model(fmt)
    choice = A.select_backend(attention, ctx.dev, ctx.dtype, ctx.cfg.head_dim)
    m.attention = choice.fn
    mode = "auto" if ctx.args.compile_mode == "auto" else (None if ctx.args.compile_mode == "default" else ctx.args.compile_mode)
    shown = (default_mode(ctx.dev) if mode == "auto" else mode) if ctx.args.compile_backend == "inductor" else None
    with torch.no_grad():
        st_eager = time_forward(ctx, m, ctx.state["inp1"])[0]
    compile_blocks(m, "static", mode=mode, backend=ctx.args.compile_backend)
    impls = [b._compiled_call_impl for b in m.layers]

    def compiled_on(on):
        def set_it():
            for b, impl in zip(m.layers, impls):
                b._compiled_call_impl = impl if on else None
        return set_it

    reset_counters()
    start = ctx.start_window()
    with torch.no_grad():
        s = time.perf_counter()
        m(*ctx.state["inp1"])
        ctx.sync()
        compile_s = time.perf_counter() - s
    inp = ctx.state["inp1"]
    on, off = compiled_on(True), compiled_on(False)
    times, outs = interleaved(ctx, {"eager": lambda: (off(), m(*inp))[1], "compiled": lambda: (on(), m(*inp))[1]})
    on()
    st = times["compiled"]
    label = f"{fmt} + {choice.name} + compiled" if fmt else "bf16 sdpa compiled"
    ctx.state["eager_s_here"] = times["eager"]
    ctx.report.row(name, "measured", f"DiT forward, {label} ({ctx.args.compile_backend}, mode {shown or 'default'})",
                   st, None, ctx.peak(), start,
                   f"compile + first call {compile_s:.0f} s, {graph_count()} graph(s); **{times['eager'] / st:.2f}x vs eager** "
                   f"(interleaved: eager {times['eager']:.3f} s, before compiling {st_eager:.3f} s); rel. error vs eager "
                   f"{rel_err(outs['compiled'], outs['eager']):.1e}{err_note(ctx, outs['compiled']) if not fmt else ''}"
                   f"{finite_note(bool(torch.isfinite(outs['compiled']).all()))}; {choice.describe()}",
                   compile_s=round(compile_s, 1), mode=shown)
    t = _turbo_pair(ctx, m, name, {"eager": choice.name, "compiled": choice.name}, {"eager": off, "compiled": on},
                    weights=f"{fmt} + {choice.name}" if fmt else "bf16 sdpa")
    on()
    if t:
        saved = t["eager"] - t["compiled"]
        wins = (f"compiled wins from image {int(compile_s // saved) + 1} on (compile {compile_s:.0f} s / {saved:.2f} s "
                "saved per Turbo image)" if saved > 0 else "eager wins: the compiled image is not faster")
        ctx.report.row(name, "measured", "which wins: compile time against the time it saves", None, t["compiled"], None, None,
                       wins + "; SGLang reports compile slower than eager for ERNIE-Image on H200", check=True)
    if ctx.left() > 8 * st * 1.5 + 2:
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention=choice.name))
        start = ctx.start_window()
        total, out = sample(ctx, eng, 8, 1.0, "fast")
        ctx.report.row(name, "measured", f"Turbo image: 8 steps, cfg 1, {label}, Cache-DiT fast", total / 8, total,
                       ctx.peak(), start, f"{eng.last_run.calls_computed}/8 steps computed; {graph_count()} graph(s) in all "
                       f"(new ones would be recompiles){quality_note(ctx, 'turbo_latent', out)}")


def worker_main(args, dev, cfg):
    report = Report(args.out, process=f"worker pid {os.getpid()}")
    if args.crash_row == args.worker:  # rehearsal of a dying worker (a device-side fault needs a GPU)
        os.abort()
    ctx = Ctx(args, dev, cfg, report)
    if worker_ref(ctx) is None:
        report.row(args.worker, "failed", notes="no bf16 reference (the eager row did not finish)")
        return 0
    if args.worker in ("sage", "flash"):
        guarded(ctx, args.worker, lambda c: worker_attention(c, args.worker))
    elif args.worker == "compiled":
        guarded(ctx, args.worker, worker_compiled)
    elif args.worker == "all-on":
        best = A.select_backend("auto", dev, ctx.dtype, cfg.head_dim, log_choice=False).name
        guarded(ctx, args.worker, lambda c: worker_compiled(c, fmt="fp8", attention=best))
    return 0
