"""`sgld generate`: a picture from a prompt (the embedded demo model, or ERNIE-Image files), written as a PNG
with ComfyUI-style text metadata."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import unicodedata
from typing import NamedTuple

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from tqdm import tqdm

from ..features.cache import resolve_config
from ..features.lora import parse_spec
from ..image_parts import BundledParts, FileParts, ImageParts
from ..io.atomic import atomic_write
from ..models.bundle import bundle_named, bundle_of_file, named_file
from ..options import declared
from ..release import dit_family, picture_shift, resolve_release
from ..router import open_engine
from ..sampling import MAX_IMAGE_SIDE
from ..sampling_options import SamplingOptions, from_flags
from ..text_to_image import Picture, sample_request
from .common import (
    add_cache_arguments,
    add_engine_arguments,
    add_pe_arguments,
    add_release_arguments,
    add_sampling_arguments,
    add_text_encoder_arguments,
    cache_config,
    check_image_sides,
    check_output_path,
    check_pe_args,
    engine_config,
    file_families,
    load_prompt_enhancer,
    use_threads,
)

SAMPLING = tuple(name for name, opt in declared(SamplingOptions).items() if opt.flag)  # the options it has flags for
DEFAULT_OUT = "out.png"
DEFAULT_MODEL = "demo"  # what runs without model flags: the embedded demo (a bundle's name)
SAVE_OUTPUT_DIR = "outputs"  # SGLang's default --output-path


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="make an image from a prompt",
                       description="Make an image from a prompt (the embedded demo model by default).")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative", default="")
    g.add_argument("--out", default=None, help=f"PNG file to write (default {DEFAULT_OUT}; replaced whole: written to a "
                                               "temporary file first)")
    g.add_argument("--save-output", action="store_true",
                   help="SGLang's spelling: write the picture under a generated name in --output-path, as SGLang "
                        "does (<prompt>_<YYYYmmdd-HHMMSS>_<settings hash>.png); --out still names the file if given")
    g.add_argument("--output-path", default=SAVE_OUTPUT_DIR, help=f"the folder of --save-output (default {SAVE_OUTPUT_DIR}/)")
    add_sampling_arguments(g, SAMPLING)
    g.add_argument("--json", action="store_true", help="print one line of JSON with settings and timings")
    g.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH",
                   help="apply a LoRA (.safetensors; diffusers/PEFT, ai-toolkit, kohya or ComfyUI keys) at STRENGTH "
                        "(default 1.0); repeat the flag to stack several")
    ext = g.add_argument_group(f"{file_families()} files instead of the demo (--model-path, or all three of --model "
                               "--text-encoder --vae; needs transformers and diffusers)")
    add_release_arguments(ext)
    ext.add_argument("--model", help=f"{file_families()} DiT: .safetensors file or diffusers transformer/ folder; 'demo-turbo': "
                                     "the embedded demo distilled to 8 steps at cfg 1 (36 blocks)")
    add_text_encoder_arguments(ext, "text encoder folder (HF text_encoder/; tokenizer inside or in the sibling "
                                    "tokenizer/) or single file (ComfyUI's; its config.json and tokenizer beside it)")
    ext.add_argument("--vae", help="VAE folder (HF vae/) or single file (ComfyUI's flux2-vae.safetensors, ae.safetensors)")
    ext.add_argument("--width", type=int, default=None,
                     help=f"image width in pixels, up to {MAX_IMAGE_SIDE} (default 1024; the demo makes 64x64 only)")
    ext.add_argument("--height", type=int, default=None, help="image height in pixels (as --width)")
    add_pe_arguments(g)
    add_engine_arguments(g)
    add_cache_arguments(g)


def lora_specs(args) -> list:
    """``--lora FILE:STRENGTH`` (repeatable) -> [(path, strength), ...] for ``Engine.set_loras``."""
    return [parse_spec(s) for s in getattr(args, "lora", None) or []]


class LoadedModel(NamedTuple):
    """The model the flags name: its engine, its image parts (engine/image_parts.py) and the DiT's file."""
    engine: object
    parts: ImageParts
    model_path: str


