"""What the GPU check's rows share (bench/gpu/gpu_check.py runs them): the report written as rows are measured,
the context (options, device, model, state between rows), FLOP counts and the timing and error helpers."""
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.metrics import rel_err  # noqa: E402
from engine.features import attention as A  # noqa: E402
from engine.features import offload as O  # noqa: E402
from engine.features import quant as Q  # noqa: E402
from engine.features.fuse import fuse_projections  # noqa: E402
from engine.models.random_weights import random_model_on_device  # noqa: E402

PHYSICAL_TFLOPS = 790.0  # dense bf16 GEMM rate measured on these H200s (device KINDS.md)
PLANNING_TFLOPS = 600.0  # what a well-fed forward achieves; only for the time budget
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
        self._append(self.jsonl, json.dumps(rec) + "\n")  # the record first: a kill between the two leaves
        self._append(self.md, line + "\n")  # the md one row behind, never a row the jsonl lacks
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
        self.params = sum(p.numel() for p in build_model_meta(cfg).parameters())

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
            m = self.state["model"] = build(self.cfg, self.dev, self.dtype, fmt)
            self.state["fmt"] = fmt
        m.attention = A.sdpa
        return m

    def checkpoint(self) -> str:
        """The bf16 random model as a .safetensors file (checkpoint names, release layout), written once into
        a private folder: the rows that open an engine the way users do (quantize-on-load, serve) read it."""
        path = self.state.get("ckpt")
        if path is None:
            m = self.model()
            folder = tempfile.mkdtemp(prefix="gpu_check_ckpt_", dir=_ckpt_parent(self.model_bytes(), self.dev))  # 0700, ours
            path = os.path.join(folder, "ernie-image-random.safetensors")
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in m.state_dict().items()}
            save_file(tensors, path + ".tmp", metadata={"ernie_image_config": json.dumps(
                {"rope_axes_dim": list(self.cfg.rope_axes_dim)})})
            del tensors
            os.replace(path + ".tmp", path)
            self.state["ckpt"] = path
        return path

    def will_run(self, name: str) -> bool:
        """Is row ``name`` asked for (--only / --skip)?"""
        return name not in self.args.skip and (not self.args.only or name in self.args.only)

    def checkpoint_estimate(self, writer: str = "fp8") -> float:
        """Seconds to write the checkpoint: device to host, then the file at ~1 GB/s (a lead). Counted in the row
        ``writer`` that writes it; 0 once written, or for a later row when the fp8 row (the first) will write it."""
        if "ckpt" in self.state or (writer != "fp8" and self.will_run("fp8")):
            return 0.0
        return 2.0 + self.model_bytes() / 1e9 if self.dev.type == "cuda" else 0.5

    def model_bytes(self) -> int:
        return 2 * self.params

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


def build(cfg, dev, dtype, fmt=None):
    """The random model in the layout an Engine runs, in the engine's order (engine/local.py): quantized
    first (``fmt``), then q/k/v and gate/up fused (engine/features/fuse.py)."""
    model = random_model_on_device(cfg, dev, dtype, seed=0)
    if fmt:
        Q.apply_quant(model, fmt)
        Q.prepare_fast_paths(model)
    fuse_projections(model)
    return model


def _ckpt_parent(nbytes: int, dev):
    """On the GPU machine /dev/shm (memory: the file is written and read at memory speed, not the disk's) when it
    has room for the file twice over, else (and on CPU) the default temporary folder. SGLD_GPU_CHECK_CKPT_DIR
    overrides."""
    env = os.environ.get("SGLD_GPU_CHECK_CKPT_DIR")
    if env or dev.type != "cuda":
        return env or None
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * nbytes + (8 << 30):
            return "/dev/shm"
    except OSError:
        pass
    return None


def build_model_meta(cfg):
    from engine.io.load import build_model

    return build_model(cfg, "meta")


def inputs(ctx, batch=1, seed=0, short_second=False, text_tokens=None):
    """Latent, timestep, text features and lengths on the device (``short_second``: the second sample's
    text is a quarter as long, like a Base run's negative prompt, so the batch is padded and masked)."""
    cfg, args, dev, dtype = ctx.cfg, ctx.args, ctx.dev, ctx.dtype
    g = torch.Generator().manual_seed(seed)
    h, w = args.height // 16, args.width // 16
    x = torch.randn(batch, cfg.in_channels, h, w, generator=g).to(dev, dtype)
    t = torch.full((batch,), 700.0, device=dev)
    n_txt = text_tokens or args.text_tokens
    text = torch.randn(batch, n_txt, cfg.text_in_dim, generator=g).to(dev, dtype)
    lens = [n_txt] * batch
    if short_second and batch > 1:
        lens[1] = max(1, n_txt // 4)
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


def interleaved(ctx, calls: dict, repeat=None):
    """Time each of ``calls`` (name -> no-argument callable) ``repeat`` times, in turn, after one warm-up of
    each: a drift of clocks or load hits all alike. Returns ({name: min seconds}, {name: warm-up output})."""
    repeat = ctx.args.repeat if repeat is None else repeat
    times = {k: [] for k in calls}
    with torch.no_grad():
        outs = {k: f() for k, f in calls.items()}
        ctx.sync()
        for _ in range(repeat):
            for k, f in calls.items():
                s = time.perf_counter()
                f()
                ctx.sync()
                times[k].append(time.perf_counter() - s)
    return {k: min(v) for k, v in times.items()}, outs


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



def guarded(ctx, name, fn):
    try:
        fn(ctx)
    except Exception as e:  # noqa: BLE001 - report and go on
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ctx.report.row(name, "failed", notes=msg)
        traceback.print_exc()
        ctx.release()

