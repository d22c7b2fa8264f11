"""`sgld bench`: time one DiT forward and a whole sampling run, for a model file or a random model of a
named size."""
from __future__ import annotations

import json
import time
from typing import Optional

import torch

from .. import device as device_rt
from ..compute_dtype import default_compute_dtype
from ..features import offload
from ..features.cache import from_env
from ..inputs import empty_latent_shape
from ..loading import estimate_bytes
from ..models import family_of
from ..models.random_weights import SIZES, random_checkpoint, random_model_on_device
from ..router import open_engine
from ..sampling import MAX_IMAGE_SIDE, MAX_TEXT_TOKENS, cfg_on
from ..sampling_options import from_flags
from .common import add_engine_arguments, add_sampling_arguments, check_image_sides, engine_config, use_threads

SAMPLING = ("steps", "cfg")  # the sampling options of the whole-run timing


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="time the DiT forward and a whole sampling run",
                       description="Time one DiT forward and a whole sampling run, for a model file or a random model "
                                   "of a named size (its steps and cfg: the model's defaults, ERNIE-Image Base's for a "
                                   "random model; --steps 0 skips the run).")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", help="DiT .safetensors file (ERNIE-Image ...) or diffusers folder")
    src.add_argument("--size", default="tiny", help="random model of a named size: tiny, small, medium, 8b (the release shape; for GPUs)")
    b.add_argument("--width", type=int, default=None, help="image width in pixels, a multiple of the family's latent stride "
                   f"(16 for ERNIE-Image) up to {MAX_IMAGE_SIDE}; default 1024 for 8b, 256 otherwise")
    b.add_argument("--height", type=int, default=None, help="image height in pixels (as --width)")
    b.add_argument("--text-tokens", type=int, default=64, help=f"prompt length in tokens, 1 to {MAX_TEXT_TOKENS}")
    add_sampling_arguments(b, SAMPLING)
    b.add_argument("--repeat", type=int, default=3, help="timed forwards (after one warm-up)")
    b.add_argument("--json", action="store_true", help="print one line of JSON")
    add_engine_arguments(b)


def _random_engine(size: str, dtype, device, config=None):
    """A random model of a named size, materialized once in ``dtype`` (no float32 copy) where it will
    live: on ``device``, or in CPU memory when layer-wise offload streams it from there (so the whole
    model never has to fit on the GPU first)."""
    if size not in SIZES:
        raise SystemExit(f"sgld bench: --size '{size}' is unknown; choose one of {', '.join(SIZES)}")
    if dtype is None:  # the compute dtype of every entry point (engine/compute_dtype.py)
        dtype = default_compute_dtype(family_of(SIZES[size]), device)[0]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype)
    if dt is None:
        raise SystemExit(f"sgld bench: --dtype '{dtype}' is not supported; choose one of bf16, fp16, fp32")
    decision, build_on = None, device
    if config is not None and config.offload != "none":
        decision = offload.choose_offload(config.offload, device, estimate_bytes(SIZES[size], dt, config.quant))
        if decision[0] == "layerwise":
            build_on = "cpu"
    model = random_model_on_device(SIZES[size], build_on, dt, seed=0)
    return open_engine(model, config, label=f"random:{size}", offload_decision=decision)


def weight_format(eng, config) -> Optional[str]:
    """What "quant" says: --quant's format, else the file's own by name (``Engine.describe``'s "weights": "gguf q4_k"
    for a GGUF file, "gguf q5_0 + q4_k" where rows too short for q4_k's blocks fell back), None for plain weights."""
    return config.quant or eng.describe()["weights"]


def _reset_peak_memory(dev: torch.device) -> None:
    """Start the peak-memory window of the timed part (the build's peak is not the run's)."""
    if dev.type == "cuda":
        device_rt.synchronize(dev)
        device_rt.reset_peak(dev)


