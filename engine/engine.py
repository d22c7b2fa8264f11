"""Engine: the one sampling loop that nodes, the CLI, the server and benchmarks call.

One preparation (``Engine.prepare(request)``: a ``SampleRequest`` (engine/sampling_options.py), the one object every
entry point hands over -> ``Run``: checked inputs, sigmas, cache plan, noise, stats) and one loop
(``Engine.loop``) whose model calls are answered by whoever drives it: ``Engine.sample`` by its runner's own
run, the server's batcher (engine/serve/batcher.py) by its shared batched forward.

It owns the loop, so what runs the model (``Engine.runner``: the DiT in this process, ``LocalRunner``, or
on worker ranks, ``engine.parallel.RankedRunner``) sees the step index, the step count and the CFG
branch, and Cache-DiT decides per model call. Open one with ``engine.open_engine`` (engine/router.py),
for a file, the demo or a model already in memory.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .config import EngineConfig
from .errors import InputError, ModelOutputError
from .features.cache import CacheConfig, measured_speedup, run_config
from .features.offload import get_offload
from .image_parts import ImageParts
from .inputs import check_batch_index, check_conditioning, check_latent, check_noise_mask, check_sigmas
from .local import LocalRunner
from .runner import Runner
from .sampling import (
    SAMPLERS,
    cfg_on,
    inpaint_denoiser,
    model_calls,
    noise_scaling,
    prepare_mask,
    run_sampler,
    seeded_noise,
    sigma_schedule,
    step_of_call,
)
from .sampling_options import DEFAULT_SAMPLER, SampleRequest, SamplingOptions
from .text_to_image import Picture, generate
from .threads import default_threads, torch_threads


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
    sampler: str = DEFAULT_SAMPLER
    threads: int = 0  # the CPU threads torch ran the loop on (engine/threads.py); 0: not recorded

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
        if self.threads:
            d["threads"] = self.threads
        if self.cache:
            d["cache"] = {k: v for k, v in self.cache.items() if k not in ("diffs", "warnings")}
            d["speedup"] = self.speedup
        return d


def pad_text(features: Sequence[torch.Tensor], dtype: torch.dtype, device) -> tuple:
    """Per-sample [T_i, C] text features -> zero-padded [B, Tmax, C] on ``device`` and lengths [B] on the CPU
    (the model decides "is anything padded" from them without a device sync)."""
    lens = [int(f.shape[0]) for f in features]
    out = torch.zeros(len(features), max(lens), features[0].shape[-1], dtype=dtype, device=device)
    for i, f in enumerate(features):
        out[i, : lens[i]] = f.to(device=device, dtype=dtype)
    return out, torch.tensor(lens)


class Engine:
    def __init__(self, runner, config: Optional[EngineConfig] = None, source: str = ""):
        """``runner``: a LocalRunner / RankedRunner (where the DiT runs), or a model in memory (wrapped in a LocalRunner, which
        attaches the features ``config`` asks for)."""
        self.config = config or EngineConfig()
        self.runner: Runner = LocalRunner(runner, self.config) if isinstance(runner, nn.Module) else runner
        self.source = source
        self.dtype_reason = "asked for" if self.config.dtype else "the model's own (given in memory)"  # the router's
        self.last_run = RunStats()
        # CPU threads of a run (engine/threads.py: the demo's count for its shapes, else None = torch's); settable
        self.threads = default_threads(self.model_config, self.device)

    # -- what the engine is ----------------------------------------------------------------------------
    @property
    def model(self):
        """The DiT module when it runs in this process (None when it runs on worker ranks)."""
        return self.runner.model

    @property
    def model_config(self):
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        """Where the sampling loop's tensors live."""
        return self.runner.device

    @property
    def warnings(self) -> List[str]:
        """What was requested but could not be done here (shown by the nodes and the CLI)."""
        return self.runner.warnings

    @property
    def notes(self) -> List[str]:
        """What was chosen at load and why."""
        return self.runner.notes

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    @property
    def offload(self):
        """The layer-wise offloader of a local model, or None."""
        return None if self.model is None else get_offload(self.model)

    @property
    def loras(self) -> list:
        """[(path, strength), ...] active now."""
        return self.runner.active_loras()

    @property
    def lora_report(self) -> List[str]:
        """Messages about the active LoRAs' keys that were not applied."""
        return list(self.runner.lora_report)

    def describe(self) -> dict:
        """Everything the engine runs with, as plain data (what the nodes, CLI and server show)."""
        d = {"source": self.source, **self.runner.describe(), "dtype_reason": self.dtype_reason,
             "warnings": list(self.warnings),
             "notes": list(self.notes), "last_run": self.last_run.to_dict()}
        d["loras"] = [[p, s] for p, s in self.loras]
        return d

    # -- weights ---------------------------------------------------------------------------------------
    def set_loras(self, loras) -> List[str]:
        """Make exactly these LoRAs active: ``[(path, strength), ...]`` (engine/features/lora). Merged in float32
        into plain weights (the originals restorable bit-exactly without re-reading the checkpoint), a
        low-rank side path on FP8 / INT4 layers. The same list again does nothing. Returns messages about
        LoRA keys that were not applied."""
        return self.runner.set_loras(loras)

    def check_lora(self, path) -> List[str]:
        """Read a LoRA file against this model without applying it (LoRAError for a file that cannot be used);
        returns the messages about its keys that would not be applied."""
        return self.runner.check_lora(path)

    def release(self) -> int:
        """Give back the memory this engine can free without unloading the model (offload buffers; a remote
        engine unloads its weights from the ranks and stops them when nothing else uses them). Returns bytes."""
        return self.runner.release()

    # -- sampling --------------------------------------------------------------------------------------
    def dit_forward(self, x, timestep, text, lens) -> torch.Tensor:
        """One DiT forward, like ``model(x, timestep, text, lens)`` (benchmarks; no cache)."""
        return self.runner.dit(x, timestep, text, lens)

    def make_room(self, x_shape, text_tokens: int) -> Optional[str]:
        """Before a run (or a call outside one) on latents of ``x_shape`` [rows, C, h, w] (CFG rows counted) with
        ``text_tokens``: offload "auto" moves a resident model's blocks to host memory when this size's activations
        would not fit beside them (``LocalRunner.make_room``). Returns the message when it did."""
        return self.runner.make_room(x_shape, text_tokens)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """One model call outside any run (no cache, ``last_run`` untouched): the flow velocity in float32."""
        self.make_room(x.shape, text.shape[1])
        run = self.runner.run(None, cfg_batched=False)
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
        text, lens = pad_text(features, self.runner.dtype, self.device)

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
        plan = self._cache_plan(cache, calls) if calls else None
        if not calls and self._cache_config(cache).enabled:
            self.last_run.warnings.append(f"Cache-DiT is off for this run: it counts model calls for the samplers "
                                          f"{', '.join(SAMPLERS)}, not '{sampler}'")
        return ModelCalls(self.last_run, self.runner.run(plan, cfg_batched=cfg_batched))

    def _cache_plan(self, cache, calls: int):
        """The resolved Cache-DiT settings of a run of ``calls`` model calls, or None when the cache is off."""
        cc = self._cache_config(cache)
        return cc.resolve(calls, self.model_config.num_layers) if cc.enabled else None

    def _cache_config(self, cache) -> CacheConfig:
        """The run's Cache-DiT: ``cache``, else the engine config's, else off. The environment is read by the
        entry points (``features.cache.resolve_config``), never here: a run does not depend on when it starts."""
        cc = run_config(cache if cache is not None else self.config.cache)
        return CacheConfig(enabled=False) if cc is None else cc

    def prepare(self, request: SampleRequest) -> "Run":
        """Everything a run needs before its first model call, for ``Engine.sample`` and the server's batcher alike:
        every input of ``request`` checked (InputError naming what is wrong; CacheConfigError for the cache), the
        sigmas, the cache plan, ComfyUI's seeded noise and the run's fresh ``RunStats``. Touches nothing of the
        engine's."""
        options = request.options
        options.check()
        if request.loras is not None:
            raise InputError("loras: LoRAs by name are sgld serve's (its --lora-dir); on an engine use "
                             "Engine.set_loras, or a batcher Job's lora_set")
        mc = self.model_config
        latent = request.latent
        check_latent(mc, latent)
        b = latent.shape[0]
        cond = check_conditioning(mc, "positive", request.cond, b)
        uncond = check_conditioning(mc, "negative", request.uncond, b) if cfg_on(options.cfg, request.uncond) else None
        mask = check_noise_mask(request.noise_mask)
        batch_index = check_batch_index(request.batch_index, b)
        options = dataclasses.replace(options, seed=int(options.seed), cfg=float(options.cfg))
        sigmas = (sigma_schedule(int(options.steps), options.scheduler, options.denoise, options.shift)
                  if request.sigmas is None else check_sigmas(request.sigmas, options.steps))
        n = max(len(sigmas) - 1, 0)  # denoise 0: no sigmas at all
        stats = RunStats(steps=n, model_calls=model_calls(options.sampler, n) if n else 0, sampler=options.sampler)
        latent = latent.detach().to("cpu", torch.float32)
        if not n:
            stats.warnings.append("denoise is 0: nothing was denoised, the latent is returned unchanged")
            return Run(latent, cond, uncond, options, sigmas, None, None, None, stats)
        plan = self._cache_plan(request.cache, stats.model_calls)
        mask = None if mask is None else prepare_mask(mask, latent.shape)
        noise = request.noise
        if noise is None:
            noise = seeded_noise(latent.shape, options.seed, batch_index)
        elif tuple(noise.shape) != tuple(latent.shape):
            raise InputError(f"noise has shape {tuple(noise.shape)}; it must be the latent's, {tuple(latent.shape)}")
        else:  # the caller's own draw (a diffusers-style torch.Generator): float32 on the CPU, like seeded_noise
            noise = noise.detach().to("cpu", torch.float32)
        return Run(latent, cond, uncond, options, sigmas, mask, noise, plan, stats)

    @torch.no_grad()
    def loop(self, run: "Run", answer, callback: Optional[Callable] = None) -> torch.Tensor:
        """The one sampling loop: ``run`` (from ``prepare``) from its noised start through its sampler, every model
        call answered by ``answer`` (``call(x, sigma, text, lens) -> (velocity, computed)`` and ``finish() -> cache
        summary or None``: the forward's own run for ``Engine.sample``, the shared batched forward for the server's
        batcher). ``callback(step, total, x, denoised)`` after each step. Returns the latent (float32, CPU)."""
        if not run.steps:
            return run.latent.clone()
        total = run.steps
        step_cb = None if callback is None else (lambda i, x_i, denoised: callback(i, total, x_i, denoised))
        calls = ModelCalls(run.stats, answer)
        options = run.options
        try:
            denoiser = self.make_denoiser(run.cond, run.uncond, options.cfg, calls)
            if run.mask is not None:
                denoiser = inpaint_denoiser(denoiser, run.mask, run.noise, run.latent)
            x = noise_scaling(run.sigmas[0], run.noise, run.latent)
            return run_sampler(options.sampler, denoiser, x, run.sigmas, callback=step_cb, seed=options.seed)
        finally:
            calls.finish()

    def sample(self, latent: torch.Tensor, cond, uncond=None, *, callback: Optional[Callable] = None,
               **fields) -> torch.Tensor:
        """Sample from ``latent`` (zeros for text-to-image) and return the denoised latent (float32, CPU):
        ``sample_request`` of ``SampleRequest(latent=, cond=, uncond=, **fields)``. ``fields``: the sampling
        options (``SamplingOptions``' fields: seed, steps, cfg, sampler, scheduler, denoise, shift) and the request's
        other inputs (sigmas, noise_mask, batch_index, noise, cache)."""
        return self.sample_request(SampleRequest(latent=latent, cond=cond, uncond=uncond, **fields), callback)

    def pictures(self, parts: ImageParts, prompts: Sequence[str], negatives: Optional[Sequence[str]], width: int, height: int,
                 callback: Optional[Callable] = None, **options) -> torch.Tensor:
        """The latent [B, C, h, w] of ``prompts`` through the one text-to-image path (engine/text_to_image.py), for a
        caller below it (a bundled model's own ``generate``): ``parts`` its ImageParts, ``options`` SamplingOptions'
        fields (steps and cfg given)."""
        picture = Picture(list(prompts), None if negatives is None else list(negatives), width, height,
                          SamplingOptions(**options))
        return generate(self, parts, picture, callback)

    def sample_request(self, request: SampleRequest, callback: Optional[Callable] = None) -> torch.Tensor:
        """Run ``request`` and return the denoised latent (float32, CPU).

        ``cond``/``uncond`` are lists of per-sample text features [T_i, C] of any lengths (one entry
        is broadcast over the batch). ``callback(step, total, x, denoised)`` runs after every step's
        model call and may raise to interrupt. ``cache``: an ``engine.features.cache.CacheConfig``; None =
        the engine config's, else off (the SGLANG_CACHE_DIT_* environment is read by the entry points, not here).
        ``sigmas``: the caller's own schedule (``steps`` + 1 values) instead of scheduler, denoise and shift.
        ``noise``: the caller's own starting noise (the latent's shape) instead of the seed's (ErnieImagePipeline
        with a ``generator``).

        Inpainting, as ComfyUI's KSampler: ``noise_mask`` (a LATENT's: [N, 1, h, w] at any size, 1 = repaint,
        0 = keep) is scaled to the latent and blended in at every model call (``sampling.inpaint_denoiser``);
        with ``denoise < 1`` the repainted region starts from the input too. ``batch_index`` (a LATENT's, from
        LatentFromBatch): which sample of the seed's batch noise each latent gets.

        ``prepare`` then ``loop`` with this engine's forward answering the calls (the server's batcher runs the
        same two with its shared forward instead).
        """
        prepared = self.prepare(request)
        self.last_run = prepared.stats
        if not prepared.steps:
            return prepared.latent.clone()
        moved = self.make_room(prepared.call_shape, prepared.text_tokens)
        if moved:
            prepared.stats.warnings.append(moved)
        with torch_threads(self.threads):
            prepared.stats.threads = torch.get_num_threads()
            return self.loop(prepared, self.runner.run(prepared.plan, cfg_batched=prepared.cfg_batched), callback)


