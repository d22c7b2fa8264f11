"""`sgld` command line: generate images and benchmark the engine."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, NamedTuple

import torch

from .sampling import MAX_IMAGE_SIDE, SAMPLERS, SCHEDULERS

MAX_THREADS = 1024  # --threads: generous; more only oversubscribes the cores


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, help="weight dtype: bf16, fp16, fp32 (default: as stored; fp32 for random models)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "sage", "flash", "math"],
                   help="attention backend (default auto: sage, then flash, then sdpa; unavailable ones fall back to sdpa with a warning)")
    p.add_argument("--compile", nargs="?", const="static", default="off", choices=["off", "static", "dynamic"],
                   help="regional torch.compile of the DiT block (--compile = static: one graph per resolution; "
                        "dynamic: one extra graph covers all new resolutions)")
    p.add_argument("--quant", default=None, choices=["fp8", "int4", "int4-g64"],
                   help="weight-only quantization of the block linears at load (pre-quantized files load quantized anyway)")
    p.add_argument("--offload", default="none", choices=["none", "layerwise", "auto"],
                   help="layer-wise offload: block weights in pinned CPU memory, streamed through --resident-layers "
                        "device buffers (auto: only when the GPU's free memory is below the model + working memory)")
    p.add_argument("--resident-layers", type=int, default=2,
                   help="device buffers for layer-wise offload (default 2: one computing, one loading)")
    par = p.add_argument_group("parallel (docs/parallel.md): ranks = tp x ulysses x ring x (2 with --cfg-parallel)")
    par.add_argument("--tp", type=int, default=1, help="tensor parallel degree (heads and MLP split across ranks)")
    par.add_argument("--ulysses-degree", type=int, default=1, help="Ulysses sequence parallel degree (all-to-all over heads)")
    par.add_argument("--ring-degree", type=int, default=1, help="Ring sequence parallel degree (KV passed around, LSE merge)")
    par.add_argument("--cfg-parallel", action="store_true", help="cond and uncond on different ranks (needs --cfg > 1)")
    par.add_argument("--num-gpus", type=int, default=None,
                     help="ranks in all (GPUs; on a CPU machine the number of gloo processes); must equal the product of "
                          "the degrees; alone it means Ulysses over that many ranks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgld", description="SGLDiffusion: fast ERNIE-Image inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="time the DiT forward and a whole sampling run",
                       description="Time one DiT forward and a whole sampling run, for a model file or a random model of a named size.")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", help="ERNIE-Image .safetensors file or diffusers folder")
    src.add_argument("--size", default="tiny", help="random model of a named size: tiny, small, medium, 8b (the release shape; for GPUs)")
    b.add_argument("--width", type=int, default=None, help="image width in pixels (latent = width/16; default 1024 for 8b, 256 otherwise)")
    b.add_argument("--height", type=int, default=None, help="image height in pixels")
    b.add_argument("--text-tokens", type=int, default=64, help="prompt length in tokens")
    b.add_argument("--steps", type=int, default=8, help="sampling steps for the whole-run timing (0: skip it)")
    b.add_argument("--cfg", type=float, default=1.0, help="guidance scale of the whole run (>1 adds the negative branch)")
    b.add_argument("--repeat", type=int, default=3, help="timed forwards (after one warm-up)")
    b.add_argument("--json", action="store_true", help="print one line of JSON")
    _add_common(b)

    g = sub.add_parser("generate", help="make an image from a prompt",
                       description="Make an image from a prompt (the embedded demo model by default).")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative", default="")
    g.add_argument("--out", default="out.png", help="PNG file to write (replaced whole: written to a temporary file first)")
    g.add_argument("--seed", type=int, default=0, help="noise seed, 0 to 2**64-1 (ComfyUI's range)")
    g.add_argument("--steps", type=int, default=None, help="sampling steps, 1 to 10000 (default: the model's, demo 30, ERNIE-Image 50)")
    g.add_argument("--cfg", type=float, default=None, help="guidance scale, 0 to 100 (default: the model's, demo 3, ERNIE-Image 4)")
    g.add_argument("--sampler", default="euler", choices=SAMPLERS)
    g.add_argument("--scheduler", default="simple", choices=SCHEDULERS)
    g.add_argument("--json", action="store_true", help="print one line of JSON with settings and timings")
    g.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH",
                   help="apply a LoRA (.safetensors; diffusers/PEFT, ai-toolkit, kohya or ComfyUI keys) at STRENGTH "
                        "(default 1.0); repeat the flag to stack several")
    ext = g.add_argument_group("ERNIE-Image files instead of the demo (all three together; needs transformers and diffusers)")
    ext.add_argument("--model", help="ERNIE-Image DiT: .safetensors file or diffusers transformer/ folder")
    ext.add_argument("--text-encoder", help="text encoder folder (HF text_encoder/; tokenizer inside or in the sibling tokenizer/)")
    ext.add_argument("--vae", help="Flux2 VAE folder (HF vae/)")
    ext.add_argument("--width", type=int, default=None,
                     help=f"image width in pixels, up to {MAX_IMAGE_SIDE} (default 1024; the demo makes 64x64 only)")
    ext.add_argument("--height", type=int, default=None, help="image height in pixels (as --width)")
    _add_common(g)
    from .features.cache import add_cli_arguments

    add_cli_arguments(g)

    q = sub.add_parser("quantize", help="write an FP8 / INT4 copy of a model file",
                       description="Quantize the DiT blocks' linear layers of an ERNIE-Image checkpoint (bf16/fp16/fp32, "
                                   "or already quantized) and write a .safetensors file that the loader (and the "
                                   "SGLDiffusion Model Loader node) reads back quantized. One tensor in memory at a time.")
    q.add_argument("input", help="ERNIE-Image .safetensors file or diffusers folder")
    q.add_argument("output", help="the .safetensors file to write")
    q.add_argument("--format", required=True, choices=["fp8", "int4", "int4-g64"],
                   help="fp8: e4m3, one scale per output channel; int4: groups of 128 (int4-g64: groups of 64)")
    q.add_argument("--dtype", default=None, help="dtype of the tensors left unquantized: bf16, fp16, fp32 (default: as stored)")
    q.add_argument("--json", action="store_true", help="print one line of JSON")
    return parser


def engine_config(args, **kw):
    from .config import EngineConfig

    return EngineConfig(dtype=args.dtype, device=args.device, attention=args.attention,
                        compile=False if args.compile == "off" else args.compile, quant=args.quant,
                        offload=getattr(args, "offload", "none"), resident_layers=getattr(args, "resident_layers", 2),
                        tp=getattr(args, "tp", 1), ulysses_degree=getattr(args, "ulysses_degree", 1),
                        ring_degree=getattr(args, "ring_degree", 1), cfg_parallel=getattr(args, "cfg_parallel", False),
                        num_gpus=getattr(args, "num_gpus", None), **kw)


def _setup_logging() -> None:
    """The engine's choices (attention backend, fp8 matmul, compile) and its fallback warnings go to
    stderr as one line each: ``sgld: attention: sdpa (...)``, ``sgld: warning: ...``."""
    import logging

    logger = logging.getLogger("sgld")
    if not logger.handlers:
        class Format(logging.Formatter):
            def format(self, record):
                kind = "warning: " if record.levelno >= logging.WARNING else ""
                return f"sgld: {kind}{record.getMessage()}"

        class Stderr(logging.StreamHandler):  # the current sys.stderr at each record
            stream = property(lambda self: sys.stderr, lambda self, value: None)

        h = Stderr()
        h.setFormatter(Format())
        logger.addHandler(h)
        logger.setLevel(logging.INFO)


def _random_engine(size: str, dtype, device, config=None):
    """A random model of a named size, materialized once in ``dtype`` (no float32 copy) where it will
    live: on ``device``, or in CPU memory when layer-wise offload streams it from there (so the whole
    model never has to fit on the GPU first)."""
    from .features import offload
    from .engine import Engine
    from .local import LocalForward
    from .models.random_weights import SIZES, random_model_on_device

    if size not in SIZES:
        raise SystemExit(f"sgld bench: --size '{size}' is unknown; choose one of {', '.join(SIZES)}")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: torch.float32}.get(dtype)
    if dt is None:
        raise SystemExit(f"sgld bench: --dtype '{dtype}' is not supported; choose one of bf16, fp16, fp32")
    decision, build_on = None, device
    if config is not None and config.offload != "none":
        decision = offload.choose_offload(config.offload, device, _random_model_bytes(SIZES[size], dt, config.quant))
        if decision[0] == "layerwise":
            build_on = "cpu"
    model = random_model_on_device(SIZES[size], build_on, dt, seed=0)
    return Engine(LocalForward(model, config, offload_decision=decision), config, source=f"random:{size}")


def _random_model_bytes(cfg, dtype: torch.dtype, quant) -> int:
    """Bytes of a random model at rest once quantized (as offload.estimate_checkpoint_bytes counts a file)."""
    from .io.checkpoint import build_model
    from .features.quant import is_block_linear, parse_format

    kind, group = parse_format(quant)
    total = 0
    for name, p in build_model(cfg, "meta").named_parameters():
        n = p.numel()
        if kind and name.endswith(".weight") and is_block_linear(name.rsplit(".", 1)[0]):
            total += n if kind == "fp8" else n // 2 + n * 4 // max(1, group)
        else:
            total += n * dtype.itemsize
    return total


def _reset_peak_memory(dev: torch.device) -> None:
    """Start the peak-memory window of the timed part (the build's peak is not the run's)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def cmd_bench(args) -> dict:
    from .models.random_weights import random_checkpoint
    from .router import open_engine

    t0 = time.perf_counter()
    config = engine_config(args)
    if args.model:
        eng = open_engine(args.model, config)
    elif config.world_size > 1:  # workers load from a file: write the random model to a temporary one
        eng = open_engine(random_checkpoint(args.size, args.dtype), config)
    else:
        eng = _random_engine(args.size, args.dtype, args.device, config)
    load_s = time.perf_counter() - t0
    cfg = eng.model_config
    default_px = 1024 if args.size == "8b" else 256
    h, w = (args.height or default_px) // 16, (args.width or default_px) // 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.in_channels, h, w, generator=g)
    text = torch.randn(args.text_tokens, cfg.text_in_dim, generator=g)
    dev = eng.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        xt, tb, ln = x.to(dev), torch.tensor([500.0], device=dev), torch.tensor([args.text_tokens], device=dev)
        tt = text[None].to(dev, eng.forward.dtype)
        forward = eng.dit_forward  # parallel: one call through the workers
        forward(xt, tb, tt, ln)
        sync()
        resident_gb = torch.cuda.memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else None
        _reset_peak_memory(dev)  # after the build and the warm-up: the peak of the timed forwards and run
        times = []
        for _ in range(max(1, args.repeat)):
            s = time.perf_counter()
            forward(xt, tb, tt, ln)
            sync()
            times.append(time.perf_counter() - s)
    described = eng.describe()
    result = {"model": eng.source, "params": described["params"], "dtype": described["dtype"], "device": str(dev),
              "latent": [cfg.in_channels, h, w], "attention": eng.attention_backend, "compile": config.compile,
              "quant": config.quant,
              "image_tokens": h * w // cfg.patch_size ** 2, "text_tokens": args.text_tokens, "load_seconds": round(load_s, 3),
              "forward_ms_median": round(1000 * sorted(times)[len(times) // 2], 2), "forward_ms_min": round(1000 * min(times), 2)}
    if args.steps > 0:
        s = time.perf_counter()
        eng.sample(torch.zeros(1, cfg.in_channels, h, w), [text], [text[:1]] if args.cfg != 1.0 else None,
                   seed=0, steps=args.steps, cfg=args.cfg)
        sync()
        result.update({"steps": args.steps, "cfg": args.cfg, "sampling_seconds": round(time.perf_counter() - s, 3),
                       **{k: v for k, v in eng.last_run.to_dict().items() if k in ("steps_total", "steps_computed")}})
    described = eng.describe()  # after the runs: the offload counters
    if described["offload"] is not None:
        result["offload"] = described["offload"]
    if described["parallel"] is not None:
        result["parallel"] = described["parallel"]["plan"]
    if eng.warnings:
        result["warnings"] = list(eng.warnings)
    if dev.type == "cuda":
        result["peak_vram_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
        result["resident_vram_gb"] = round(resident_gb, 2)  # allocated when timing started (weights + buffers)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>18}: {v}")
    return result


def lora_specs(args) -> list:
    """``--lora FILE:STRENGTH`` (repeatable) -> [(path, strength), ...] for ``Engine.set_loras``."""
    from .features.lora import parse_spec

    return [parse_spec(s) for s in getattr(args, "lora", None) or []]


class GenerateParts(NamedTuple):
    """What ``sgld generate`` needs from a model: the demo's or ERNIE-Image files'."""
    engine: object
    encode: Callable  # prompt -> conditioning (list of [tokens, features])
    empty_latent: torch.Tensor
    decode: Callable  # latent -> uint8 image [H, W, 3]
    model_path: str
    default_steps: int
    default_cfg: float


def _demo_parts(args) -> GenerateParts:
    import dataclasses

    from .models import demo as demo_pkg
    from .router import open_engine

    demo = demo_pkg.load_demo(dtype=args.dtype or torch.float32, cached=False)  # its text encoder and tokenizer
    for name in ("prompt", "negative"):
        warning = demo.tokenizer.unknown_words_warning(getattr(args, name), where=f" in --{name}")
        if warning:
            print(f"sgld: warning: {warning}", file=sys.stderr)
    # the DiT through the same router as ERNIE-Image files: several ranks (--num-gpus, --tp, ...) run it
    # in worker processes; the demo is stored in fp16 and runs in fp32 unless --dtype says otherwise
    config = dataclasses.replace(engine_config(args, cache=_cache_config(args)), dtype=args.dtype or "fp32")
    eng = open_engine(demo.path, config)
    return GenerateParts(eng, lambda p: demo.encode([p]), demo.empty_latent(1), lambda z: demo.decode(z)[0], demo.path,
                         demo_pkg.DEFAULT_STEPS, demo_pkg.DEFAULT_CFG)


ERNIE_STEPS, ERNIE_CFG = 50, 4.0  # ERNIE-Image Base's defaults (Turbo: --steps 8 --cfg 1)
ERNIE_SIZE = 1024  # default --width / --height for ERNIE-Image files


def _ernie_parts(args) -> GenerateParts:
    """The same parts from ERNIE-Image files (engine/models/external.py)."""
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "text_encoder", "vae") if not getattr(args, n)]
    if missing:
        raise ValueError(f"--model, --text-encoder and --vae go together; missing {', '.join(missing)}")
    from .models.external import Flux2VAE, TextEncoder
    from .router import open_engine

    vae = Flux2VAE.from_folder(args.vae, device=args.device)
    latent = vae.empty_latent(args.width or ERNIE_SIZE, args.height or ERNIE_SIZE)
    te = TextEncoder.from_folder(args.text_encoder, device=args.device)
    eng = open_engine(args.model, engine_config(args, cache=_cache_config(args)))
    return GenerateParts(eng, lambda p: [te.encode(p)], latent, lambda z: vae.decode(z)[0].numpy(), args.model,
                         ERNIE_STEPS, ERNIE_CFG)


def cmd_generate(args) -> dict:
    """A picture from a prompt (the embedded demo model, or ERNIE-Image files): PNG with ComfyUI-style text metadata."""
    t0 = time.perf_counter()
    external = uses_ernie_files(args)
    steps, cfg = check_generate_args(args)
    parts = (_ernie_parts if external else _demo_parts)(args)
    eng = parts.engine
    if args.loras:
        eng.set_loras(args.loras)
    cond, uncond = parts.encode(args.prompt), parts.encode(args.negative)
    load_s = time.perf_counter() - t0
    settings = {"prompt": args.prompt, "negative": args.negative, "seed": args.seed, "steps": steps, "cfg": cfg,
                "sampler": args.sampler, "scheduler": args.scheduler, "model": os.path.basename(parts.model_path)}
    bar = None if args.json else _progress_bar(steps)
    try:
        latent = eng.sample(parts.empty_latent, cond, uncond, seed=args.seed, steps=steps, cfg=cfg, sampler=args.sampler,
                            scheduler=args.scheduler, callback=(lambda i, n, x, d: bar.update(1)) if bar else None)
    finally:
        if bar:
            bar.close()
    image = parts.decode(latent)
    stats = eng.last_run.to_dict()
    try:
        _save_png(image, args.out, settings, stats)
    except OSError as e:
        raise ValueError(f"--out '{args.out}': could not write it: {e.strerror or e}") from None
    result = {**settings, "out": args.out, "load_seconds": round(load_s, 3),
              "sampling_seconds": stats["sampling_seconds"], "steps_total": stats["steps_total"],
              "steps_computed": stats["steps_computed"], "step_mask": stats["step_mask"]}
    if "speedup" in stats:
        result["speedup"] = stats["speedup"]
    parallel = eng.describe()["parallel"]
    if parallel is not None:  # several ranks: which, and the worker processes that ran the DiT
        result["parallel"] = parallel["plan"]
        result["worker_pids"] = parallel["worker_pids"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"wrote {args.out} ({image.shape[1]}x{image.shape[0]}): load {load_s:.2f} s, sampling "
              f"{stats['sampling_seconds']:.2f} s, {stats['steps_computed']}/{stats['steps_total']} steps computed")
    return result


def _cache_config(args):
    from .features.cache import from_cli_args

    return from_cli_args(args)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="sampling", unit="step", file=sys.stderr, leave=False)


def _save_png(image, path: str, settings: dict, stats: dict) -> None:
    """Like ComfyUI's SaveImage: the settings as JSON in the PNG's "prompt" text chunk. Written whole or not
    at all (a temporary file in the same folder, then renamed): the previous picture survives any failure."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from .io.atomic import atomic_write

    info = PngInfo()
    info.add_text("prompt", json.dumps(settings))
    info.add_text("sgld", json.dumps({k: stats[k] for k in ("steps_total", "steps_computed", "step_mask")}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, suffix=".png.part") as f:
        Image.fromarray(image).save(f, format="PNG", pnginfo=info)


def check_output_path(option: str, path: str, extensions: tuple) -> None:
    """Refuse an output path that cannot be written, before any work (a folder, a missing or read-only
    parent, a parent that is a file, a name without one of ``extensions``)."""
    if os.path.isdir(path):
        raise ValueError(f"{option} '{path}' is a folder; give a file name ending in {' or '.join(extensions)}")
    if not path.lower().endswith(extensions):
        raise ValueError(f"{option} '{path}' must end in {' or '.join(extensions)} (the format this command writes)")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):  # folders that do not exist yet are created
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{option} '{path}': '{existing}' is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} '{path}': the folder '{existing}' is not writable")


def uses_ernie_files(args) -> bool:
    return any(getattr(args, n, None) for n in ("model", "text_encoder", "vae"))


def check_generate_args(args) -> tuple:
    """Every option of ``sgld generate`` checked before anything loads (ValueError naming the option and
    what is allowed). Returns the run's (steps, cfg): the given values or the model's defaults."""
    from .models import demo as demo_pkg
    from .inputs import check_sampling_settings, check_seed

    external = uses_ernie_files(args)
    if external:
        for name in ("width", "height"):
            value = getattr(args, name)
            if value is not None and not 1 <= value <= MAX_IMAGE_SIDE:
                raise ValueError(f"--{name} must be from 1 to {MAX_IMAGE_SIDE} pixels (got {value}; ERNIE-Image's "
                                 "largest documented size is 2048x2048)")
    else:
        for name in ("width", "height"):
            value = getattr(args, name)
            if value is not None and value != demo_pkg.IMAGE_SIZE:
                raise ValueError(f"--{name} {value}: the demo model makes {demo_pkg.IMAGE_SIZE}x{demo_pkg.IMAGE_SIZE} "
                                 "pictures only (other sizes need ERNIE-Image files: --model --text-encoder --vae)")
    steps = args.steps if args.steps is not None else (ERNIE_STEPS if external else demo_pkg.DEFAULT_STEPS)
    cfg = args.cfg if args.cfg is not None else (ERNIE_CFG if external else demo_pkg.DEFAULT_CFG)
    check_sampling_settings(steps=steps, cfg=cfg, names={"steps": "--steps", "cfg": "--cfg"})
    check_seed(args.seed, "--seed")
    check_output_path("--out", args.out, (".png",))
    engine_config(args)  # the parallel degrees against each other (ParallelConfigError)
    return steps, cfg


def check_common_args(args) -> None:
    """The options every command shares, checked before anything loads: --device names a device this machine
    has, --threads is 0 (torch's choice) or a count, the parallel degrees and --resident-layers are counts."""
    for name in ("tp", "ulysses_degree", "ring_degree", "resident_layers"):
        value = getattr(args, name, 1)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    gpus = getattr(args, "num_gpus", None)
    if gpus is not None and gpus < 1:
        raise ValueError(f"--num-gpus must be at least 1 (got {gpus}; leave it out for the product of the degrees)")
    threads = getattr(args, "threads", 0)
    if threads < 0 or threads > MAX_THREADS:
        raise ValueError(f"--threads must be 0 (torch's choice) or a count from 1 to {MAX_THREADS} (got {threads})")
    device = getattr(args, "device", "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device '{device}' is not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is available here (use --device cpu)")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"--device {device}: no '{dev.type}' device is available here (use cpu or cuda)")


def cmd_quantize(args) -> dict:
    from .features.quant import quantize_file

    check_output_path("output", args.output, (".safetensors",))
    t0 = time.perf_counter()
    summary = quantize_file(args.input, args.output, args.format, dtype=args.dtype)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(summary))
    else:
        ratio = f" ({summary['output_bytes'] / summary['input_bytes']:.2f}x)" if summary.get("input_bytes") else ""
        print(f"wrote {args.output}: {summary['layers']} linear layers as {args.format}, "
              f"{summary['output_bytes'] / 2 ** 20:.1f} MiB{ratio}")
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    try:
        check_common_args(args)
    except ValueError as e:
        print(f"sgld {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    elif args.command == "generate" and args.device == "cpu":
        # the demo model's matrices are tiny: a second thread costs more in synchronisation than it
        # computes, and on a busy machine it waits for a core (measured 10-20x slower)
        torch.set_num_threads(1)
    try:
        return _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT; --out keeps its old content
        print(f"sgld {args.command}: interrupted", file=sys.stderr)
        return 130


def _run_command(args) -> int:
    from .errors import CheckpointError, InputError, ParallelWorkerError

    try:
        if args.command == "bench":
            cmd_bench(args)
        elif args.command == "generate":
            args.loras = lora_specs(args)
            cmd_generate(args)
        elif args.command == "quantize":
            cmd_quantize(args)
    except (CheckpointError, InputError, ValueError, ParallelWorkerError, OSError) as e:
        print(f"sgld {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