def check_bench_args(args) -> None:
    """The sizes, before anything loads (ValueError / InputError naming the flag): --width / --height as generate
    takes them (for a random model, of its family's stride too: a model file's is checked once it is open),
    --text-tokens from 1 to what the text encoder reads."""
    check_image_sides(args)
    if not 1 <= args.text_tokens <= MAX_TEXT_TOKENS:
        raise ValueError(f"--text-tokens must be an integer from 1 to {MAX_TEXT_TOKENS} (got {args.text_tokens}; the "
                         f"text encoder reads at most {MAX_TEXT_TOKENS})")
    if not args.model and args.size in SIZES:
        latent_sides(args, family_of(SIZES[args.size]))


def latent_sides(args, family) -> tuple:
    """(height, width) of the latent for --height / --width (default 1024 pixels for 8b, 256 otherwise) in
    ``family``'s latent: each a multiple of its stride up to MAX_IMAGE_SIDE (inputs.empty_latent_shape)."""
    default = 1024 if args.size == "8b" else 256
    width, height = (default if v is None else v for v in (args.width, args.height))  # --width 0 is refused, not 256
    _, _, h, w = empty_latent_shape(family, width, height, 1, names={"width": "--width", "height": "--height"})
    return h, w


def run_settings(args) -> dict:
    """The whole run's steps and cfg (the flags', else the model's); {"steps": 0}: --steps 0, no run."""
    if args.steps == 0:
        return {"steps": 0}
    return from_flags(args, args.model or f"random:{args.size}", SAMPLING)


def cmd_bench(args) -> dict:
    t0 = time.perf_counter()
    check_bench_args(args)
    run = run_settings(args)
    config = engine_config(args, cache=from_env())  # SGLANG_CACHE_DIT_*, read once here (bench has no --cache flags)
    if args.model:
        eng = open_engine(args.model, config)
        use_threads(eng, args)
    elif config.world_size > 1:  # workers load from a file: write the random model to a temporary one
        eng = open_engine(random_checkpoint(args.size, config.dtype), config)
    else:
        eng = _random_engine(args.size, config.dtype, args.device, config)
    load_s = time.perf_counter() - t0
    cfg = eng.model_config
    h, w = latent_sides(args, family_of(cfg))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.in_channels, h, w, generator=g)
    text = torch.randn(args.text_tokens, cfg.text_in_dim, generator=g)
    dev = eng.device
    sync = (lambda: device_rt.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        xt, tb, ln = x.to(dev), torch.tensor([500.0], device=dev), torch.tensor([args.text_tokens], device=dev)
        tt = text[None].to(dev, eng.runner.dtype)
        forward = eng.dit_forward  # parallel: one call through the workers
        forward(xt, tb, tt, ln)
        sync()
        resident_gb = device_rt.allocated_bytes(dev) / 2 ** 30 if dev.type == "cuda" else None
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
              "quant": weight_format(eng, config),
              "image_tokens": h * w // cfg.patch_size ** 2, "text_tokens": args.text_tokens, "load_seconds": round(load_s, 3),
              "forward_ms_median": round(1000 * sorted(times)[len(times) // 2], 2), "forward_ms_min": round(1000 * min(times), 2)}
    if run["steps"] > 0:
        s = time.perf_counter()
        eng.sample(torch.zeros(1, cfg.in_channels, h, w), [text], [text[:1]] if cfg_on(run["cfg"], text) else None,
                   seed=0, **run)
        sync()
        result.update({**run, "sampling_seconds": round(time.perf_counter() - s, 3),
                       **{k: v for k, v in eng.last_run.to_dict().items() if k in ("model_calls", "calls_computed")}})
    described = eng.describe()  # after the runs: the offload counters
    if described["offload"] is not None:
        result["offload"] = described["offload"]
    if described["parallel"] is not None:
        result["parallel"] = described["parallel"]["plan"]
    if eng.warnings:
        result["warnings"] = list(eng.warnings)
    if dev.type == "cuda":
        result["peak_vram_gb"] = round(device_rt.peak_bytes(dev) / 2 ** 30, 2)
        result["resident_vram_gb"] = round(resident_gb, 2)  # allocated when timing started (weights + buffers)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>18}: {v}")
    return result
