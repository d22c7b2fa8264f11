"""Engine: the one API that nodes, CLI and benchmarks call. It owns the sampling loop, so wrappers
(cache, offload, parallel) see the step index, the step count and the CFG branch."""
from __future__ import annotations

import contextlib
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from .config import EngineConfig
from .features.fuse import fuse_projections, fused_groups
from .features.lora import LoRAFileCache, active_loras, apply_loras
from .features.patching import set_slot
from .features.quant import plan_load
from .models.ernie_image import ErnieImageTransformer
from .sampling import (DEFAULT_SHIFT, MAX_CFG, MAX_IMAGE_SIDE, MAX_IMAGE_TOKENS, MAX_SCHEDULE, MAX_SEED, MAX_SHIFT, MAX_STEPS, MULTIPLIER, SAMPLERS, SCHEDULERS, model_calls, noise_scaling, run_sampler, seeded_noise, sigma_schedule, step_of_call)
from .errors import InputError, ModelOutputError


def _integer(name: str, value, lo: int, hi: int) -> int:
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or not lo <= v <= hi:
        raise InputError(f"{name} must be an integer from {lo} to {hi} (got {value!r})")
    return v


def _number(name: str, value, lo: float, hi: float, above_lo: bool = False) -> float:
    try:
        v = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        v = None
    if v is None or not math.isfinite(v) or not (v > lo if above_lo else v >= lo) or v > hi:
        raise InputError(f"{name} must be a finite number {'above' if above_lo else 'from'} {lo:g} to {hi:g} (got {value!r})")
    return v


def check_seed(seed, name: str = "seed") -> int:
    """0 .. 2**64-1, the seeds ComfyUI gives and torch.Generator.manual_seed takes."""
    return _integer(name, seed, 0, MAX_SEED)


def check_sampling_settings(*, steps, cfg, denoise=1.0, shift=DEFAULT_SHIFT, names=None) -> None:
    """Refuse settings that would make a blank picture (NaN, inf, out of range) or unbounded work, before any
    work: InputError naming the setting and what is allowed (limits: engine/sampling.py). ``names``: how the
    caller spells each setting (the CLI: ``{"cfg": "--cfg", ...}``)."""
    def name(key):
        return (names or {}).get(key, key)

    steps = _integer(name("steps"), steps, 1, MAX_STEPS)
    _number(name("cfg"), cfg, 0.0, MAX_CFG)
    _number(name("shift"), shift, 0.0, MAX_SHIFT, above_lo=True)
    denoise = 1.0 if denoise is None else _number(name("denoise"), denoise, 0.0, 1.0)
    if 0.0 < denoise <= 0.9999 and steps / denoise > MAX_SCHEDULE:  # the schedule is cut from steps / denoise
        raise InputError(f"{name('steps')} / {name('denoise')} must be at most {MAX_SCHEDULE}: {steps} steps at denoise "
                         f"{denoise:g} need a schedule of {int(steps / denoise)} (raise denoise or lower steps)")


