"""The GPU check: one prepared run that answers, on an H200, what the engine does at the ERNIE-Image 8B
shape (random weights, bf16) at 1024x1024, and brings back every finished figure even if it is cut short.

    bash bench/gpu_check.sh                  # the GPU run: 8 minutes at most, set-up included
    bash bench/gpu_check.sh --size tiny      # the CPU rehearsal (tests/test_gpu_check.py runs it in CI)
    bash bench/gpu_check.sh --only sage,compiled --budget 200    # a rerun of some rows (build and eager always run)

Rows, in this order. Time estimates for an H200 at 8B / 1024x1024 (4096 image + 128 text tokens): one
forward is 77 TFLOP (GEMMs 66, attention 10.5), 0.128 s at 600 TFLOP/s achieved; the physical limit
(790 TFLOP/s, the bf16 GEMM rate measured on these machines) is 0.097 s.
  in this process (PyTorch ops only)
    build          the model built on the meta device, materialized once in bf16 on the GPU (~2 s)
    eager          our forward, bf16, sdpa: the baseline of every error and speed-up below (~2 s)
    diffusers      diffusers' ErnieImageTransformer2DModel on the same weights (our tensors, shared) and
                   inputs, forwards interleaved with ours: both times, the ratio (target <= 0.85x), both
                   against the physical limit, and the parity (~10 s with the import)
    turbo, turbo-balanced, turbo-fast   Turbo: 8 steps, cfg 1, bf16 sdpa eager, uncached and with
                   Cache-DiT balanced / fast: seconds per image (~4 s)
    base, base-balanced, base-fast      Base: 50 steps, cfg 4 (batch 2 per step), likewise (~27 s)
    fp8, int4      weights quantized in place: forward time and error vs bf16 (~6 s, ~10 s)
    off-bf16, off-bf16-8buf, off-fp8, off-engine   layer-wise offload, bench/gpu_check_offload.py (~60 s)
  each in a subprocess of its own (kernels outside PyTorch and compilers: a device-side fault poisons
  only that process's CUDA context; this process reports it and goes on)
    sage           SageAttention: the installed version and its limits, kernel parity, forward (~40 s)
    flash          FlashAttention 2, when installed (PyPI has only its sdist, so it is normally n/a)
    compiled       regional torch.compile (inductor, --compile-mode default), then Turbo with it (~60 s)
    all-on         fp8 + the best attention + compiled, and Turbo with all of it (~60 s)
A row that would not fit the budget left is skipped with that reason; a failing row is reported with its
error and the check goes on. Each row goes to stdout, $OUT/gpu_check.md and $OUT/gpu_check.jsonl the
moment it is measured (flushed and fsync'd), after an environment header; so a hard stop loses only the
row in flight. Memory: "peak" is torch's max allocated during the row (reset at its start, after
everything of the row before was freed), "start" what was allocated when it began (a leak shows there).
"""
import argparse
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from engine.features import attention as A  # noqa: E402
from engine.features import offload as O  # noqa: E402
from engine.features import quant as Q  # noqa: E402
from engine.features.cache import CacheConfig  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.features.fuse import fuse_projections  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.models.random_weights import SIZES, random_model_on_device  # noqa: E402

PHYSICAL_TFLOPS = 790.0  # dense bf16 GEMM rate measured on these H200s (device KINDS.md)
PLANNING_TFLOPS = 600.0  # what a well-fed forward achieves; only for the time budget
RISKY = ("sage", "flash", "compiled", "all-on")
OFFLOAD_ROWS = ("off-bf16", "off-bf16-8buf", "off-fp8", "off-engine")
ALL_ROWS = ("build", "eager", "diffusers", "turbo", "turbo-balanced", "turbo-fast", "base", "base-balanced",
            "base-fast", "fp8", "int4", *OFFLOAD_ROWS, *RISKY)
STATUSES = ("measured", "skipped", "failed", "n/a")


