"""``ErnieImagePipeline``: prompt in, picture out, named and called as diffusers' pipeline so code moves over.

    from engine import ErnieImagePipeline
    pipe = ErnieImagePipeline.from_pretrained("demo")            # or a release folder / repo id in the HF cache
    pipe("a large red circle on the left, on a blue background", seed=0).images[0].save("out.png")

The parts come from ``engine.release.resolve_release``; the DiT runs in this project's ``Engine`` (every engine
option of ``EngineConfig`` is a keyword of ``from_pretrained``), the text encoder and VAE are
those the DiT's family names (``Family.companions``: transformers' models, diffusers' VAEs), the prompt
enhancer engine/models/prompt_enhancer.py's. Sigma schedule, CFG and the mapping to diffusers' scheduler:
docs/python.md.
"""
from __future__ import annotations

import dataclasses
import functools
import secrets
import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from . import options
from .config import EngineConfig
from .errors import InputError
from .features.cache import CacheConfig, resolve_config
from .features.compile import compile_blocks
from .features.lora import parse_spec
from .image_parts import BundledParts, FileParts, ImageParts
from .inputs import check_sampling_settings, check_seed
from .io.checkpoint import parse_dtype
from .models import family_of
from .models.bundle import bundle_named
from .models.external import text_encoder_dtype
from .release import Release, bundled, dit_family, picture_shift, resolve_release
from .router import open_engine
from .sampling import DEFAULT_SHIFT, SAMPLERS, SCHEDULERS, time_snr_shift
from .sampling_options import SamplingOptions, model_defaults, model_kind
from .text_to_image import Picture, generate

OUTPUT_TYPES = ("pil", "np", "latent")
ENGINE_OPTIONS = tuple(n for n in options.declared(EngineConfig) if n not in ("dtype", "device"))
CALL_NAMES = {"steps": "num_inference_steps", "cfg": "guidance_scale"}  # errors name the call's keywords
# the sampling options a call takes as keywords of their own names (the others it names itself, diffusers' way)
OTHER_OPTIONS = tuple(n for n in options.declared(SamplingOptions) if n not in ("seed", "steps", "cfg", "sampler",
                                                                                "scheduler", "shift"))
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class ErnieImagePipelineOutput:
    """As diffusers': ``images`` (PIL images, a float array [B, H, W, 3] in 0..1 for "np", the DiT latent for
    "latent") and ``revised_prompts`` (the prompt enhancer's, None when it did not run); ``seed``: the run's
    (None with a generator); ``stats``: the engine's run statistics."""

    images: Union[list, np.ndarray, torch.Tensor]
    revised_prompts: Optional[List[str]] = None
    seed: Optional[int] = None
    stats: Optional[dict] = None