def release_of(args):
    """The release --model-path names (engine/release.py, resolved once per command), or None."""
    if getattr(args, "model_path", None) is None:
        return None
    if getattr(args, "_release", None) is None:
        if args.model:
            raise ValueError("--model-path and --model name the model twice; give one (--text-encoder / --vae may "
                             "replace the release's parts)")
        args._release = resolve_release(args.model_path, text_encoder=args.text_encoder, vae=args.vae)
    return args._release


def bundled_dit(args):
    """The DiT file that runs with a bundled model's own text encoder and codec (engine/models/bundle.py), or None for
    a family's files: the demo's (no model flags, or --model-path demo), or a --model of its shapes given without
    --text-encoder / --vae (a GGUF or quantized copy of the demo: `sgld quantize demo demo-q4k.gguf --format q4_k`)."""
    return _bundled(args)[0]


def args_bundle(args):
    """The Bundle of ``bundled_dit``, or None for a family's files."""
    return _bundled(args)[1]


def _bundled(args) -> tuple:
    """(``bundled_dit``, its Bundle), decided once (a --model's header read once)."""
    if not hasattr(args, "_bundled"):
        args._bundled = _find_bundled(args)
    return args._bundled


def _find_bundled(args) -> tuple:
    release = release_of(args)
    if release is not None:
        bundle = bundle_named(release.kind)  # the release named its bundle when it was resolved
        return (release.transformer, bundle) if bundle is not None else (None, None)
    if args.text_encoder or args.vae:
        return None, None  # a family's files
    name = args.model or DEFAULT_MODEL
    if named_file(name) != name:  # no --model: the demo; --model demo-turbo
        return named_file(name), bundle_named(name)
    # a copy of a bundled DiT in another format (its header's shapes); a missing or unusable file is named when the
    # model loads (_file_parts)
    bundle = bundle_of_file(name) if os.path.exists(name) else None
    return (name, bundle) if bundle is not None else (None, None)


def make_parts(args) -> LoadedModel:
    """The model the flags name: a family's files (--model-path, or --model --text-encoder --vae) or a bundled model
    (the demo: its own DiT, or a copy of it in another format). The engine runs on ``use_threads``' count."""
    loaded = (_file_parts if uses_files(args) else _bundled_parts)(args)
    use_threads(loaded.engine, args)
    return loaded


def _bundled_parts(args) -> LoadedModel:
    dit, bundle = _bundled(args)  # the demo's, the demo-turbo's, or a copy of one
    parts = BundledParts(bundle.model_for(dit, dtype=args.dtype or torch.float32, cached=False))
    prompts = [getattr(args, name, "") for name in ("prompt", "negative")]  # the command line's (sgld serve has none)
    for warning in parts.warnings(prompts[:1], prompts[1:], names=("--prompt", "--negative")):
        print(f"sgld: warning: {warning}", file=sys.stderr)
    # the DiT through the same router as a family's files: several ranks (--num-gpus, --tp, ...) run it
    # in worker processes, in the compute dtype of every entry point unless --dtype says (engine/compute_dtype.py)
    config = engine_config(args, cache=resolve_config(cache_config(args)))
    return LoadedModel(open_engine(dit, config), parts, dit)


def model_files(args):
    """The files of the DiT, its text encoder and VAE the flags name (a Release), and the DiT's family, checked in the
    order a user fixes them (each named if missing). Decided once."""
    if getattr(args, "_files", None) is not None:
        return args._files
    release = release_of(args)
    if release is not None:
        release.require("transformer", "text_encoder", "vae", why="the DiT, its text encoder and the VAE")
        files, family = release, dit_family(release.transformer)
    else:
        if not args.model:
            raise ValueError("--model, --text-encoder and --vae go together; missing --model (or give --model-path: a "
                             "release folder holding all three)")
        files = resolve_release(args.model, text_encoder=args.text_encoder, vae=args.vae)
        family = dit_family(files.transformer)  # an unusable DiT is named before the other two
        missing = [f"--{n.replace('_', '-')}" for n in ("text_encoder", "vae") if getattr(files, n) is None]
        if missing:
            raise ValueError(f"--model, --text-encoder and --vae go together; missing {', '.join(missing)} (or give "
                             "--model-path: a release folder holding all three; a DiT of the demo's shapes alone "
                             "runs with the demo's own)")
    args._files = (files, family)
    return args._files