@dataclass
class Run:
    """One prepared sampling run (``Engine.prepare``): checked inputs, sigmas, cache plan, noise, statistics."""

    latent: torch.Tensor  # [B, C, h, w] float32 CPU: the input (zeros for text-to-image)
    cond: List[torch.Tensor]  # per-sample text features [T_i, C]
    uncond: Optional[List[torch.Tensor]]  # None: no CFG (none given, or cfg 1)
    options: SamplingOptions  # the request's, seed an int and cfg a float
    sigmas: torch.Tensor
    mask: Optional[torch.Tensor]  # the denoise mask at the latent's shape (inpainting), or None
    noise: Optional[torch.Tensor]  # ComfyUI's seeded noise for the latent (None when there is no step)
    plan: object  # the resolved Cache-DiT settings, or None when off
    stats: RunStats

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def cfg_batched(self) -> bool:
        """Every model call holds the cond samples, then as many uncond ones."""
        return self.uncond is not None

    @property
    def rows(self) -> int:
        """Samples in each model call (CFG branches count)."""
        return self.latent.shape[0] * (2 if self.cfg_batched else 1)

    @property
    def call_shape(self) -> tuple:
        """The x of each model call: [rows, C, h, w]."""
        return (self.rows,) + tuple(self.latent.shape[1:])

    @property
    def text_tokens(self) -> int:
        """The padded text length of each model call (the longest prompt or negative)."""
        return max(int(t.shape[0]) for t in self.cond + (self.uncond or []))


class ModelCalls:
    """The model calls of one run: velocity through ``run`` (the forward's run, with the Cache-DiT runner in the
    block loop when on, or the batcher's shared forward), each call's time and whether the DiT was computed in
    ``stats``, NaN/inf refused."""

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