def _engine_config(torch_dtype, device, given: dict) -> EngineConfig:
    """The EngineConfig of ``from_pretrained``'s keywords; an unknown keyword is named with the allowed ones."""
    unknown = sorted(set(given) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(f"ErnieImagePipeline: unknown option(s) {', '.join(unknown)}; the engine options are "
                        f"{', '.join(ENGINE_OPTIONS)} (plus torch_dtype, device, cache, lora)")
    dtype = DTYPE_NAMES.get(torch_dtype, torch_dtype) if torch_dtype is not None else None
    return EngineConfig(dtype=dtype, device=str(device or "cpu"), **given)


def cache_option(cache) -> CacheConfig:
    """None (the SGLANG_CACHE_DIT_* environment, read here: the pipeline is where a run starts from the outside),
    False / "off", a preset name, or a CacheConfig."""
    if cache is None or isinstance(cache, CacheConfig):
        return resolve_config(cache)
    if cache is False or (isinstance(cache, str) and cache.lower() in ("off", "none")):
        return CacheConfig(enabled=False)
    if cache is True:
        return CacheConfig(enabled=True, preset="balanced")
    if isinstance(cache, str):
        return CacheConfig(enabled=True, preset=cache)
    raise TypeError(f"cache={cache!r}: give a preset name (quality, balanced, fast, ...), 'off', or a CacheConfig")


def _loras(lora) -> list:
    """``lora``: a path, "path:strength", (path, strength), or a list of those -> [(path, strength)]."""
    if lora is None:
        return []
    items = [lora] if isinstance(lora, (str, tuple)) or hasattr(lora, "__fspath__") else list(lora)
    out = []
    for item in items:
        out.append((str(item[0]), float(item[1])) if isinstance(item, tuple) else parse_spec(str(item)))
    return out


def diffusers_sigmas(steps: int, shift: float) -> torch.Tensor:
    """diffusers' ErnieImagePipeline schedule: ``linspace(1, 0, steps + 1)`` without its 0, shifted by
    FlowMatchEulerDiscreteScheduler's static shift (sigma' = shift * s / (1 + (shift - 1) * s), in float32),
    then a terminal 0 appended."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)[:-1]
    return torch.cat([time_snr_shift(shift, s).to(torch.float32), torch.zeros(1)])


class ErnieImagePipeline:
    """Text-to-image with ERNIE-Image (or the demo model) on this project's engine. Open with ``from_pretrained``."""

    def __init__(self, engine, parts: ImageParts, release: Release, kind: str, cache=None, pe=None):
        self.engine = engine
        self.parts, self.release, self.kind = parts, release, kind
        # diffusers' names for the text encoder and the VAE (the demo's: its parts, which hold both)
        self.text_encoder = getattr(parts, "text_encoder", parts)
        self.vae = getattr(parts, "vae", parts)
        self.cache = cache
        self.pe = pe  # a loaded PromptEnhancer, or None (loaded at the first use_pe run when the release has one)
        # the release's scheduler config, as sgld generate reads it: its shift at the default size (a dynamic one,
        # Z-Image's use_dynamic_shifting, is the shift of each call's size)
        size = parts.default_size
        self.shift = picture_shift(release, getattr(parts, "family", None), size, size) or DEFAULT_SHIFT
        self._progress = {}

    # -- opening ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, torch_dtype: Optional[torch.dtype] = None, device=None, *, cache=None, lora=None,
                        text_encoder=None, tokenizer=None, vae=None, pe=None, pe_tokenizer=None,
                        text_encoder_config=None, vae_config=None, text_encoder_device="auto",
                        **engine_options) -> "ErnieImagePipeline":
        """``path``: "demo", a release folder, a Hugging Face repo id in the local cache, or a single DiT file with
        ``text_encoder=`` and ``vae=`` (folders, or ComfyUI's single files with ``text_encoder_config=`` /
        ``vae_config=``: folders holding config.json, and the tokenizer for the text encoder; docs/python.md). ``torch_dtype``: the DiT's and text encoder's dtype
        (the VAE runs in float32); ``device``: "cpu", "cuda", ...; ``cache``: a Cache-DiT preset name, "off" or a
        CacheConfig (None: the SGLANG_CACHE_DIT_* environment); ``lora``: a path, "path:strength" or a list;
        ``text_encoder_device``: "auto" (computes on ``device``, kept on the host between prompts), "cpu" or
        "resident" (``sgld --text-encoder-device``); ``engine_options``: EngineConfig's fields (attention, compile, quant, offload, resident_layers, num_gpus,
        ulysses_degree, ring_degree, tp, cfg_parallel)."""
        config = _engine_config(torch_dtype, device, engine_options)
        cache = cache_option(cache)
        release = resolve_release(path, text_encoder=text_encoder, tokenizer=tokenizer, vae=vae, pe=pe,
                                  pe_tokenizer=pe_tokenizer)
        if bundled(release):  # its one file: DiT, text encoder and vocabulary (a copy of its DiT: the shipped's)
            parts = BundledParts(bundle_named(release.kind).model_for(release.transformer))
            engine = open_engine(release.transformer, config)
            kind = release.kind
        else:
            release.require("text_encoder", "vae", why="a single DiT file needs text_encoder= and vae= (folders or files)")
            family = dit_family(release.transformer)
            te = family.companions.text_encoder.load(
                release.text_encoder, dtype=parse_dtype(config.dtype), device=config.device,
                tokenizer=release.tokenizer, config=text_encoder_config, placement=text_encoder_device)
            parts = FileParts(te, family.companions.vae.load(release.vae, device=config.device, config=vae_config),
                              family)
            engine = open_engine(release.transformer, config)
            kinds = [model_kind(release.transformer)] + ([model_kind(release.source)] if release.kind == "hub" else [])
            first = next(iter(family.sampling_defaults), "")  # a repo id's name says its variant (its snapshot's cannot)
            kind = next((k for k in kinds if k != first), kinds[0])
        pipe = cls(engine, parts, release, kind, cache=cache)
        if lora is not None:
            pipe.set_loras(_loras(lora))
        return pipe

    # -- the transformer: the engine's DiT module -----------------------------------------------------------
    @property
    def transformer(self):
        """The engine's DiT module (None when it runs on worker ranks). ``pipe.transformer =
        torch.compile(pipe.transformer)`` becomes the engine's own regional compile (the ``compile`` option)."""
        return self.engine.model

    @transformer.setter
    def transformer(self, value):
        model = self.engine.model
        if value is model:
            return
        if getattr(value, "_orig_mod", None) is model and model is not None:  # torch.compile(pipe.transformer)
            self.engine.warnings.extend(compile_blocks(model, "static"))
            self.engine.runner.config.compile = "static"
            return
        raise TypeError("pipe.transformer can only be set to torch.compile(pipe.transformer) (which compiles the "
                        "engine's DiT blocks); to use another model, open a pipeline on its file")

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.runner.dtype

    @property
    def guidance_offset(self) -> float:
        """What ``guidance_scale`` adds up to the engine's cfg with (its family's diffusers pipeline's convention)."""
        family = getattr(self.parts, "family", None)
        return family.companions.guidance_offset if family is not None else 0.0

    @property
    def bundled(self) -> bool:
        """A bundled model (the demo): its text encoder and codec come with its DiT's file and stay on the CPU."""
        return isinstance(self.parts, BundledParts)

    @functools.cached_property
    def defaults(self) -> dict:
        """{"steps", "cfg"}: the model's (engine/sampling_options.py: Base, Turbo; a demo file's own, the demo-turbo's
        8 steps at cfg 1), read once (a bundled file's from its header)."""
        if self.bundled:
            return model_defaults(self.release.transformer)
        variants = self.parts.family.sampling_defaults  # the kind's, else the family's first (a name says no kind)
        return dict(variants.get(self.kind) or next(iter(variants.values())))

    # -- engine features ---------------------------------------------------------------------------------------
    def enable_cache(self, preset: str = "balanced", **fields) -> None:
        """Cache-DiT for the following runs: a preset (quality, balanced, fast, ...) and CacheConfig's fields."""
        self.cache = CacheConfig(enabled=True, preset=preset, **fields)

    def disable_cache(self) -> None:
        """No Cache-DiT, whatever the SGLANG_CACHE_DIT_* environment says."""
        self.cache = CacheConfig(enabled=False)

    def set_loras(self, loras) -> List[str]:
        """Exactly these LoRAs active: [(path, strength), ...]; returns messages about keys not applied."""
        return self.engine.set_loras(_loras(loras))

    def load_lora(self, path, strength: float = 1.0) -> List[str]:
        """One more LoRA on top of the active ones (diffusers' load_lora_weights, merged as the engine does)."""
        return self.engine.set_loras(self.engine.loras + [(str(path), float(strength))])

    def unload_lora(self) -> None:
        """Every LoRA off; the original weights back bit-exactly."""
        self.engine.set_loras([])

    def set_progress_bar_config(self, **kwargs) -> None:
        """As diffusers: tqdm's keywords for the sampling bar (``disable=True`` switches it off)."""
        self._progress = dict(kwargs)

    def to(self, device=None, torch_dtype: Optional[torch.dtype] = None) -> "ErnieImagePipeline":
        """As diffusers' ``pipe.to("cuda")``: the DiT is opened again from its file with the new device / dtype (its
        options and LoRAs kept), the text encoder and VAE moved. Returns the pipeline."""
        changes = {}
        if device is not None:
            changes["device"] = str(device)
        if torch_dtype is not None:
            changes["dtype"] = DTYPE_NAMES.get(torch_dtype, torch_dtype)
        if not changes:
            return self
        config = dataclasses.replace(self.engine.runner.config if self.engine.model is not None else self.engine.config,
                                     **changes)
        loras = self.engine.loras
        self.engine = open_engine(self.release.transformer, config)
        if loras:
            self.engine.set_loras(loras)
        if not self.bundled and "device" in changes:  # a bundled text encoder and codec stay on the CPU
            self.text_encoder.to(config.device)
            self.vae.vae.to(config.device)
            self.vae.device = torch.device(config.device)
        if not self.bundled and "dtype" in changes:
            self.text_encoder.model.to(parse_dtype(config.dtype) or text_encoder_dtype(self.text_encoder.device))
        if not self.bundled:
            self.parts.forget_prompts()
        return self

    def release_memory(self) -> int:
        """Free the engine's offload buffers and the prompt enhancer (loaded again when needed). Returns bytes."""
        if self.pe is not None:
            self.pe.release()
            self.pe = None
        return self.engine.release()

    # -- the prompt enhancer -------------------------------------------------------------------------------------
    def _enhancer(self):
        if self.pe is None:
            family = family_of(self.engine.model_config)
            enhancer = family.companions.prompt_enhancer
            if enhancer is None:
                raise InputError(f"use_pe: a {family.title} release has no prompt enhancer; call with use_pe=False "
                                 "and the prompt written out")
            self.release.require("pe", "pe_tokenizer", why="use_pe=True needs the release's prompt enhancer")
            self.pe = enhancer.from_pretrained(self.release.pe, tokenizer=self.release.pe_tokenizer,
                                              device=self.engine.config.device,
                                              dtype=parse_dtype(self.engine.config.dtype))
        return self.pe

    # -- running ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: Union[str, Sequence[str]], negative_prompt: Union[None, str, Sequence[str]] = None,
                 height: Optional[int] = None, width: Optional[int] = None, num_inference_steps: Optional[int] = None,
                 guidance_scale: Optional[float] = None, num_images_per_prompt: int = 1,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None, use_pe: Optional[bool] = None,
                 output_type: str = "pil", return_dict: bool = True, sampler: str = "euler",
                 scheduler: Optional[str] = None, shift: Optional[float] = None, cache=None,
                 max_new_tokens: Optional[int] = None, pe_greedy: bool = False, **sampling):
        """diffusers' call. ``height``/``width``: 1024 (the demo: 64); ``num_inference_steps``/``guidance_scale``:
        the model's defaults; ``generator`` (diffusers) or ``seed`` (ComfyUI's noise; random when neither);
        ``use_pe``: None = on when the release has a prompt enhancer (diffusers' default), as diffusers.
        ``scheduler=None``: diffusers' linspace schedule with the release's shift; a ComfyUI scheduler name
        (simple, normal, beta) runs that one (the demo's default: simple, shift 3). ``cache`` overrides the
        pipeline's for this call; ``max_new_tokens`` / ``pe_greedy`` (argmax decoding) go to the prompt enhancer;
        ``sampling``: the other sampling options (``SamplingOptions``' fields this call does not name: denoise ...)."""
        unknown = sorted(set(sampling) - set(OTHER_OPTIONS))
        if unknown:
            raise TypeError(f"ErnieImagePipeline: unknown keyword(s) {', '.join(unknown)}; the sampling options besides "
                            f"the named ones are {', '.join(OTHER_OPTIONS)}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InputError("prompt must be a string or a non-empty list of strings")
        negatives = [negative_prompt or ""] * len(prompts) if negative_prompt is None or isinstance(negative_prompt, str) \
            else list(negative_prompt)
        if len(negatives) != len(prompts):
            raise InputError(f"negative_prompt has {len(negatives)} entries; it must have one per prompt ({len(prompts)})")
        if output_type not in OUTPUT_TYPES:
            raise InputError(f"output_type '{output_type}' is not supported; choose one of {', '.join(OUTPUT_TYPES)}")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise InputError(f"num_images_per_prompt must be a count of at least 1 (got {num_images_per_prompt!r})")
        if generator is not None and seed is not None:
            raise InputError("give either generator= (diffusers' noise) or seed= (ComfyUI's noise), not both")
        if sampler not in SAMPLERS:
            raise InputError(f"sampler '{sampler}' is not supported; choose one of {', '.join(SAMPLERS)}")
        if scheduler is not None and scheduler not in SCHEDULERS:
            raise InputError(f"scheduler '{scheduler}' is not supported; choose None (diffusers' schedule) or one of "
                             f"{', '.join(SCHEDULERS)}")
        height, width = height or self.parts.default_size, width or self.parts.default_size
        for name, value in (("height", height), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"{name} must be a whole number of pixels (got {value!r})")
        try:  # the size's one check, before the PE's seconds
            latent_shape = self.parts.latent_shape(width, height, len(prompts) * num_images_per_prompt)
        except InputError as e:
            raise InputError(f"height/width {height}x{width}: {e}") from None
        steps = self.defaults["steps"] if num_inference_steps is None else num_inference_steps
        cfg = self.defaults["cfg"] if guidance_scale is None else guidance_scale + self.guidance_offset
        diffusers_schedule = scheduler is None and not self.bundled
        if shift is None:  # the release's scheduler config (at this size), else ComfyUI's 3.0
            dynamic = self.release.dynamic_shift()
            shift = picture_shift(self.release, self.parts.family, width, height) if dynamic else self.shift
        check_sampling_settings(steps=steps, cfg=cfg, shift=shift, names=CALL_NAMES)  # before the PE's seconds
        if generator is None and seed is None:
            seed = secrets.randbelow(2 ** 63)  # reported in the output; the PE is seeded with it too
        check_seed(seed if seed is not None else 0)

        vocabulary_warnings = self.parts.warnings(prompts, negatives)
        for message in vocabulary_warnings:  # "top right" would silently draw something else
            warnings.warn(message, UserWarning, stacklevel=2)
        revised = None
        if use_pe or (use_pe is None and self.release.pe is not None and not self.bundled):
            revised = self._enhancer().enhance(prompts, width, height, seed=seed, max_new_tokens=max_new_tokens,
                                               greedy=pe_greedy)
            prompts = list(revised)

        noise = None
        if generator is not None:
            noise = torch.randn(latent_shape, generator=generator, device=generator.device, dtype=torch.float32)
        options = {"seed": 0 if seed is None else seed, "steps": steps, "cfg": cfg, "sampler": sampler, **sampling}
        sigmas = diffusers_sigmas(steps, float(shift)) if diffusers_schedule else None
        if not diffusers_schedule:
            options.update(scheduler=scheduler or self.parts.model.default_scheduler, shift=shift)
        # diffusers' rule (do_classifier_free_guidance): cfg 1 or below runs the prompts alone
        picture = Picture(prompts, negatives if cfg > 1.0 else None, width, height, SamplingOptions(**options),
                          per_prompt=num_images_per_prompt, sigmas=sigmas, noise=noise,
                          cache=cache_option(cache) if cache is not None else self.cache, latent_shape=latent_shape)
        bar = tqdm(total=steps, desc="sampling", unit="step", file=sys.stderr, leave=False,
                   **{"disable": False, **self._progress})
        try:
            out = generate(self.engine, self.parts, picture, callback=lambda i, n, x, d: bar.update(1))
        finally:
            bar.close()
        if output_type == "latent":
            images = out
        else:
            pixels = self.parts.decode_float(out).numpy()
            images = pixels if output_type == "np" else _to_pil(pixels)
        if not return_dict:
            return (images,)
        stats = {**self.engine.last_run.to_dict(), "shift": float(shift)}
        stats["warnings"] += vocabulary_warnings
        if revised is not None:
            stats["pe_seconds"] = round(self.pe.seconds, 4)
        return ErnieImagePipelineOutput(images, revised, seed if generator is None else None, stats)


def _to_pil(pixels: np.ndarray) -> list:
    """Float images [B, H, W, 3] in 0..1 -> PIL images, as diffusers' numpy_to_pil rounds them."""
    return [Image.fromarray(img) for img in (pixels * 255).round().astype("uint8")]