def _file_parts(args) -> LoadedModel:
    """The parts from a family's files: its DiT, and the text encoder and VAE its description names."""
    files, family = model_files(args)
    vae = family.companions.vae.load(files.vae, device=args.device)
    te = family.companions.text_encoder.load(files.text_encoder, device=args.device, tokenizer=files.tokenizer,
                                             placement=args.text_encoder_device)
    eng = open_engine(files.transformer, engine_config(args, cache=resolve_config(cache_config(args))))
    return LoadedModel(eng, FileParts(te, vae, family), files.transformer)


def cmd_generate(args) -> dict:
    """A picture from a prompt (the embedded demo model, or ERNIE-Image files): PNG with ComfyUI-style text metadata."""
    t0 = time.perf_counter()
    run = check_generate_args(args)
    size = model_files(args)[1].companions.default_size if uses_files(args) else args_bundle(args).image_size
    width, height = args.width or size, args.height or size
    revised, pe_stats = _enhance(args, width, height, run["seed"])  # first: its memory is free before the DiT loads
    loaded = make_parts(args)
    eng, parts = loaded.engine, loaded.parts
    if args.loras:
        eng.set_loras(args.loras)
    picture = Picture([revised if revised is not None else args.prompt], [args.negative], width, height,
                      SamplingOptions(**run))
    request = sample_request(parts, picture)  # the prompts encoded: part of the load time
    load_s = time.perf_counter() - t0 - pe_stats.get("pe_seconds", 0.0) - pe_stats.get("pe_load_seconds", 0.0)
    settings = {"prompt": args.prompt, "negative": args.negative, **run, "model": os.path.basename(loaded.model_path)}
    if revised is not None:
        settings["revised_prompt"] = revised
    bar = None if args.json else _progress_bar(run["steps"])
    try:
        latent = eng.sample_request(request, callback=(lambda i, n, x, d: bar.update(1)) if bar else None)
    finally:
        if bar:
            bar.close()
    image = parts.decode(latent)[0]
    stats = eng.last_run.to_dict()
    try:
        _save_png(image, args.out, settings, stats)
    except OSError as e:
        raise ValueError(f"--out '{args.out}': could not write it: {e.strerror or e}") from None
    result = {**settings, "out": args.out, "load_seconds": round(load_s, 3),
              "sampling_seconds": stats["sampling_seconds"], "model_calls": stats["model_calls"],
              "calls_computed": stats["calls_computed"], "step_mask": stats["step_mask"], "threads": stats.get("threads"),
              **pe_stats}
    if "speedup" in stats:
        result["speedup"] = stats["speedup"]
    parallel = eng.describe()["parallel"]
    if parallel is not None:  # several ranks: which, and the worker processes that ran the DiT
        result["parallel"] = parallel["plan"]
        result["worker_pids"] = parallel["worker_pids"]
    if args.json:
        print(json.dumps(result))
    else:
        if revised is not None:
            print(f"revised prompt ({pe_stats['pe_seconds']:.2f} s): {revised}")
        count = stats.get("threads", 0)
        threads = f" on {count} CPU thread{'s' if count > 1 else ''}" if count and eng.device.type == "cpu" else ""
        print(f"wrote {args.out} ({image.shape[1]}x{image.shape[0]}): load {load_s:.2f} s, sampling "
              f"{stats['sampling_seconds']:.2f} s{threads}, {stats['calls_computed']}/{stats['model_calls']} steps "
              f"computed, shift {run['shift']:g}")
    return result


def _enhance(args, width: int, height: int, seed: int):
    """(the PE's revised prompt, its timings) with --pe, else (None, {}). The PE is freed once it has written."""
    pe = load_prompt_enhancer(args, model_source(args), release_of(args))
    if pe is None:
        return None, {}
    try:
        revised = pe.enhance([args.prompt], width, height, seed=seed, max_new_tokens=args.pe_max_new_tokens)[0]
    finally:
        pe.release()
    return revised, {"pe_seconds": round(pe.seconds, 3), "pe_load_seconds": round(pe.load_seconds, 3),
                     "pe_new_tokens": pe.new_tokens[0]}


