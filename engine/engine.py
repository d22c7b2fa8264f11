"""Engine: the one sampling loop that nodes, the CLI, the server and benchmarks call.

It owns the loop, so what runs the model (``forward``: the DiT in this process, ``LocalForward``, or
on worker ranks, ``engine.parallel.RemoteForward``) sees the step index, the step count and the CFG
branch, and Cache-DiT decides per model call. Open one with ``engine.open_engine`` (engine/router.py);
``Engine(model, config)`` wraps a model already in memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .config import EngineConfig
from .errors import ModelOutputError
from .features.cache import measured_speedup, resolve_config
from .features.offload import get_offload
from .inputs import (check_batch_index, check_conditioning, check_latent, check_noise_mask, check_sampler,
                     check_sampling_settings, check_seed, check_sigmas)
from .local import LocalForward
from .sampling import (DEFAULT_SHIFT, SAMPLERS, cfg_on, inpaint_denoiser, model_calls, noise_scaling, prepare_mask, run_sampler,
                       seeded_noise, sigma_schedule, step_of_call)


@dataclass
class RunStats:
    """What one ``Engine.sample`` call did (read ``engine.last_run``)."""

    steps: int = 0
    model_calls: int = 0
    sampling_seconds: float = 0.0
    step_mask: List[bool] = field(default_factory=list)  # True = the DiT was computed at that model call
    call_seconds: List[float] = field(default_factory=list)  # wall time of each model call
    cache: dict = field(default_factory=dict)  # Cache-DiT summary (engine.features.cache); empty when off
    warnings: List[str] = field(default_factory=list)  # what this run did other than asked (denoise 0, ...)
    sampler: str = "euler"

    def nonfinite_output(self) -> ModelOutputError:
        """The error for a model call (the last one recorded) whose output held NaN or inf."""
        call = len(self.call_seconds)
        return ModelOutputError(
            f"the model produced NaN/inf at step {step_of_call(self.sampler, call - 1) + 1} of {self.steps} "
            f"(model call {call} of {self.model_calls}): the weights may be damaged (a checkpoint holding NaN/inf), "
            "or the dtype overflowed (try fp32 or bf16)")

    @property
    def calls_computed(self) -> int:
        return sum(self.step_mask)

    @property
    def speedup(self) -> Optional[float]:
        """Measured model-call speedup of the cache against computing every call (1.0 when off)."""
        return measured_speedup(self.call_seconds, self.step_mask) if self.cache else 1.0

    def to_dict(self) -> dict:
        """``warnings``: the run's own and the cache's (a custom steps_mask fitted to the run's length)."""
        d = {"steps": self.steps, "model_calls": self.model_calls, "calls_computed": self.calls_computed,
             "sampling_seconds": round(self.sampling_seconds, 4), "step_mask": "".join("x" if m else "." for m in self.step_mask),
             "warnings": list(self.warnings) + list(self.cache.get("warnings", []))}
        if self.cache:
            d["cache"] = {k: v for k, v in self.cache.items() if k not in ("diffs", "warnings")}
            d["speedup"] = self.speedup
        return d


def pad_text(features: Sequence[torch.Tensor], dtype: torch.dtype, device) -> tuple:
    """Per-sample [T_i, C] text features -> zero-padded [B, Tmax, C] and lengths [B]."""
    lens = [int(f.shape[0]) for f in features]
    out = torch.zeros(len(features), max(lens), features[0].shape[-1], dtype=dtype, device=device)
    for i, f in enumerate(features):
        out[i, : lens[i]] = f.to(device=device, dtype=dtype)
    return out, torch.tensor(lens, device=device)


class Engine:
    def __init__(self, forward, config: Optional[EngineConfig] = None, source: str = ""):
        """``forward``: a LocalForward / RemoteForward, or a model in memory (wrapped in a LocalForward, which
        attaches the features ``config`` asks for)."""
        self.config = config or EngineConfig()
        self.forward = LocalForward(forward, self.config) if isinstance(forward, nn.Module) else forward
        self.source = source
        self.last_run = RunStats()

    # -- what the engine is ----------------------------------------------------------------------------
    @property
    def model(self):
        """The DiT module when it runs in this process (None when it runs on worker ranks)."""
        return self.forward.model

    @property
    def model_config(self):
        return self.forward.model_config

    @property
    def device(self) -> torch.device:
        """Where the sampling loop's tensors live."""
        return self.forward.device

    @property
    def warnings(self) -> List[str]:
        """What was requested but could not be done here (shown by the nodes and the CLI)."""
        return self.forward.warnings

    @property
    def notes(self) -> List[str]:
        """What was chosen at load and why."""
        return self.forward.notes

    @property
    def attention_backend(self) -> str:
        return self.forward.attention_backend

    @property
    def offload(self):
        """The layer-wise offloader of a local model, or None."""
        return None if self.model is None else get_offload(self.model)

    @property
    def loras(self) -> list:
        """[(path, strength), ...] active now."""
        return self.forward.active_loras()

    @property
    def lora_report(self) -> List[str]:
        """Messages about the active LoRAs' keys that were not applied."""
        return list(self.forward.lora_report)

    def describe(self) -> dict:
        """Everything the engine runs with, as plain data (what the nodes, CLI and server show)."""
        d = {"source": self.source, **self.forward.describe(), "warnings": list(self.warnings),
             "notes": list(self.notes), "last_run": self.last_run.to_dict()}
        d["loras"] = [[p, s] for p, s in self.loras]
        return d

    # -- weights ---------------------------------------------------------------------------------------
    def set_loras(self, loras) -> List[str]:
        """Make exactly these LoRAs active: ``[(path, strength), ...]`` (engine/features/lora). Merged in float32
        into plain weights (the originals restorable bit-exactly without re-reading the checkpoint), a
        low-rank side path on FP8 / INT4 layers. The same list again does nothing. Returns messages about
        LoRA keys that were not applied."""
        return self.forward.set_loras(loras)

    def check_lora(self, path) -> List[str]:
        """Read a LoRA file against this model without applying it (LoRAError for a file that cannot be used);
        returns the messages about its keys that would not be applied."""
        return self.forward.check_lora(path)

    def release(self) -> int:
        """Give back the memory this engine can free without unloading the model (offload buffers; a remote
        engine unloads its weights from the ranks and stops them when nothing else uses them). Returns bytes."""
        return self.forward.release()

    # -- sampling --------------------------------------------------------------------------------------
    def dit_forward(self, x, timestep, text, lens) -> torch.Tensor:
        """One DiT forward, like ``model(x, timestep, text, lens)`` (benchmarks; no cache)."""
        return self.forward.dit(x, timestep, text, lens)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """One model call outside any run (no cache, ``last_run`` untouched): the flow velocity in float32."""
        run = self.forward.run(None, cfg_batched=False)
        try:
            return run.call(x, sigma, text, lens)[0]
        finally:
            run.finish()

    def make_denoiser(self, cond: List[torch.Tensor], uncond: Optional[List[torch.Tensor]], cfg: float,
                      calls: "ModelCalls"):
        """denoised(x, sigma) with CFG as ComfyUI computes it: uncond + (cond - uncond) * cfg on x0, through
        ``calls`` (this run's model calls: velocity, cache and statistics)."""
        use_cfg = cfg_on(cfg, uncond)
        features = cond + uncond if use_cfg else cond
        text, lens = pad_text(features, self.forward.dtype, self.device)

        def denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            xs = torch.cat([x, x]) if use_cfg else x
            sig = torch.cat([sigma, sigma]) if use_cfg else sigma
            denoised = xs - calls(xs, sig, text, lens) * sig.view(-1, 1, 1, 1)
            if not use_cfg:
                return denoised
            cond_pred, uncond_pred = denoised[:b], denoised[b:]
            return uncond_pred + (cond_pred - uncond_pred) * cfg

        return denoiser

    def begin_run(self, sigmas: torch.Tensor, sampler: str, cfg_batched: bool, cache=None) -> "ModelCalls":
        """The model calls of one run whose sampling loop is outside the engine (ComfyUI's samplers on the
        MODEL output): ``last_run`` restarts, Cache-DiT counts the calls of ``sampler`` over ``sigmas``.
        ``cfg_batched``: every call holds the cond samples, then as many uncond ones. Call ``finish()``
        at the end. A sampler the cache cannot count calls for runs uncached, with a warning."""
        n = max(len(sigmas) - 1, 0)
        calls = model_calls(sampler, n) if sampler in SAMPLERS else 0
        if sampler == "heun" and n and float(sigmas[-1]) != 0.0:
            calls += 1  # heun's second call on the last step too when the schedule does not end at 0
        self.last_run = RunStats(steps=n, model_calls=calls, sampler=sampler)
        plan = self._cache_plan(cache) if calls else None
        if not calls and resolve_config(cache if cache is not None else self.config.cache).enabled:
            self.last_run.warnings.append(f"Cache-DiT is off for this run: it counts model calls for the samplers "
                                          f"{', '.join(SAMPLERS)}, not '{sampler}'")
        return ModelCalls(self.last_run, self.forward.run(plan, cfg_batched=cfg_batched))

    def _start_run(self, latent, cond, uncond, steps, cfg, sampler, scheduler, denoise, shift, seed, noise_mask, batch_index,
                   sigmas=None):
        """Check every input (InputError naming what is wrong), make the sigmas and reset ``last_run``.
        Returns (latent as float32 on the CPU, cond, uncond or None when unused, sigmas, the denoise mask
        made for the latent or None, batch_index or None)."""
        check_sampler(sampler, scheduler)
        check_sampling_settings(steps=steps, cfg=cfg, denoise=denoise, shift=shift)
        check_seed(seed)
        mc = self.model_config
        check_latent(mc, latent)
        b = latent.shape[0]
        cond = check_conditioning(mc, "positive", cond, b)
        uncond = check_conditioning(mc, "negative", uncond, b) if cfg_on(cfg, uncond) else None
        mask = check_noise_mask(noise_mask)
        batch_index = check_batch_index(batch_index, b)
        sigmas = sigma_schedule(int(steps), scheduler, denoise, shift) if sigmas is None else check_sigmas(sigmas, steps)
        n = max(len(sigmas) - 1, 0)  # denoise 0: no sigmas at all
        self.last_run = RunStats(steps=n, model_calls=model_calls(sampler, n) if n else 0, sampler=sampler)
        if not n:
            self.last_run.warnings.append("denoise is 0: nothing was denoised, the latent is returned unchanged")
        mask = None if mask is None else prepare_mask(mask, latent.shape)
        return latent.detach().to("cpu", torch.float32), cond, uncond, sigmas, mask, batch_index

    @staticmethod
    def _first_step(latent, sigmas, seed, batch_index, callback):
        """ComfyUI's seeded noise, the starting x (that noise scaled to sigmas[0]) and the sampler's step callback."""
        noise = seeded_noise(latent.shape, seed, batch_index)
        total = len(sigmas) - 1
        step_cb = None if callback is None else (lambda i, x_i, denoised: callback(i, total, x_i, denoised))
        return noise, noise_scaling(sigmas[0], noise, latent), step_cb

    def _cache_plan(self, cache):
        """The resolved Cache-DiT settings of this run, or None when the cache is off."""
        cc = resolve_config(cache if cache is not None else self.config.cache)
        return cc.resolve(self.last_run.model_calls, self.model_config.num_layers) if cc.enabled else None

    @torch.no_grad()
    def sample(self, latent: torch.Tensor, cond, uncond=None, *, seed: int, steps: int, cfg: float,
               sampler: str = "euler", scheduler: str = "simple", denoise: float = 1.0,
               shift: float = DEFAULT_SHIFT, callback: Optional[Callable] = None, cache=None,
               noise_mask: Optional[torch.Tensor] = None, batch_index: Optional[Sequence[int]] = None,
               sigmas=None) -> torch.Tensor:
        """Sample from ``latent`` (zeros for text-to-image) and return the denoised latent (float32, CPU).

        ``cond``/``uncond`` are lists of per-sample text features [T_i, C] of any lengths (one entry
        is broadcast over the batch). ``callback(step, total, x, denoised)`` runs after every step's
        model call and may raise to interrupt. ``cache``: an ``engine.features.cache.CacheConfig``; None =
        the engine config's, else the environment's (SGLANG_CACHE_DIT_*); ``CacheConfig(enabled=False)`` = off.
        ``sigmas``: the caller's own schedule (``steps`` + 1 values) instead of scheduler, denoise and shift.

        Inpainting, as ComfyUI's KSampler: ``noise_mask`` (a LATENT's: [N, 1, h, w] at any size, 1 = repaint,
        0 = keep) is scaled to the latent and blended in at every model call (``sampling.inpaint_denoiser``);
        with ``denoise < 1`` the repainted region starts from the input too. ``batch_index`` (a LATENT's, from
        LatentFromBatch): which sample of the seed's batch noise each latent gets.
        """
        latent, cond, uncond, sigmas, mask, batch_index = self._start_run(
            latent, cond, uncond, steps, cfg, sampler, scheduler, denoise, shift, seed, noise_mask, batch_index, sigmas)
        if len(sigmas) < 2:
            return latent.clone()
        noise, x, step_cb = self._first_step(latent, sigmas, seed, batch_index, callback)
        plan = self._cache_plan(cache)
        calls = ModelCalls(self.last_run, self.forward.run(plan, cfg_batched=uncond is not None))
        denoiser = self.make_denoiser(cond, uncond, cfg, calls)
        if mask is not None:
            denoiser = inpaint_denoiser(denoiser, mask, noise, latent)
        try:
            out = run_sampler(sampler, denoiser, x, sigmas, callback=step_cb, seed=seed)
        finally:
            calls.finish()
        return out


class ModelCalls:
    """The model calls of one run: velocity through the forward's run (the Cache-DiT runner in the block
    loop when on), each call's time and whether the DiT was computed in ``stats``, NaN/inf refused."""

    def __init__(self, stats: RunStats, run):
        self.stats, self.run = stats, run
        self.started = time.perf_counter()

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Velocity (float32, on x's device) for x at sigma [B] with padded text [B, T, C] and lengths [B]."""
        t0 = time.perf_counter()
        v, computed = self.run.call(x, sigma, text, lens)
        self.stats.call_seconds.append(time.perf_counter() - t0)
        self.stats.step_mask.append(computed)
        if not torch.isfinite(v).all():  # one cheap check a call: stop at the first bad step
            raise self.stats.nonfinite_output()
        return v

    def finish(self) -> None:
        """The block loop back to the model's own; the cache's summary into ``stats``."""
        summary = self.run.finish()
        if summary:
            self.stats.cache = summary
        self.stats.sampling_seconds = time.perf_counter() - self.started
