"""The GPU check: one prepared run that answers, on an H200, what the engine does at the ERNIE-Image 8B
shape (random weights, bf16) at 1024x1024, and brings back every finished figure even if it is cut short.

    bash bench/gpu_check.sh                  # the GPU run (GPU_CHECK_TIMEOUT, default 540 s, set-up included)
    bash bench/gpu_check.sh --size tiny      # the CPU rehearsal (tests/test_gpu_check.py runs it in CI)
    bash bench/gpu_check.sh --only lora,serve,all-on     # a rerun of some rows (build and eager always run)

Rows, in this order: the article's headline claims first (is it faster than diffusers on a real GPU, and by
how much; then with Cache-DiT, FP8, sage, compile), the rest after. Seconds are estimates for an H200 at 8B /
1024x1024 (4096 image + 128 text tokens: one forward is 77 TFLOP, 0.128 s at 600 TFLOP/s achieved, 0.097 s
at the 790 TFLOP/s bf16 GEMM rate measured on these machines); the plan line of the report recomputes them
from the measured eager forward.
    build          the model built on the meta device, materialized once in bf16 on the GPU             5
    eager          our forward, bf16, sdpa: the reference of every error below                           3
    diffusers      three forwards interleaved: ours, diffusers as shipped (its boolean mask sends SDPA
                   to the memory-efficient kernel), diffusers without the mask (ours' kernel): both ratios 12
    turbo          Turbo 8 steps bf16, Engine.sample end to end vs diffusers' transformer in the same
                   8-step Euler loop, interleaved                                                          10
    turbo-quality, turbo-balanced, turbo-fast   Cache-DiT presets, each with its latent's rel. error and
                   PSNR against the uncached latent of the same seed (the turbo row's)                     9
    fp8            the bf16 file written once (~18 s), open_engine(file, quant=fp8): quantize-on-load peak,
                   then inference memory (window after loading), forward, Turbo image                     33
    sage           [subprocess] at the benchmark's 4224 keys and a typical prompt's 4096 + 77: sage vs sdpa
                   interleaved, where each call ran; Turbo image sage vs sdpa                              60
    compiled       [subprocess] the mode users get (max-autotune-no-cudagraphs): compile time, compiled vs
                   eager interleaved, Turbo image, which wins, Turbo + Cache-DiT fast                     150
    base, base-quality, base-balanced, base-fast   Base 50 steps cfg 4 (batch 2), presets with quality    49
    int4           open_engine(file, quant=int4): load peak, inference memory, forward                     20
    int8           open_engine(file, quant=int8): W8A8 (torch._int_mm, per-token activation scales) vs bf16:
                   load peak, inference memory, forward, Turbo image if the budget allows                 25
    gguf           open_engine(file, quant=q4_k): GGUF Q4_K blocks (our K quantizer on the GPU at load), the
                   bytes dequantized per layer each forward vs bf16: load, memory, forward                 25
    nvfp4, mxfp8, int8-tensorwise   ComfyUI's formats (engine/features/quant/comfy): open_engine(file,
                   quant=...) with comfy-kitchen's quantizers at load; which matmul (kitchen's int8_linear on
                   CUDA after its probe; nvfp4 / mxfp8 dequantized per layer): load, memory, forward       60
    fuse-quant     the engine's order (quantize, fuse) and the reverse: same tensors, state_dict works     10
    off-bf16, off-bf16-8buf, off-fp8, off-engine   layer-wise offload (bench/gpu/gpu_check_offload.py)         56
    lora           rank-32 LoRA apply / strength / switch / remove on the 8B model (gpu_check_serve.py)      9
    serve          the real HTTP server (sgld serve --sample-only, POST /v1/sample) on the file, Turbo 1024^2:
                   1 / 4 / 8 concurrent clients vs the same requests one after another, then 8 clients
                   each with its own LoRA (per-request `loras`) in the same batched forwards               57
    serve-dp       sgld serve --dp-size N, one replica per GPU, N x 8 clients beside serve's 8: a lend of
                   2 or more GPUs (n/a on one)                                                              0
    comfy          ComfyUI's KSampler on comfy_model vs SGLDiffusion KSampler: n/a (ComfyUI is not carried) 0
    all-on         [subprocess] fp8 + the best attention + compiled, Turbo with all of it (or 1.3x the
                   compiled row's compile time when this run measured it)                                 150
    flash          FlashAttention 2 when installed (PyPI has only its sdist: normally n/a)                  0
  about 741 s of rows + ~20 s of set-up: more than one 540 s run (rows 1-23, 474 s, fit); the first run
  answers the headline rows, and $OUT/rerun.txt names the command for the rest (bench/RESULTS.md: the
  15-minute plan).
A row that would not fit the budget left is skipped with that reason; a failing row is reported with its
error and the check goes on. Each row goes to stdout, $OUT/gpu_check.md and $OUT/gpu_check.jsonl the
moment it is measured (flushed and fsync'd), after an environment header; so a hard stop loses only the
row in flight. Memory: "peak" is torch's max allocated during the row (reset at its start, after
everything of the row before was freed), "start" what was allocated when it began (a leak shows there).
"""
import argparse
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check_core as core  # noqa: E402  (puts the checkout first on sys.path)
import torch  # noqa: E402
from gpu_check_core import Ctx, Report, _count, attention_flops, forward_flops, guarded  # noqa: E402,F401 (tests read these)
from gpu_check_offload import OFFLOAD_ROWS, offload_rows  # noqa: E402
from gpu_check_parts import row_parts  # noqa: E402
from gpu_check_predicted import beside  # noqa: E402
from gpu_check_rows import opened, row_build, row_diffusers, row_eager, row_fuse_quant, row_turbo, whole_run  # noqa: E402
from gpu_check_serve import row_comfy, row_lora, row_serve, row_serve_dp, serve_dp_estimate, serve_estimate  # noqa: E402
from gpu_check_workers import run_worker, worker_main  # noqa: E402