def output_name(args, run: dict) -> str:
    """--save-output's file, named as SGLang names its outputs: the prompt's first 100 characters, the local
    time and 8 hex digits of a hash of the settings, reduced to ASCII letters, digits, '.', '_' and '-'."""
    settings = {"prompt": args.prompt, "negative": args.negative, "width": args.width, "height": args.height,
                "model": args.model_path or args.model, **run}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:8]
    base = f"{args.prompt[:100]}_{time.strftime('%Y%m%d-%H%M%S')}_{digest}"
    ascii_name = unicodedata.normalize("NFKD", base).encode("ascii", "ignore").decode("ascii").replace(" ", "_")
    name = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9._-]", "_", ascii_name)).strip("._") or "output"
    return os.path.join(args.output_path, name[:150] + ".png")


def _progress_bar(total: int):
    return tqdm(total=total, desc="sampling", unit="step", file=sys.stderr, leave=False)


def _save_png(image, path: str, settings: dict, stats: dict) -> None:
    """Like ComfyUI's SaveImage: the settings as JSON in the PNG's "prompt" text chunk. Written whole or not
    at all (a temporary file in the same folder, then renamed): the previous picture survives any failure."""
    info = PngInfo()
    info.add_text("prompt", json.dumps(settings))
    info.add_text("sgld", json.dumps({k: stats[k] for k in ("model_calls", "calls_computed", "step_mask")}))
    if "revised_prompt" in settings:  # the PE's prompt, also in its own chunk (what the picture was made from)
        info.add_text("revised_prompt", settings["revised_prompt"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, suffix=".png.part") as f:
        Image.fromarray(image).save(f, format="PNG", pnginfo=info)


def uses_files(args) -> bool:
    return bundled_dit(args) is None


def model_source(args) -> str:
    """What decides the defaults: the DiT file or folder the flags name (the demo's file for a DiT of its shapes)."""
    if not uses_files(args):
        return bundled_dit(args)  # the demo's, the demo-turbo's (a copy: the embedded file of its shapes decides)
    release = release_of(args)
    return release.transformer if release is not None else args.model or ""


def release_around(args):
    """The release the DiT comes from (--model-path, or a --model transformer/ folder inside a release folder), or
    None. Decided once."""
    if not hasattr(args, "_release_around"):
        release = release_of(args)
        if release is None and args.model and uses_files(args) and os.path.exists(args.model):
            release = resolve_release(args.model)  # its transformer/ folder finds the release around it
        args._release_around = release
    return args._release_around


def release_shift(args, width=None, height=None):
    """The sigma shift of a ``width`` x ``height`` picture (None: the model's default size) from the release the DiT
    comes from (Release.shift, the pipeline's reading: a dynamic one at this size), None when there is none."""
    release = release_around(args)
    if release is None or not release.dynamic_shift():
        return release.shift() if release is not None else None
    family = model_files(args)[1]  # its pipeline decides whether a dynamic shift is computed (or refused)
    size = family.companions.default_size
    return picture_shift(release, family, width or size, height or size)


def check_generate_args(args) -> tuple:
    """Every option of ``sgld generate`` checked before anything loads (ValueError naming the option and
    what is allowed). Returns the run's sampling settings (``SAMPLING``): the flags', else the model's defaults."""
    external = uses_files(args)
    if external:
        check_image_sides(args)
    else:
        bundle = args_bundle(args)
        for name in ("width", "height"):
            value, side = getattr(args, name), bundle.image_size
            if value is not None and value != side:
                raise ValueError(f"--{name} {value}: {bundle.title} makes {side}x{side} pictures only (other sizes "
                                 f"need {file_families()} files: --model --text-encoder --vae)")
    run = from_flags(args, model_source(args), SAMPLING)
    shift = release_shift(args, args.width, args.height) if args.shift is None else None
    if shift is not None:
        run["shift"] = shift  # the release's scheduler config, as the family's diffusers pipeline reads it
    check_pe_args(args)
    if args.out is None:
        args.out = output_name(args, run) if args.save_output else DEFAULT_OUT
    check_output_path("--out", args.out, (".png",))
    engine_config(args)  # the engine's flags and the parallel degrees against each other
    resolve_config(cache_config(args))  # the --cache* flags, else SGLANG_CACHE_DIT_*: a bad value stops the run early
    return run