@dataclass
class RunStats:
    """What one ``Engine.sample`` call did (read ``engine.last_run``)."""

    steps: int = 0
    model_calls: int = 0
    sampling_seconds: float = 0.0
    step_mask: List[bool] = field(default_factory=list)  # True = the DiT was computed at that call
    call_seconds: List[float] = field(default_factory=list)  # wall time of each model call
    cache: dict = field(default_factory=dict)  # Cache-DiT summary (engine.cache); empty when off
    warnings: List[str] = field(default_factory=list)  # what this run did other than asked (denoise 0, ...)
    sampler: str = "euler"

    def nonfinite_output(self) -> "ModelOutputError":
        """The error for a model call (the last one recorded) whose output held NaN or inf."""
        call = len(self.call_seconds)
        return ModelOutputError(
            f"the model produced NaN/inf at step {step_of_call(self.sampler, call - 1) + 1} of {self.steps} "
            f"(model call {call} of {self.model_calls}): the weights may be damaged (a checkpoint holding NaN/inf), "
            "or the dtype overflowed (try fp32 or bf16)")

    @property
    def steps_computed(self) -> int:
        return sum(self.step_mask)

    @property
    def speedup(self) -> Optional[float]:
        """Measured model-call speedup of the cache against computing every call (1.0 when off)."""
        if not self.cache:
            return 1.0
        from .features.cache import measured_speedup
        return measured_speedup(self.call_seconds, self.step_mask)

    def to_dict(self) -> dict:
        """``warnings``: the run's own and the cache's (a custom steps_mask fitted to the run's length)."""
        d = {"steps_total": self.model_calls, "steps_computed": self.steps_computed,
             "sampling_seconds": round(self.sampling_seconds, 4), "step_mask": "".join("x" if m else "." for m in self.step_mask),
             "warnings": list(self.warnings) + list(self.cache.get("warnings", []))}
        if self.cache:
            d["cache"] = {k: v for k, v in self.cache.items() if k not in ("diffs", "warnings")}
            d["speedup"] = self.speedup
        return d


def latent_hint(channels: int) -> str:
    """Which latent a model of ``channels`` latent channels takes (and the ComfyUI node that makes it),
    for the wrong-latent error: the demo model's 48-channel pixel latent, or ERNIE-Image's Flux2 one."""
    from .models.demo import codec

    if channels == codec.LATENT_CHANNELS:
        return (f" (the demo model's latent: the image as {codec.LATENT_CHANNELS} channels at 1/{codec.FACTOR} of its "
                "size; use SGLDiffusion Demo Empty Latent)")
    if channels == 128:
        return " (ERNIE-Image uses the Flux2 latent: 128 channels at 1/16 of the image size; use EmptyFlux2LatentImage)"
    return ""


def pad_text(features: Sequence[torch.Tensor], dtype: torch.dtype, device) -> tuple:
    """Per-sample [T_i, C] text features -> zero-padded [B, Tmax, C] and lengths [B]."""
    lens = [int(f.shape[0]) for f in features]
    out = torch.zeros(len(features), max(lens), features[0].shape[-1], dtype=dtype, device=device)
    for i, f in enumerate(features):
        out[i, : lens[i]] = f.to(device=device, dtype=dtype)
    return out, torch.tensor(lens, device=device)