from engine.features import attention as A  # noqa: E402
from engine.features.cache import masks  # noqa: E402
from engine.models.random_weights import SIZES  # noqa: E402

PRESETS = ("quality", "balanced", "fast")
COMFY_ROWS = ("nvfp4", "mxfp8", "int8-tensorwise")  # ComfyUI's formats, computed by comfy-kitchen
RISKY = ("sage", "compiled", "all-on", "flash")
ALL_ROWS = ("build", "eager", "diffusers", "turbo", *(f"turbo-{p}" for p in PRESETS), "fp8", "sage", "compiled",
            "base", *(f"base-{p}" for p in PRESETS), "int4", "int8", "gguf", *COMFY_ROWS, "fuse-quant",
            *OFFLOAD_ROWS, "lora", "serve", "serve-dp", "comfy", "parts",
            "all-on", "flash")
WORKER_CAP = {"sage": 120, "compiled": 240, "all-on": 240, "flash": 60}  # seconds a worker may take at most


def plan(ctx):
    """(name, need seconds, function or None for a subprocess row) in running order; ``need`` is called
    just before the row, so it uses the measured eager forward once there is one."""
    f, c = ctx.forward_estimate, ctx.args.repeat + 1
    load = lambda: ctx.model_bytes() / (2e9 if ctx.dev.type == "cuda" else 1e12)  # noqa: E731 (page cache -> GPU)

    def run_need(steps, batch, preset):
        computed = sum(masks.preset_mask(preset, steps)) if preset else steps
        base = "turbo" if batch == 1 else "base"
        key = f"{base}_latent"  # a preset row without its uncached row in this run makes the uncached latent too
        extra = lambda: steps if preset and key not in ctx.state and not ctx.will_run(base) else 0  # noqa: E731
        return lambda: 1.3 * (computed + extra()) * f(batch) + 2

    rows = [("build", lambda: 5, row_build), ("eager", lambda: 2 + c * f(), row_eager),
            ("diffusers", lambda: 10 + 3 * c * f() * 1.15, row_diffusers),
            ("turbo", lambda: 3 + 2 * max(2, c - 1) * 8 * f() * 1.1, row_turbo)]
    rows += [(f"turbo-{p}", run_need(8, 1, p), whole_run(f"turbo-{p}", 8, 1.0, p)) for p in PRESETS]
    fp8_calls = 8 + sum(sum(masks.preset_mask(p, 8)) for p in PRESETS)  # its Turbo image, then one per preset
    rows += [("fp8", lambda: ctx.checkpoint_estimate() + 5 + load() + c * f() + fp8_calls * f() * 1.3, opened("fp8")),
             ("sage", lambda: 60, None), ("compiled", lambda: 150, None)]
    steps = ctx.args.base_steps
    rows += [("base", run_need(steps, 2, None), whole_run("base", steps, 4.0, None))]
    rows += [(f"base-{p}", run_need(steps, 2, p), whole_run(f"base-{p}", steps, 4.0, p)) for p in PRESETS]
    rows += [("int4", lambda: ctx.checkpoint_estimate("int4") + 8 + load() * 1.5 + 2 * c * f(), opened("int4")),
             ("int8", lambda: ctx.checkpoint_estimate("int8") + 8 + load() * 1.5 + 2 * c * f(), opened("int8")),
             ("gguf", lambda: ctx.checkpoint_estimate("gguf") + 10 + load() * 1.5 + 3 * c * f(), opened("gguf")),
             *[(fmt, lambda: ctx.checkpoint_estimate("comfy") + 8 + load() * 1.5 + 2 * c * f(), opened(fmt))
               for fmt in COMFY_ROWS],
             ("fuse-quant", lambda: 8 + 4 * c * f(), row_fuse_quant)]
    rows += offload_rows(ctx)
    rows += [("lora", lambda: 4 + load() / 2 + 2 * c * f(), row_lora),
             ("serve", lambda: serve_estimate(ctx), row_serve),
             ("serve-dp", lambda: serve_dp_estimate(ctx), row_serve_dp), ("comfy", lambda: 0.1, row_comfy),
             ("parts", lambda: 40 if ctx.dev.type == "cuda" else 5, row_parts),
             ("all-on", lambda: compile_estimate(ctx), None), ("flash", lambda: 30 if A.package_version("flash_attn")[0] else 0.0, None)]
    return rows


