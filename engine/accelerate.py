"""``engine.accelerate(pipe, ...)``: an existing diffusers ``ErnieImagePipeline`` runs its transformer on this
project's engine (Cache-DiT, quantization, offload, regional compile, attention backends), the rest of diffusers'
pipeline unchanged; ``engine.restore(pipe)`` gives the original transformer back.

The engine's DiT is built from the diffusers transformer's own tensors (the same names; copied, so LoRA merges
and quantization never touch the original), and sits in ``pipe.transformer`` as ``EngineTransformer``, a module
with diffusers' call signature. Diffusers' loop calls it once per scheduler step; Cache-DiT needs the run's
length, so a run starts at the scheduler's first timestep (its ``sigmas`` give the step count) and ends after
as many calls. While accelerated, the original transformer waits in CPU memory (moved back by ``restore``).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .config import EngineConfig
from .errors import InputError
from .io.load import build_model
from .models.family import Family, families
from .pipeline import cache_option
from .router import open_engine
from .sampling import to_sigma


def _family_of_transformer(original) -> Optional[Family]:
    """The family whose ``diffusers_class`` ``pipe.transformer`` is (by class name: diffusers is never imported)."""
    name = type(original).__name__
    return next((f for f in families() if f.diffusers_class and f.diffusers_class == name), None)


class EngineTransformer(nn.Module):
    """Stands in for diffusers' transformer (the family's ``diffusers_class``) in its pipeline: same call, same ``config``, the
    engine computing. ``original`` (not a submodule, so ``pipe.to`` leaves it alone) is what ``restore`` gives back."""

    def __init__(self, engine, original: nn.Module, original_device: torch.device, pipe, cache=None):
        super().__init__()
        self.engine, self.cache = engine, cache
        self.__dict__["original"] = original
        self.original_device = original_device
        self.config = original.config
        self._pipe = weakref.ref(pipe)
        self._calls, self._done, self._total = None, 0, 0

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.runner.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def _run_calls(self, timestep: torch.Tensor, cfg: bool):
        """This run's model calls (Cache-DiT counts them from the scheduler's sigmas), or None outside one."""
        pipe = self._pipe()
        scheduler = getattr(pipe, "scheduler", None)
        timesteps, sigmas = getattr(scheduler, "timesteps", None), getattr(scheduler, "sigmas", None)
        if timesteps is None or sigmas is None or not len(timesteps):
            return None
        t0, start = float(timestep.reshape(-1)[0]), float(timesteps[0])
        first = abs(t0 - start) <= abs(start) / 128  # diffusers hands the timestep over in the model's dtype (bf16)
        if self._calls is not None and (first or self._done >= self._total):
            self.finish()
        if self._calls is None:
            if not first:
                return None  # a call outside a scheduler run: computed, uncached
            self._total = len(timesteps)
            self._calls = self.engine.begin_run(sigmas.detach().float().cpu(), "euler", cfg_batched=cfg, cache=self.cache)
        return self._calls

    def finish(self) -> None:
        if self._calls is not None:
            self._calls.finish()
        self._calls, self._done = None, 0

    def forward(self, hidden_states, timestep, text_bth, text_lens, return_dict: bool = True):
        pipe = self._pipe()
        cfg = bool(getattr(pipe, "do_classifier_free_guidance", False)) and hidden_states.shape[0] % 2 == 0
        args = [hidden_states, to_sigma(timestep.float()), text_bth, text_lens.to(torch.long)]
        if cfg:  # diffusers batches [uncond, cond]; the engine and its cache take cond first
            half = hidden_states.shape[0] // 2
            args = [torch.cat([a[half:], a[:half]]) for a in args]
        calls = self._run_calls(timestep, cfg)
        if calls is None:
            v = self.engine.velocity(*args)
        else:
            v = calls(*args)
            self._done += 1
            if self._done >= self._total:
                self.finish()
        if cfg:
            v = torch.cat([v[half:], v[:half]])
        out = v.to(hidden_states.dtype)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)


def _engine_model(original: nn.Module, family: Family, device, dtype):
    """Our DiT of ``family`` with a copy of the diffusers transformer's tensors, on ``device`` in ``dtype``."""
    state = original.state_dict()
    try:
        cfg = family.config_from_shapes({k: tuple(v.shape) for k, v in state.items()}, dict(original.config),
                                        source="pipe.transformer.config")
    except ValueError as e:
        raise InputError(f"pipe.transformer: not an {family.title} transformer this engine can run: {e}") from None
    model = build_model(cfg)
    model.load_state_dict({k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
                           for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def accelerate(pipe, cache=None, quant: Optional[str] = None, offload: str = "none", compile=False,
               attention: str = "auto", device=None, **engine_options):
    """Swap ``pipe.transformer`` (diffusers' transformer of a family of engine/models/) for the engine's DiT with these features
    (EngineConfig's options: quant, offload, compile, attention, ...; ``cache``: a Cache-DiT preset name, "off" or
    a CacheConfig, None = the SGLANG_CACHE_DIT_* environment). Returns ``pipe``; ``restore(pipe)`` undoes it."""
    original = getattr(pipe, "transformer", None)
    if isinstance(original, EngineTransformer):
        raise InputError("this pipeline is already accelerated; engine.restore(pipe) first to change its options")
    family = _family_of_transformer(original)
    if family is None:
        known = " or ".join(f.diffusers_class for f in families() if f.diffusers_class)
        raise InputError(f"engine.accelerate takes diffusers' ErnieImagePipeline: pipe.transformer is "
                         f"{type(original).__name__}, not {known}")
    original_device = next(original.parameters()).device
    dtype = original.dtype
    target = torch.device(device) if device is not None else original_device
    config = EngineConfig(device=str(target), quant=quant, offload=offload, compile=compile, attention=attention,
                          **engine_options)
    cache = cache_option(cache)
    if config.world_size > 1:
        raise InputError("engine.accelerate runs the DiT in this process; for several GPUs open "
                         "engine.ErnieImagePipeline.from_pretrained(path, num_gpus=...) on the release's files")
    if original_device.type != "cpu":
        original.to("cpu")  # wait in CPU memory, not beside the engine's copy
    try:
        model = _engine_model(original, family, target, dtype)
        engine = open_engine(model, config, label=f"{family.diffusers_class} (accelerated)")
    except BaseException:
        original.to(original_device)
        raise
    pipe.transformer = EngineTransformer(engine, original, original_device, pipe, cache)
    return pipe


def restore(pipe):
    """Give ``pipe`` its original transformer back (on its device); the engine's copy is dropped. Returns ``pipe``."""
    current = getattr(pipe, "transformer", None)
    if not isinstance(current, EngineTransformer):
        raise InputError("engine.restore: this pipeline is not accelerated (pipe.transformer is "
                         f"{type(current).__name__})")
    current.finish()
    original = current.original
    current.engine.release()
    pipe.transformer = original.to(current.original_device)
    return pipe
