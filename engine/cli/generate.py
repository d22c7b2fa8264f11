"""`sgld generate`: a picture from a prompt (the embedded demo model, or ERNIE-Image files), written as a PNG
with ComfyUI-style text metadata."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable, NamedTuple

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from tqdm import tqdm

from ..features.lora import parse_spec
from ..io.atomic import atomic_write
from ..models import demo as demo_pkg
from ..models.external import Flux2VAE, TextEncoder
from ..router import open_engine
from ..sampling import MAX_IMAGE_SIDE
from ..sampling_options import from_flags
from .common import (
    add_cache_arguments,
    add_engine_arguments,
    add_sampling_arguments,
    cache_config,
    check_output_path,
    engine_config,
)

SAMPLING = ("seed", "steps", "cfg", "sampler", "scheduler", "shift")  # the sampling options it has flags for
ERNIE_SIZE = 1024  # default --width / --height for ERNIE-Image files


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="make an image from a prompt",
                       description="Make an image from a prompt (the embedded demo model by default).")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative", default="")
    g.add_argument("--out", default="out.png", help="PNG file to write (replaced whole: written to a temporary file first)")
    add_sampling_arguments(g, SAMPLING)
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
    add_engine_arguments(g)
    add_cache_arguments(g)


def lora_specs(args) -> list:
    """``--lora FILE:STRENGTH`` (repeatable) -> [(path, strength), ...] for ``Engine.set_loras``."""
    return [parse_spec(s) for s in getattr(args, "lora", None) or []]


class GenerateParts(NamedTuple):
    """What ``sgld generate`` needs from a model: the demo's or ERNIE-Image files'."""
    engine: object
    encode: Callable  # prompt -> conditioning (list of [tokens, features])
    empty_latent: Callable  # (width, height) -> zeros [1, C, h, w]
    decode: Callable  # latent -> uint8 image [H, W, 3]
    model_path: str
    default_size: int  # pixels on each side


def make_parts(args) -> GenerateParts:
    """The parts of the model the flags name: ERNIE-Image files (--model --text-encoder --vae) or the demo."""
    return (_ernie_parts if uses_ernie_files(args) else _demo_parts)(args)


def _demo_parts(args) -> GenerateParts:
    demo = demo_pkg.load_demo(dtype=args.dtype or torch.float32, cached=False)  # its text encoder and tokenizer
    for name in ("prompt", "negative"):  # the prompts given on the command line (sgld serve has none)
        warning = demo.tokenizer.unknown_words_warning(getattr(args, name, ""), where=f" in --{name}")
        if warning:
            print(f"sgld: warning: {warning}", file=sys.stderr)
    # the DiT through the same router as ERNIE-Image files: several ranks (--num-gpus, --tp, ...) run it
    # in worker processes; the demo is stored in fp16 and runs in fp32 unless --dtype says otherwise
    config = dataclasses.replace(engine_config(args, cache=cache_config(args)), dtype=args.dtype or "fp32")
    eng = open_engine(demo.path, config)
    return GenerateParts(eng, lambda p: demo.encode([p]), lambda w, h: demo.empty_latent(1), lambda z: demo.decode(z)[0],
                         demo.path, demo_pkg.IMAGE_SIZE)


def _ernie_parts(args) -> GenerateParts:
    """The same parts from ERNIE-Image files (engine/models/external.py)."""
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "text_encoder", "vae") if not getattr(args, n)]
    if missing:
        raise ValueError(f"--model, --text-encoder and --vae go together; missing {', '.join(missing)}")
    vae = Flux2VAE.from_folder(args.vae, device=args.device)
    te = TextEncoder.from_folder(args.text_encoder, device=args.device)
    eng = open_engine(args.model, engine_config(args, cache=cache_config(args)))
    return GenerateParts(eng, lambda p: [te.encode(p)], vae.empty_latent, lambda z: vae.decode(z)[0].numpy(), args.model,
                         ERNIE_SIZE)


def cmd_generate(args) -> dict:
    """A picture from a prompt (the embedded demo model, or ERNIE-Image files): PNG with ComfyUI-style text metadata."""
    t0 = time.perf_counter()
    run = check_generate_args(args)
    parts = make_parts(args)
    eng = parts.engine
    if args.loras:
        eng.set_loras(args.loras)
    cond, uncond = parts.encode(args.prompt), parts.encode(args.negative)
    load_s = time.perf_counter() - t0
    settings = {"prompt": args.prompt, "negative": args.negative, **run, "model": os.path.basename(parts.model_path)}
    bar = None if args.json else _progress_bar(run["steps"])
    try:
        empty = parts.empty_latent(args.width or parts.default_size, args.height or parts.default_size)
        latent = eng.sample(empty, cond, uncond, **run, callback=(lambda i, n, x, d: bar.update(1)) if bar else None)
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
              "sampling_seconds": stats["sampling_seconds"], "model_calls": stats["model_calls"],
              "calls_computed": stats["calls_computed"], "step_mask": stats["step_mask"]}
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
              f"{stats['sampling_seconds']:.2f} s, {stats['calls_computed']}/{stats['model_calls']} steps computed")
    return result


def _progress_bar(total: int):
    return tqdm(total=total, desc="sampling", unit="step", file=sys.stderr, leave=False)


def _save_png(image, path: str, settings: dict, stats: dict) -> None:
    """Like ComfyUI's SaveImage: the settings as JSON in the PNG's "prompt" text chunk. Written whole or not
    at all (a temporary file in the same folder, then renamed): the previous picture survives any failure."""
    info = PngInfo()
    info.add_text("prompt", json.dumps(settings))
    info.add_text("sgld", json.dumps({k: stats[k] for k in ("model_calls", "calls_computed", "step_mask")}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, suffix=".png.part") as f:
        Image.fromarray(image).save(f, format="PNG", pnginfo=info)


def uses_ernie_files(args) -> bool:
    return any(getattr(args, n, None) for n in ("model", "text_encoder", "vae"))


def model_source(args) -> str:
    """The DiT file or folder the flags name (the demo's file without --model): what decides the defaults."""
    return args.model if uses_ernie_files(args) and args.model else demo_pkg.DEMO_WEIGHTS


def check_generate_args(args) -> tuple:
    """Every option of ``sgld generate`` checked before anything loads (ValueError naming the option and
    what is allowed). Returns the run's sampling settings (``SAMPLING``): the flags', else the model's defaults."""
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
    run = from_flags(args, model_source(args), SAMPLING)
    check_output_path("--out", args.out, (".png",))
    engine_config(args)  # the engine's flags and the parallel degrees against each other
    cache_config(args)
    return run