def compile_estimate(ctx) -> float:
    """all-on's seconds: from the compiled row's compile time when this run measured it (another graph, about
    as long to compile), else 150."""
    done = [r["compile_s"] for r in ctx.report.rows_named("compiled") if r.get("compile_s")]
    return 1.3 * done[0] + 30 if done else 150.0


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
    for dist in ("sageattention", "diffusers", "triton", "flash-attn", "fastapi", "uvicorn"):
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
    n = ctx.params
    env.update(size=args.size, params=n, width=args.width, height=args.height, text_tokens=args.text_tokens,
               typical_text=args.typical_text, flops=ctx.flops1, budget_s=args.budget)
    att = attention_flops(cfg, ctx.n_img, args.text_tokens)
    lines.append(f"model: {args.size} shape, {_count(n)} parameters, random weights, bf16 · {args.width}x{args.height} = "
                 f"{ctx.n_img} image + {args.text_tokens} text tokens (typical prompt: {args.typical_text}) · forward "
                 f"{ctx.flops1 / 1e12:.2f} TFLOP (attention {att / 1e12:.2f}) = "
                 f"{ctx.flops1 / (core.PHYSICAL_TFLOPS * 1e12) * 1e3:.1f} ms at {core.PHYSICAL_TFLOPS:.0f} TFLOP/s · "
                 f"budget {args.budget:.0f} s")
    return lines, env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="8b (default with a GPU) or tiny (the CPU rehearsal); small/medium")
    ap.add_argument("--width", type=int, default=None, help="default 1024 for 8b, 256 otherwise")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--text-tokens", type=int, default=None, help="default 128 for 8b (4096 + 128 = 66 blocks of 64), 32 otherwise")
    ap.add_argument("--typical-text", type=int, default=None,
                    help="a typical prompt's text tokens for the attention rows (default 77 for 8b: 4173 keys, not a "
                         "multiple of 64; 27 otherwise)")
    ap.add_argument("--repeat", type=int, default=None, help="timed forwards per row, after one warm-up (default 3; 1 on CPU)")
    ap.add_argument("--base-steps", type=int, default=None,
                    help="steps of the Base rows (default 50 with a GPU; 10 on CPU: the same code, a shorter rehearsal)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all rows (gpu_check.sh sets it from its hard stop)")
    ap.add_argument("--compile-mode", default="auto",
                    help="torch.compile mode of the compiled rows: auto (default) = the engine's, what users get "
                         "(max-autotune-no-cudagraphs on a GPU); default = plain inductor; or any torch.compile mode")
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