# -- the report: every row on disk the moment it exists -----------------------------------------------------
class Report:
    """Rows to stdout, ``gpu_check.md`` and ``gpu_check.jsonl`` in ``out_dir``; each append is flushed and
    fsync'd, so a run killed at any point leaves every finished row. Workers append to the same files."""

    COLUMNS = "| row | what | s/step | s/image | peak GiB | start GiB | notes |"

    def __init__(self, out_dir: str, process: str = "main"):
        self.out_dir = out_dir
        self.process = process
        os.makedirs(out_dir, exist_ok=True)
        self.md = os.path.join(out_dir, "gpu_check.md")
        self.jsonl = os.path.join(out_dir, "gpu_check.jsonl")

    @staticmethod
    def _append(path: str, text: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def header(self, lines, env: dict) -> None:
        for path in (self.md, self.jsonl):  # a fresh report per run
            if os.path.exists(path):
                os.remove(path)
        self._append(self.md, "# gpu_check\n\n" + "".join(f"- {ln}\n" for ln in lines) + "\n"
                     + self.COLUMNS + "\n|---|---|---|---|---|---|---|\n")
        self._append(self.jsonl, json.dumps({"env": env}) + "\n")
        print("\n".join("  " + ln for ln in lines), flush=True)
        print(self.COLUMNS, flush=True)

    def row(self, name: str, status: str, what: str = "", s_step=None, s_image=None, peak=None, start=None,
            notes: str = "", **extra) -> dict:
        assert status in STATUSES, status
        rec = {"row": name, "status": status, "what": what or name, "s_per_step": _round(s_step),
               "s_per_image": _round(s_image), "peak_gib": _round(peak, 2), "start_gib": _round(start, 2),
               "notes": notes, "process": self.process, "time": round(time.time(), 1), **extra}
        shown = (notes if status == "measured" else f"**{status}**: {notes}").replace("|", "\\|")
        line = (f"| {name} | {rec['what'].replace('|', '/')} | {_cell(s_step)} | {_cell(s_image)} | {_cell(peak, 1)} | "
                f"{_cell(start, 1)} | {shown} |")
        self._append(self.md, line + "\n")
        self._append(self.jsonl, json.dumps(rec) + "\n")
        print(line, flush=True)
        return rec

    def footer(self, text: str) -> None:
        self._append(self.md, f"\n{text}\n")
        self._append(self.jsonl, json.dumps({"footer": text}) + "\n")
        print(text, flush=True)

    def rows_named(self, name: str) -> list:
        if not os.path.exists(self.jsonl):
            return []
        with open(self.jsonl, encoding="utf-8") as f:
            recs = [json.loads(x) for x in f if x.strip()]
        return [r for r in recs if r.get("row") == name]


def _count(n) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _round(x, nd=4):
    return None if x is None else round(float(x), nd)


def _cell(x, nd=3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


T0 = time.perf_counter()


# -- measuring ------------------------------------------------------------------------------------------------
class Ctx:
    """What the rows share: options, device, model config, the report and the state between rows."""

    def __init__(self, args, dev, cfg, report):
        self.args, self.dev, self.cfg, self.report = args, dev, cfg, report
        self.dtype = torch.bfloat16
        self.state = {}
        self.n_img = (args.height // 16) * (args.width // 16) // cfg.patch_size ** 2
        self.flops1 = forward_flops(cfg, self.n_img, args.text_tokens)

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - T0)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def allocated(self):
        return torch.cuda.memory_allocated(self.dev) / 2 ** 30 if self.dev.type == "cuda" else None

    def peak(self):
        return torch.cuda.max_memory_allocated(self.dev) / 2 ** 30 if self.dev.type == "cuda" else None

    def start_window(self):
        """Start a row's memory window: its peak is measured from what is allocated now."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        return self.allocated()

    def release(self):
        """Free everything a row left: the offloader (remove), the model and its outputs, then the
        collector, the CUDA cache and the pinned host cache, so the next row starts from nothing."""
        m = self.state.pop("model", None)
        self.state.pop("fmt", None)
        self.state.pop("off", None)
        if m is not None and O.get_offload(m) is not None:
            O.get_offload(m).remove()
        del m
        time_forward.last = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()
        O.empty_host_cache()

    def model(self, fmt=None):
        """The bf16 model (or one quantized to ``fmt``), built fresh when the current one is not that."""
        m = self.state.get("model")
        if m is None or self.state.get("fmt") != fmt or O.get_offload(m) is not None:
            self.release()
            m = self.state["model"] = build(self.cfg, self.dev, self.dtype)
            self.state["fmt"] = None
            if fmt:
                Q.apply_quant(m, fmt)
                Q.prepare_fast_paths(m)
                self.state["fmt"] = fmt
        m.attention = A.sdpa
        return m

    def forward_estimate(self, batch=1) -> float:
        """Seconds of one forward: measured when the eager row ran, else from the FLOPs."""
        if "eager_s" in self.state:
            return self.state["eager_s"] * batch
        if self.dev.type != "cuda":
            return 0.05 * batch
        return batch * self.flops1 / (PLANNING_TFLOPS * 1e12)


def forward_flops(cfg, n_img: int, n_txt: int, batch: int = 1) -> float:
    """Multiply-adds x 2 of one forward: the GEMMs (q, k, v, out, gate, up, down per block; embedding and
    final layers) and attention (QK^T and PV over all heads), without padding."""
    h, s = cfg.hidden_size, n_img + n_txt
    per_block = 2 * s * (4 * h * h + 3 * h * cfg.ffn_hidden_size) + 4 * s * s * h
    p2 = cfg.patch_size ** 2
    outer = 2 * n_img * cfg.in_channels * p2 * h + 2 * n_img * h * p2 * cfg.out_channels
    if cfg.text_in_dim != h:
        outer += 2 * n_txt * cfg.text_in_dim * h
    return batch * (cfg.num_layers * per_block + outer)


def attention_flops(cfg, n_img, n_txt, batch=1) -> float:
    return batch * cfg.num_layers * 4 * (n_img + n_txt) ** 2 * cfg.hidden_size


def build(cfg, dev, dtype):
    """The random model in the layout an Engine runs (q/k/v and gate/up fused, engine/features/fuse.py)."""
    model = random_model_on_device(cfg, dev, dtype, seed=0)
    fuse_projections(model)
    return model


def inputs(ctx, batch=1, seed=0, short_second=False):
    """Latent, timestep, text features and lengths on the device (``short_second``: the second sample's
    text is a quarter as long, like a Base run's negative prompt, so the batch is padded and masked)."""
    cfg, args, dev, dtype = ctx.cfg, ctx.args, ctx.dev, ctx.dtype
    g = torch.Generator().manual_seed(seed)
    h, w = args.height // 16, args.width // 16
    x = torch.randn(batch, cfg.in_channels, h, w, generator=g).to(dev, dtype)
    t = torch.full((batch,), 700.0, device=dev)
    text = torch.randn(batch, args.text_tokens, cfg.text_in_dim, generator=g).to(dev, dtype)
    lens = [args.text_tokens] * batch
    if short_second and batch > 1:
        lens[1] = max(1, args.text_tokens // 4)
    return x, t, text, torch.tensor(lens, device=dev)


def time_forward(ctx, model, inp, repeat=None):
    """(min seconds of ``repeat`` forwards after a warm-up, first call seconds, finite?)."""
    repeat = ctx.args.repeat if repeat is None else repeat
    with torch.no_grad():
        s = time.perf_counter()
        out = model(*inp)
        ctx.sync()
        first = time.perf_counter() - s
        times = []
        for _ in range(repeat):
            s = time.perf_counter()
            model(*inp)
            ctx.sync()
            times.append(time.perf_counter() - s)
    time_forward.last = out.float()
    return min(times), first, bool(torch.isfinite(out).all())


time_forward.last = None


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def err_note(ctx, out=None) -> str:
    ref = ctx.state.get("eager_out")
    out = time_forward.last if out is None else out
    if ref is None or out is None:
        return "; no bf16 reference"
    return f"; rel. error vs bf16 eager {rel_err(out, ref):.1e}"


def speed_note(ctx, s, what="bf16 eager") -> str:
    base = ctx.state.get("eager_s")
    return f"; {base / s:.2f}x vs {what}" if base else ""


def limit_note(ctx, s, flops=None) -> str:
    flops = ctx.flops1 if flops is None else flops
    limit = flops / (PHYSICAL_TFLOPS * 1e12)
    if ctx.dev.type != "cuda":
        return f"{flops / s / 1e9:.2f} GFLOP/s (CPU: no physical-limit comparison)"
    return f"{flops / s / 1e12:.0f} TFLOP/s, {limit / s:.0%} of the {PHYSICAL_TFLOPS:.0f} TFLOP/s limit ({limit * 1e3:.0f} ms)"


def finite_note(ok) -> str:
    return "" if ok else "; NON-FINITE output"


# -- the rows of this process --------------------------------------------------------------------------------
def row_build(ctx):
    ctx.release()
    start = ctx.start_window()
    s = time.perf_counter()
    ctx.state["model"] = build(ctx.cfg, ctx.dev, ctx.dtype)
    ctx.state["fmt"] = None
    ctx.sync()
    n = sum(p.numel() for p in ctx.state["model"].parameters())
    ctx.report.row("build", "measured", f"random {ctx.args.size} model, bf16, on {ctx.dev}", peak=ctx.peak(),
                   start=start, notes=f"{time.perf_counter() - s:.1f} s, {_count(n)} parameters, built on meta and "
                                       f"materialized once in bf16 on {ctx.dev.type} (no fp32 or CPU copy)")


def row_eager(ctx):
    m = ctx.model()
    inp = ctx.state["inp1"] = inputs(ctx)
    start = ctx.start_window()
    s, first, ok = time_forward(ctx, m, inp)
    ctx.state["eager_s"], ctx.state["eager_out"] = s, time_forward.last
    tensors = {f"input.{i}": t.detach().cpu().contiguous() for i, t in enumerate(inp)}
    tensors["out"] = time_forward.last.detach().cpu().contiguous()
    save_file(tensors, ctx.args.ref, metadata={"eager_s": repr(s)})  # safetensors: the workers read no pickle
    ctx.report.row("eager", "measured", "DiT forward, ours, bf16 sdpa (batch 1 = one Turbo step)", s, None,
                   ctx.peak(), start, f"first call {first:.2f} s; {limit_note(ctx, s)}{finite_note(ok)}")


def diffusers_model(cfg, ours):
    """diffusers' model on our weights: built on the meta device, then our tensors assigned (no copy)."""
    from diffusers import ErnieImageTransformer2DModel

    with torch.device("meta"):
        ref = ErnieImageTransformer2DModel(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
            ffn_hidden_size=cfg.ffn_hidden_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
            patch_size=cfg.patch_size, text_in_dim=cfg.text_in_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
            rope_theta=int(cfg.rope_theta), eps=cfg.eps)
    ref.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return ref.eval().requires_grad_(False)


def row_diffusers(ctx):
    import diffusers

    ours = ctx.model()
    ref = diffusers_model(ctx.cfg, ours)
    storages = lambda m: {p.untyped_storage().data_ptr() for p in m.parameters()}  # noqa: E731 (fused parts: views)
    shared = storages(ours) >= storages(ref)
    inp = ctx.state["inp1"]
    start = ctx.start_window()
    times = {"ours": [], "diffusers": []}
    calls = {"ours": lambda: ours(*inp), "diffusers": lambda: ref(*inp, return_dict=False)[0]}
    with torch.no_grad():
        outs = {k: f() for k, f in calls.items()}  # warm-ups
        ctx.sync()
        for _ in range(ctx.args.repeat):
            for k, f in calls.items():  # interleaved: a drift of clocks or load hits both alike
                s = time.perf_counter()
                f()
                ctx.sync()
                times[k].append(time.perf_counter() - s)
    a, r = outs["ours"].float(), outs["diffusers"].float()
    parity = ((a - r).abs().max() / r.abs().max()).item()
    so, sd = min(times["ours"]), min(times["diffusers"])
    ref = outs = calls = None  # frees the reference model (the lambdas hold ref until calls goes)
    ratio = so / sd
    ctx.report.row("diffusers", "measured", f"DiT forward, diffusers {diffusers.__version__} ErnieImageTransformer2DModel",
                   sd, None, ctx.peak(), start,
                   f"{limit_note(ctx, sd)}; same weights ({'shared storage' if shared else 'COPIED'}) and inputs; "
                   f"max abs(ours - diffusers) / max abs(diffusers) {parity:.1e}",
                   ours_s=_round(so), diffusers_s=_round(sd), ratio=_round(ratio), parity=parity)
    ctx.report.row("diffusers", "measured", "DiT forward, ours, interleaved with diffusers", so, None, ctx.peak(), start,
                   f"**ours / diffusers {ratio:.2f}x** (target <= 0.85x); {limit_note(ctx, so)}", ratio=_round(ratio))


def whole_run(name, steps, cfg_scale, preset):
    def run(ctx):
        m = ctx.model()
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa"))
        g = torch.Generator().manual_seed(1)
        cond = [torch.randn(ctx.args.text_tokens, ctx.cfg.text_in_dim, generator=g)]
        uncond = [torch.randn(max(1, ctx.args.text_tokens // 4), ctx.cfg.text_in_dim, generator=g)] if cfg_scale != 1.0 else None
        lat = torch.zeros(1, ctx.cfg.in_channels, ctx.args.height // 16, ctx.args.width // 16)
        cache = CacheConfig(preset=preset) if preset else CacheConfig(enabled=False)
        start = ctx.start_window()
        s = time.perf_counter()
        out = eng.sample(lat, cond, uncond, seed=0, steps=steps, cfg=cfg_scale, cache=cache)
        ctx.sync()
        total = time.perf_counter() - s
        computed = eng.last_run.calls_computed
        label = "Turbo" if cfg_scale == 1.0 else "Base"
        ctx.report.row(name, "measured", f"{label} image: {steps} steps, cfg {cfg_scale:g}, bf16 sdpa eager, "
                       f"{'Cache-DiT ' + preset if preset else 'no cache'}", total / steps, total, ctx.peak(), start,
                       f"{computed}/{steps} steps computed{finite_note(bool(torch.isfinite(out).all()))}")
    return run


def quantized(fmt):
    def run(ctx):
        m = ctx.model()  # bf16
        start = ctx.start_window()
        s = time.perf_counter()
        Q.apply_quant(m, fmt)
        notes = Q.prepare_fast_paths(m)
        ctx.sync()
        q_s = time.perf_counter() - s
        ctx.state["fmt"] = fmt
        st, first, ok = time_forward(ctx, m, ctx.state["inp1"])
        ctx.report.row(fmt, "measured", f"DiT forward, {fmt} weights ({Q.weight_bytes(m) / 2 ** 30:.1f} GiB), sdpa", st, None,
                       ctx.peak(), start, f"quantize {q_s:.1f} s; {notes[0] if notes else 'dequantize path'}"
                       f"{speed_note(ctx, st)}{err_note(ctx)}{finite_note(ok)}")
    return run


# -- the subprocess rows --------------------------------------------------------------------------------------
def run_worker(ctx, name, timeout_s):
    """Run one risky row in its own process (same options, the bf16 reference from a file); report its
    death (signal, exit code, timeout) as a failed row with the last lines it printed."""
    a = ctx.args
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--worker", name, "--ref", a.ref, "--size", a.size,
           "--width", str(a.width), "--height", str(a.height), "--text-tokens", str(a.text_tokens),
           "--repeat", str(a.repeat), "--base-steps", str(a.base_steps), "--device", str(ctx.dev), "--compile-mode", a.compile_mode,
           "--compile-backend", a.compile_backend, "--budget", str(int(timeout_s)), "--out", a.out]
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
    """The parent's bf16 eager inputs, output and time (saved by the eager row)."""
    if not os.path.exists(ctx.args.ref):
        return None
    with safe_open(ctx.args.ref, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        count = sum(k.startswith("input.") for k in tensors)
        ref = {"inputs": [tensors[f"input.{i}"] for i in range(count)], "out": tensors["out"],
               "eager_s": float(f.metadata()["eager_s"])}
    ctx.state["inp1"] = tuple(t.to(ctx.dev) for t in ref["inputs"])
    ctx.state["inp1"] = (ctx.state["inp1"][0].to(ctx.dtype), ctx.state["inp1"][1], ctx.state["inp1"][2].to(ctx.dtype),
                         ctx.state["inp1"][3])
    ctx.state["eager_out"], ctx.state["eager_s"] = ref["out"].to(ctx.dev), ref["eager_s"]
    return ref


def worker_attention(ctx, name):
    """sage / flash: availability (with the installed version), kernel parity on masked inputs, forward."""
    ok, why = A.check_backend(name, ctx.dev, ctx.dtype, ctx.cfg.head_dim)
    version = A.installed_version("sageattention" if name == "sage" else "flash_attn", "flash-attn" if name == "flash" else None)
    if not ok:
        ctx.report.row(name, "n/a", f"{name} attention", notes=why, version=version)
        return
    cfg, dev = ctx.cfg, ctx.dev
    s = ctx.n_img + ctx.args.text_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(2, s, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dev, ctx.dtype) for _ in range(3)]
    short = s - 96  # a sample whose key count is not a multiple of 64
    mask = torch.arange(s, device=dev)[None] < torch.tensor([s, short], device=dev)[:, None]
    A.sage_calls.update(sage=0, sdpa=0)
    with torch.no_grad():
        ref = A.sdpa(q, k, v, mask).float()
        par = [rel_err(A.FUNCTIONS[name](q, k, v, mask)[i], ref[i]) for i in range(2)]
        parity = f"kernel parity vs sdpa: {s} keys {par[0]:.1e}, {short} keys {par[1]:.1e}"
        if name == "sage":
            parity += f" ({A.sage_calls['sage']} call(s) ran sage, {A.sage_calls['sdpa']} were routed to sdpa)"
            raw = _raw_sage_errors(q, k, v, s, short)
            parity += "; " + raw
    ctx.report.row(name, "measured", f"{name} attention kernel, bf16, {cfg.num_attention_heads} heads x {cfg.head_dim}",
                   notes=f"{why}; {parity}", version=version)
    m = ctx.model()
    m.attention = A.FUNCTIONS[name]
    A.sage_calls.update(sage=0, sdpa=0)
    start = ctx.start_window()
    st, first, fin = time_forward(ctx, m, ctx.state["inp1"])
    notes = f"first call {first:.1f} s{speed_note(ctx, st, 'bf16 eager sdpa')}{err_note(ctx)}{finite_note(fin)}"
    if name == "sage":  # what the figures include: sage's INT8 QK / FP16 PV rounding, on the calls that ran it
        notes += (f"; of its {A.sage_calls['sage'] + A.sage_calls['sdpa']} attention calls {A.sage_calls['sage']} ran "
                  f"sage and {A.sage_calls['sdpa']} exact sdpa (key counts not a multiple of its block)")
    ctx.report.row(name, "measured", f"DiT forward, {name} attention ({version}), bf16", st, None, ctx.peak(), start,
                   notes, version=version, sage_calls=dict(A.sage_calls) if name == "sage" else None)


def _raw_sage_errors(q, k, v, s, short) -> str:
    """What the engine's routing avoids: sageattn itself at key counts that are not a multiple of 64."""
    from sageattention import sageattn

    errs = []
    for n in (short, 300):
        qq, kk, vv = q[:1, :n].contiguous(), k[:1, :n].clone(), v[:1, :n].contiguous()
        exact = A.sdpa(qq, kk, vv).float()
        errs.append(f"{n} keys {rel_err(sageattn(qq, kk, vv, tensor_layout='NHD', is_causal=False), exact):.1e}")
    return "unguarded sageattn vs sdpa (what the routing avoids): " + ", ".join(errs)


def worker_compiled(ctx, fmt=None, attention="sdpa"):
    """Regional compile of the block (one graph for all layers); then a Turbo run, uncached and with
    Cache-DiT fast, on the compiled model (same shapes: no recompile)."""
    from engine.features.compile import compile_blocks, graph_count, reset_counters

    name = "all-on" if fmt else "compiled"
    m = ctx.model(fmt)
    choice = A.select_backend(attention, ctx.dev, ctx.dtype, ctx.cfg.head_dim)
    m.attention = choice.fn
    mode = None if ctx.args.compile_mode == "default" else ctx.args.compile_mode
    compile_blocks(m, "static", mode=mode, backend=ctx.args.compile_backend)
    reset_counters()
    start = ctx.start_window()
    st, first, fin = time_forward(ctx, m, ctx.state["inp1"])
    label = f"{fmt} + {choice.name} + compiled" if fmt else "bf16 sdpa compiled"
    ctx.report.row(name, "measured", f"DiT forward, {label} ({ctx.args.compile_backend}, mode {ctx.args.compile_mode})",
                   st, None, ctx.peak(), start,
                   f"compile + first call {first:.0f} s, {graph_count()} graph(s){speed_note(ctx, st)}{err_note(ctx)}"
                   f"{finite_note(fin)}; {choice.describe()}")
    for preset in (None, "fast"):
        need = 8 * st * 1.5 + 2
        if ctx.left() < need:
            ctx.report.row(name, "skipped", f"Turbo image, {label}", notes=f"{ctx.left():.0f} s left of the worker's budget")
            continue
        eng = Engine(m, EngineConfig(device=str(ctx.dev), attention=choice.name))
        g = torch.Generator().manual_seed(1)
        cond = [torch.randn(ctx.args.text_tokens, ctx.cfg.text_in_dim, generator=g)]
        lat = torch.zeros(1, ctx.cfg.in_channels, ctx.args.height // 16, ctx.args.width // 16)
        start = ctx.start_window()
        s = time.perf_counter()
        eng.sample(lat, cond, None, seed=0, steps=8, cfg=1.0, cache=CacheConfig(preset=preset) if preset else CacheConfig(enabled=False))
        ctx.sync()
        total = time.perf_counter() - s
        ctx.report.row(name, "measured", f"Turbo image: 8 steps, cfg 1, {label}, {'Cache-DiT ' + preset if preset else 'no cache'}",
                       total / 8, total, ctx.peak(), start,
                       f"{eng.last_run.calls_computed}/8 steps computed; {graph_count()} graph(s) in all (new ones would be recompiles)")


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


# -- the plan ---------------------------------------------------------------------------------------------------
def plan(ctx):
    """(name, need seconds, function, risky?) in running order. ``need`` is called just before the row."""
    f = ctx.forward_estimate
    c = ctx.args.repeat + 1
    from engine.features.cache import masks

    def run_need(steps, batch, preset):
        computed = sum(masks.preset_mask(preset, steps)) if preset else steps
        return lambda: 1.3 * computed * f(batch) + 2

    from gpu_check_offload import offload_rows

    rows = [("build", lambda: 5, row_build), ("eager", lambda: 2 + c * f(), row_eager),
            ("diffusers", lambda: 10 + 2 * c * f(), row_diffusers)]
    for steps, cfg_scale, base in ((8, 1.0, "turbo"), (ctx.args.base_steps, 4.0, "base")):
        batch = 1 if cfg_scale == 1.0 else 2
        for preset in (None, "balanced", "fast"):
            name = base if preset is None else f"{base}-{preset}"
            rows.append((name, run_need(steps, batch, preset), whole_run(name, steps, cfg_scale, preset)))
    rows += [("fp8", lambda: 8 + c * f(), quantized("fp8")), ("int4", lambda: 15 + 2 * c * f(), quantized("int4"))]
    rows += offload_rows(sys.modules[__name__], ctx)
    rows = [(n, need, fn, False) for n, need, fn in rows]
    rows += [("sage", lambda: 40, None, True), ("flash", lambda: 30, None, True),
             ("compiled", lambda: 60, None, True), ("all-on", lambda: 60, None, True)]
    return rows


def guarded(ctx, name, fn):
    try:
        fn(ctx)
    except Exception as e:  # noqa: BLE001 - report and go on
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ctx.report.row(name, "failed", notes=msg)
        traceback.print_exc()
        ctx.release()


def environment(args, dev, cfg, ctx):
    """The header: machine, versions (kernels included, read from package metadata without importing
    them), carried wheels, model shape and FLOPs, budget."""
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "device": str(dev)}
    lines = [f"{env['date']} · torch {torch.__version__} (CUDA {torch.version.cuda}) · python {env['python']}"]
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        env.update(gpu=p.name, capability=f"sm{cap[0]}{cap[1]}", gpu_gib=round(p.total_memory / 2 ** 30))
        lines.append(f"GPU {p.name} (sm{cap[0]}{cap[1]}, {p.total_memory / 2 ** 30:.0f} GiB, {p.multi_processor_count} SMs)")
    else:
        lines.append(f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads: no CUDA GPU "
                     f"(the rehearsal: same rows and code paths, tiny shapes)")
    versions = {}
    for dist in ("sageattention", "diffusers", "triton", "flash-attn"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    env["versions"] = versions
    lines.append(" · ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()))
    site = os.environ.get("SGLD_GPU_CHECK_SITE")
    if site and os.path.isdir(site):
        carried = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions(path=[site]))
        env["carried"] = carried
        lines.append(f"carried wheels installed in {site}: {', '.join(carried) or 'none'}")
    n = sum(p.numel() for p in build_model_meta(cfg).parameters())
    env.update(size=args.size, params=n, width=args.width, height=args.height, text_tokens=args.text_tokens,
               flops=ctx.flops1, budget_s=args.budget)
    att = attention_flops(cfg, ctx.n_img, args.text_tokens)
    lines.append(f"model: {args.size} shape, {_count(n)} parameters, random weights, bf16 · {args.width}x{args.height} = "
                 f"{ctx.n_img} image + {args.text_tokens} text tokens · forward {ctx.flops1 / 1e12:.2f} TFLOP "
                 f"(attention {att / 1e12:.2f}) = {ctx.flops1 / (PHYSICAL_TFLOPS * 1e12) * 1e3:.1f} ms at "
                 f"{PHYSICAL_TFLOPS:.0f} TFLOP/s · budget {args.budget:.0f} s")
    return lines, env


def build_model_meta(cfg):
    from engine.io.load import build_model

    return build_model(cfg, "meta")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="8b (default with a GPU) or tiny (the CPU rehearsal); small/medium")
    ap.add_argument("--width", type=int, default=None, help="default 1024 for 8b, 256 otherwise")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--text-tokens", type=int, default=None, help="default 128 for 8b (4096 + 128 = 66 blocks of 64), 32 otherwise")
    ap.add_argument("--repeat", type=int, default=None, help="timed forwards per row, after one warm-up (default 3; 1 on CPU)")
    ap.add_argument("--base-steps", type=int, default=None,
                    help="steps of the Base rows (default 50 with a GPU; 10 on CPU: the same code, a shorter rehearsal)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all rows (gpu_check.sh sets it from its hard stop)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode of the compiled rows: default (plain inductor, well under a minute) or "
                         "e.g. max-autotune-no-cudagraphs, the engine's GPU default (autotuning takes minutes at 8B)")
    ap.add_argument("--compile-backend", default=None,
                    help="inductor (default with a GPU); aot_eager on CPU, where inductor's C++ compile of the block "
                         "would take most of the rehearsal")
    ap.add_argument("--only", default="", help="comma-separated rows to run (build and eager always run): " + ",".join(ALL_ROWS))
    ap.add_argument("--skip", default="", help="comma-separated rows to skip; 'offload' = all off-* rows")
    ap.add_argument("--offload", action="store_true", help="only the offload rows (= --only " + ",".join(OFFLOAD_ROWS) + ")")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="report folder (default $OUT, else a temporary folder)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one risky row, in a subprocess
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--crash-row", default=None,
                    help="rehearsal only: the worker of this risky row aborts at once (a device fault needs a GPU)")
    args = ap.parse_args(argv)
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if "offload" in args.skip:
        args.skip |= set(OFFLOAD_ROWS)
    if args.offload:
        args.only |= set(OFFLOAD_ROWS)
    unknown = (args.only | args.skip) - set(ALL_ROWS) - {"offload"}
    if unknown:
        ap.error(f"unknown row(s) {', '.join(sorted(unknown))}; rows are {', '.join(ALL_ROWS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.size is None:
        args.size = "8b" if cuda else "tiny"
    if args.size not in SIZES:
        raise SystemExit(f"gpu_check: --size must be one of {', '.join(SIZES)}")
    dev = torch.device(args.device or ("cuda" if cuda else "cpu"))
    args.out = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check_")
    big = args.size == "8b"
    args.width, args.height = args.width or (1024 if big else 256), args.height or (1024 if big else 256)
    args.text_tokens = args.text_tokens or (128 if big else 32)
    args.compile_backend = args.compile_backend or ("inductor" if dev.type == "cuda" else "aot_eager")
    args.repeat = args.repeat or (3 if dev.type == "cuda" else 1)
    args.base_steps = args.base_steps or (50 if dev.type == "cuda" else 10)
    cfg = SIZES[args.size]
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the tiny shapes gain nothing from more, and a shared CI machine loses
    if args.worker:
        return worker_main(args, dev, cfg)

    report = Report(args.out)
    if dev.type != "cuda" and args.size != "tiny" and args.device != "cpu":
        msg = (f"gpu_check: FAILED: torch.cuda.is_available() is False (torch {torch.__version__}) on a GPU run "
               f"(--size {args.size}); nothing measured. The CPU rehearsal is: bash bench/gpu_check.sh --size tiny")
        report.header([msg], {"error": msg})
        print(msg, file=sys.stderr, flush=True)
        return 2
    args.ref = os.path.join(tempfile.mkdtemp(prefix="gpu_check_ref_"), "bf16_eager.safetensors")
    ctx = Ctx(args, dev, cfg, report)
    lines, env = environment(args, dev, cfg, ctx)
    rows = plan(ctx)
    env["plan_s"] = {n: round(need(), 1) for n, need, _, _ in rows}
    lines.append("plan (s, estimated before the run): " + ", ".join(f"{n} {s:.0f}" for n, s in env["plan_s"].items())
                 + f" = {sum(env['plan_s'].values()):.0f}")
    report.header(lines, env)

    for name, need, fn, risky in rows:
        if name not in ("build", "eager") and ((args.only and name not in args.only) or name in args.skip):
            report.row(name, "skipped", notes="--skip" if name in args.skip else "not in --only")
            continue
        if risky:
            ctx.release()  # the GPU to the worker; this process keeps only its CUDA context
        est = need()
        if ctx.left() < est:
            report.row(name, "skipped", notes=f"{ctx.left():.0f} s of the budget left, the row needs ~{est:.0f} s")
            continue
        if not risky:
            guarded(ctx, name, fn)
            continue
        if name == "flash":
            ok, why = A._package_version("flash_attn")
            if not ok:
                report.row("flash", "n/a", "flash attention", notes="flash-attn is not installed: PyPI has only its sdist, "
                           "whose CUDA build takes far longer than the GPU window, so it is not carried")
                continue
        share = ctx.left() - 5
        if name == "compiled" and "all-on" not in args.skip and (not args.only or "all-on" in args.only):
            share = max(est, share - 40)  # leave all-on a chance; compiled comes first
        run_worker(ctx, name, min(share, 300))
    ctx.release()
    shutil.rmtree(os.path.dirname(args.ref), ignore_errors=True)
    report.footer(f"wall time {time.perf_counter() - T0:.0f} s (python; set-up before it is in gpu_check.log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