class Engine:
    def __init__(self, model: ErnieImageTransformer, config: Optional[EngineConfig] = None, source: str = "",
                 offload_decision: Optional[tuple] = None):
        self.model = model
        self.config = config or EngineConfig()
        self.source = source
        self.last_run = RunStats()
        self.lora_files = LoRAFileCache()  # LoRA files read against this model
        # Options applied once at load: quantization, attention backend, regional compile.
        # ``warnings``: what was requested but could not be done here (shown by the node and CLI);
        # ``notes``: what was chosen and why.
        from .features import attention as attention_backends
        from .features import quant

        self.warnings: List[str] = []
        self.notes: List[str] = []
        if self.config.quant:
            self.warnings += quant.apply_quant(model, self.config.quant).warnings
        fuse_projections(model)  # q/k/v and gate/up as one GEMM each (after quantization: rows concatenate exactly)
        fused, groups = fused_groups(model)
        self.notes.append(f"fused projections: {fused} of {groups} q/k/v and gate/up groups run as one GEMM each")
        # Layer-wise offload (after quantization: the quantized bytes are what is offloaded; before the
        # fast-path probe and the attention choice, which look at the compute device).
        self.offload = None
        self._apply_offload(offload_decision)
        with self.offload.hold(0) if self.offload is not None else contextlib.nullcontext():
            self.notes += quant.prepare_fast_paths(model)  # probes on block 0's weights on the device
        choice = attention_backends.select_backend(self.config.attention, self.device, model.dtype, model.config.head_dim)
        self.warnings += choice.warnings
        if model.attention in attention_backends.FUNCTIONS.values():
            attention_backends.apply_attention(model, choice)
            self.attention_backend = choice.name
            self.notes.append(choice.describe())
        else:  # a wrapper (e.g. sequence parallel) installed its own attention: leave it
            self.attention_backend = getattr(model.attention, "__name__", "custom")
            self.notes.append(f"attention: {self.attention_backend} (installed on the model; '{choice.name}' not applied)")
        if self.config.compile:
            from .features.compile import compile_blocks

            self.warnings += compile_blocks(model, self.config.compile)

    def _apply_offload(self, decision: Optional[tuple]) -> None:
        """``config.offload``: "none" | "layerwise" | "auto" (decided here unless from_file decided)."""
        from .features import offload

        mode = getattr(self.config, "offload", "none")
        if mode == "none":
            return
        model = self.model
        if decision is None:
            dev = torch.device(self.config.device)
            on_dev = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                         if t.device == dev or (dev.type == "cuda" and t.is_cuda and dev.index is None))
            from .features.quant import weight_bytes
            decision = offload.choose_offload(mode, dev, weight_bytes(model), resident_bytes=on_dev)
        choice, why = decision
        if why and mode == "auto":
            self.notes.append(why)
        if choice == "layerwise":
            self.offload = offload.apply_layerwise_offload(model, self.config.device, self.config.resident_layers)
            self.notes.append(self.offload.summary())

    def set_loras(self, loras) -> List[str]:
        """Make exactly these LoRAs active: ``[(path, strength), ...]`` (engine/features/lora). Merged in float32
        into plain weights (originals of the touched layers kept, so ``set_loras([])`` restores the base
        bit-exactly without re-reading the checkpoint), a low-rank side path on FP8 / INT4 layers.
        The same list again does nothing. Returns messages about LoRA keys that were not applied."""
        return apply_loras(self.model, self.lora_files.files(loras, self.model))

    def check_lora(self, path) -> List[str]:
        """Read a LoRA file against this model without applying it (LoRAError for a file that cannot be
        used); returns the messages about its keys that would not be applied. Callers ask the engine, so a
        ParallelEngine can ask its workers."""
        return self.lora_files.read(path, self.model).report()

    @property
    def loras(self) -> list:
        """[(path, strength), ...] active now."""
        return [(lf.path, s) for lf, s in active_loras(self.model)]

    @property
    def lora_report(self) -> List[str]:
        """Messages about the active LoRAs' keys that were not applied."""
        return [m for lf, _ in active_loras(self.model) for m in lf.report()]

    def release(self) -> int:
        """Give back the device memory this engine can free without unloading the model: the layer
        buffers of layer-wise offload (allocated again at the next run). Returns the bytes freed.
        Call before dropping an engine when the host (ComfyUI) asks for memory."""
        off = getattr(self, "offload", None)  # engines of other kinds (parallel) have none
        freed = off.release_buffers() if off is not None else 0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    @classmethod
    def from_file(cls, path: str, config: Optional[EngineConfig] = None) -> "Engine":
        config = config or EngineConfig()
        if getattr(config, "world_size", 1) > 1:  # several ranks: the DiT runs in worker processes (engine/parallel)
            from .parallel import ParallelEngine

            return ParallelEngine.from_file(path, config)
        decision = None
        device = config.device
        plan = plan_load(path, config.dtype, config.quant)  # the header, read once
        if getattr(config, "offload", "none") != "none":
            # decide before loading: an offloaded model is loaded into CPU memory, never whole on the GPU
            from .features import offload

            decision = offload.choose_offload(config.offload, config.device, plan.bytes_at_rest())
            if decision[0] == "layerwise":
                device = "cpu"
        model = plan.read(device)
        return cls(model, config, source=str(path), offload_decision=decision)

    @property
    def device(self) -> torch.device:
        return self.model.final_linear.weight.device

    # -- input checks ----------------------------------------------------------------------------
    def _check_conditioning(self, name: str, cond, batch: int) -> List[torch.Tensor]:
        cfg = self.model.config
        if cond is None or len(cond) == 0:
            raise InputError(f"{name} conditioning is empty: connect a text encoder output")
        feats = []
        for i, c in enumerate(cond):
            if not isinstance(c, torch.Tensor):
                raise InputError(f"{name} conditioning #{i} is {type(c).__name__}, not a tensor of text features")
            if c.dim() == 3 and c.shape[0] == 1:
                c = c[0]
            if c.dim() != 2 or c.shape[0] < 1:
                raise InputError(f"{name} conditioning #{i} has shape {tuple(c.shape)}; expected [tokens, {cfg.text_in_dim}]")
            if c.shape[1] != cfg.text_in_dim:
                raise InputError(
                    f"{name} conditioning #{i} has {c.shape[1]} features per token but this model takes {cfg.text_in_dim}: "
                    "was it made by the right text encoder?"
                )
            if not torch.isfinite(c).all():
                raise InputError(f"{name} conditioning #{i} holds NaN or inf values: the text encoder's output is damaged")
            feats.append(c)
        if len(feats) == 1 and batch > 1:
            feats = feats * batch
        if len(feats) != batch:
            raise InputError(f"{name} conditioning has {len(feats)} entries for a latent batch of {batch}")
        return feats

    def _check_latent(self, latent) -> None:
        cfg = self.model.config
        if not isinstance(latent, torch.Tensor) or latent.dim() != 4:
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise InputError(f"latent has shape {shape}; expected [batch, {cfg.in_channels}, height, width]")
        if latent.shape[1] != cfg.in_channels:
            raise InputError(f"latent has {latent.shape[1]} channels but this model takes {cfg.in_channels}"
                             + latent_hint(cfg.in_channels))
        p = cfg.patch_size
        if latent.shape[2] < p or latent.shape[3] < p or latent.shape[2] % p or latent.shape[3] % p:
            raise InputError(f"latent size {tuple(latent.shape[2:])} is not a multiple of the patch size {p}")
        tokens = (latent.shape[2] // p) * (latent.shape[3] // p)
        if tokens > MAX_IMAGE_TOKENS:
            raise InputError(f"latent size {tuple(latent.shape[2:])} makes {tokens} image tokens per sample; the limit is "
                             f"{MAX_IMAGE_TOKENS} ({MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels for ERNIE-Image)")
        if not torch.isfinite(latent).all():
            raise InputError("latent holds NaN or inf values")

    # -- sampling --------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """One DiT forward: flow velocity in float32."""
        timestep = (sigma * MULTIPLIER).float().to(self.device)
        return self.model(x.to(self.device), timestep, text, lens).float().to(x.device)

    def make_denoiser(self, cond: List[torch.Tensor], uncond: Optional[List[torch.Tensor]], cfg: float, runner=None):
        """denoised(x, sigma) with CFG as ComfyUI computes it: uncond + (cond - uncond) * cfg on x0.
        ``runner``: the cache's block runner installed for this run (its last decision fills step_mask)."""
        use_cfg = uncond is not None and cfg != 1.0
        features = cond + uncond if use_cfg else cond
        text, lens = pad_text(features, self.model.dtype, self.device)
        stats = self.last_run

        def denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            xs = torch.cat([x, x]) if use_cfg else x
            sig = torch.cat([sigma, sigma]) if use_cfg else sigma
            t0 = time.perf_counter()
            v = self.velocity(xs, sig, text, lens)
            stats.call_seconds.append(time.perf_counter() - t0)
            stats.step_mask.append(bool(runner.computed[-1]) if runner is not None and runner.computed else True)
            if not torch.isfinite(v).all():  # one cheap check a call: stop at the first bad step
                raise stats.nonfinite_output()
            denoised = xs - v * sig.view(-1, 1, 1, 1)
            if not use_cfg:
                return denoised
            cond_pred, uncond_pred = denoised[:b], denoised[b:]
            return uncond_pred + (cond_pred - uncond_pred) * cfg

        return denoiser

    def _start_run(self, latent, cond, uncond, steps, cfg, sampler, scheduler, denoise, shift):
        """Check every input (InputError naming what is wrong), make the sigmas and reset ``last_run``.
        Returns (latent as float32 on the CPU, cond, uncond or None when unused, sigmas)."""
        if sampler not in SAMPLERS:
            raise InputError(f"sampler '{sampler}' is not supported; choose one of {', '.join(SAMPLERS)}")
        if scheduler not in SCHEDULERS:
            raise InputError(f"scheduler '{scheduler}' is not supported; choose one of {', '.join(SCHEDULERS)}")
        check_sampling_settings(steps=steps, cfg=cfg, denoise=denoise, shift=shift)
        self._check_latent(latent)
        b = latent.shape[0]
        cond = self._check_conditioning("positive", cond, b)
        uncond = self._check_conditioning("negative", uncond, b) if uncond is not None and cfg != 1.0 else None
        sigmas = sigma_schedule(int(steps), scheduler, denoise, shift)
        n = max(len(sigmas) - 1, 0)  # denoise 0: no sigmas at all
        self.last_run = RunStats(steps=n, model_calls=model_calls(sampler, n) if n else 0, sampler=sampler)
        if not n:
            self.last_run.warnings.append("denoise is 0: nothing was denoised, the latent is returned unchanged")
        return latent.detach().to("cpu", torch.float32), cond, uncond, sigmas

    @staticmethod
    def _first_step(latent, sigmas, seed, callback):
        """The starting x (ComfyUI's seeded noise scaled to sigmas[0]) and the sampler's step callback."""
        check_seed(seed)
        x = noise_scaling(sigmas[0], seeded_noise(latent.shape, seed), latent)
        total = len(sigmas) - 1
        step_cb = None if callback is None else (lambda i, x_i, denoised: callback(i, total, x_i, denoised))
        return x, step_cb

    @torch.no_grad()
    def sample(self, latent: torch.Tensor, cond, uncond=None, *, seed: int, steps: int, cfg: float,
               sampler: str = "euler", scheduler: str = "simple", denoise: float = 1.0,
               shift: float = DEFAULT_SHIFT, callback: Optional[Callable] = None, cache=None) -> torch.Tensor:
        """Sample from ``latent`` (zeros for text-to-image) and return the denoised latent (float32, CPU).

        ``cond``/``uncond`` are lists of per-sample text features [T_i, C] of any lengths (one entry
        is broadcast over the batch). ``callback(step, total, x, denoised)`` runs after every step's
        model call and may raise to interrupt. ``cache``: an ``engine.cache.CacheConfig``; None = the
        engine config's, else the environment's (SGLANG_CACHE_DIT_*); ``CacheConfig(enabled=False)`` = off.
        """
        latent, cond, uncond, sigmas = self._start_run(latent, cond, uncond, steps, cfg, sampler, scheduler, denoise, shift)
        if len(sigmas) < 2:
            return latent.clone()
        x, step_cb = self._first_step(latent, sigmas, seed, callback)
        from .features.cache import make_runner
        runner = make_runner(cache if cache is not None else getattr(self.config, "cache", None), self.model,
                             self.last_run.model_calls, branches=2 if uncond is not None else 1)
        start = time.perf_counter()
        denoiser = self.make_denoiser(cond, uncond, cfg, runner=runner)
        default_runner = set_slot(self.model, "block_runner", runner) if runner is not None else None
        try:
            out = run_sampler(sampler, denoiser, x, sigmas, callback=step_cb, seed=seed)
        finally:
            if runner is not None:
                set_slot(self.model, "block_runner", default_runner)
                self.last_run.cache = runner.summary()
        self.last_run.sampling_seconds = time.perf_counter() - start
        return out