def rerun_advice(ctx, names) -> str:
    """The command for the rows that did not finish, and when it can run: the machine stays warm ~30 s after
    a call; a fresh one costs 1-2 minutes of the session's 15, and none starts with under 4 minutes left."""
    recs = []
    for n in names:
        recs += ctx.report.rows_named(n)
    done = {r["row"] for r in recs if r["status"] in ("measured", "n/a")}
    todo = [n for n in names if n not in done and n not in ("build", "eager") and n not in ctx.args.skip
            and (not ctx.args.only or n in ctx.args.only)]
    if not todo:
        return "rerun: nothing left to measure"
    cmd = f"bash bench/gpu_check.sh --only {','.join(todo)}"
    return (f"rerun ({len(todo)} row(s) not measured): with L = budget_left_s of the reply's lease, call at once (within "
            f"~30 s the machine is still warm, no start): run(command=\"GPU_CHECK_TIMEOUT=$((L - 40)) {cmd}\", "
            f"carry=[\".whl\"], timeout_s=L - 30), then give_back; if it is already cold, only when L >= 360: "
            f"GPU_CHECK_TIMEOUT=L - 150 (the start costs 1-2 minutes). Rows not measured: {', '.join(todo)}")


def with_defaults(args) -> torch.device:
    """Fill in what depends on the machine (size, shapes, repeats, compile backend); returns the device."""
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
    args.typical_text = args.typical_text or (77 if big else max(1, args.text_tokens - 5))
    args.compile_backend = args.compile_backend or ("inductor" if dev.type == "cuda" else "aot_eager")
    args.repeat = args.repeat or (3 if dev.type == "cuda" else 1)
    args.base_steps = args.base_steps or (50 if dev.type == "cuda" else 10)
    return dev


def main(argv=None):
    args = parse_args(argv)
    dev = with_defaults(args)
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
    env["plan_s"] = {n: round(need(), 1) for n, need, _ in rows}
    lines.append("plan (s, estimated before the run): " + ", ".join(f"{n} {s:.0f}" for n, s in env["plan_s"].items())
                 + f" = {sum(env['plan_s'].values()):.0f}")
    report.header(lines, env)

    for name, need, fn in rows:
        if name not in ("build", "eager") and ((args.only and name not in args.only) or name in args.skip):
            report.row(name, "skipped", notes="--skip" if name in args.skip else "not in --only")
            continue
        if name == "flash" and not A.package_version("flash_attn")[0]:
            report.row("flash", "n/a", "flash attention", notes="flash-attn is not installed: PyPI has only its sdist, "
                       "whose CUDA build takes far longer than the GPU window, so it is not carried")
            continue
        if fn is None:
            ctx.release()  # the GPU to the worker; this process keeps only its CUDA context
        est = need()
        if ctx.left() < est:
            report.row(name, "skipped", notes=f"{ctx.left():.0f} s of the budget left, the row needs ~{est:.0f} s")
            continue
        if fn is not None:
            guarded(ctx, name, fn)
            continue
        run_worker(ctx, name, min(ctx.left() - 5, WORKER_CAP[name]))
    ctx.release()
    shutil.rmtree(os.path.dirname(args.ref), ignore_errors=True)
    if ctx.state.get("ckpt"):
        shutil.rmtree(os.path.dirname(ctx.state["ckpt"]), ignore_errors=True)
    advice = rerun_advice(ctx, [n for n, _, _ in rows])
    with open(os.path.join(args.out, "rerun.txt"), "w", encoding="utf-8") as f:
        f.write(advice + "\n")
    report.footer(advice)
    if args.size == "8b" and args.height == args.width == 1024:  # the shape of docs/memory.md's predicted table
        report.footer(beside([r for n in OFFLOAD_ROWS for r in report.rows_named(n)]))
    report.footer(f"wall time {time.perf_counter() - core.T0:.0f} s (python; set-up before it is in gpu_check.log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
