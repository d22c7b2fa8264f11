"""The sampling options (steps, cfg, sampler, scheduler, seed, shift, denoise), declared once like
EngineConfig's (engine/options.py): the CLI's flags, the server's request fields and the nodes' widgets
derive from ``SamplingOptions``. Steps and cfg left unset are the model's: ``model_defaults(source)``
is the one rule, for every entry point, that says which model a file is (docs/sampling.md).

A run travels as one ``SampleRequest`` (its inputs and its SamplingOptions) from every entry point (the CLI, the
nodes, the server's routes and batcher, the pipeline, the /v1/sample wire: engine/sample_wire.py) to
``Engine.prepare``: a new option is declared here and reaches them all."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .errors import CheckpointError
from .inputs import check_sampler, check_sampling_settings, check_seed
from .io.checkpoint import Checkpoint
from .models import families
from .models.bundle import Bundle, bundle_of_file, bundles, named_file
from .options import declared, default_of, flag_dest, from_args, option
from .sampling import DEFAULT_SHIFT, MAX_CFG, MAX_SEED, MAX_SHIFT, MAX_STEPS, SAMPLERS, SCHEDULERS

# The per-model defaults of the help texts and the pipeline: the first family's (ERNIE-Image's release: Base 50
# steps at guidance 4, Turbo 8 steps without CFG) and the demo model's own (what it was trained and judged with);
# a file of another family takes its own family's (``model_defaults``).
MODEL_DEFAULTS = {
    **{kind: dict(values) for kind, values in families()[0].sampling_defaults.items()},
    **{bundle.name: dict(bundle.defaults) for bundle in bundles()},
}


def _per_model(key: str, kinds=tuple(MODEL_DEFAULTS)) -> str:
    """The defaults of ``key`` as the help texts list them: "Base 50, Turbo 8, demo 30" (a bundle by its name)."""
    names = {bundle.name for bundle in bundles()}
    return ", ".join(f"{kind if kind in names else kind.capitalize()} {MODEL_DEFAULTS[kind][key]:g}" for kind in kinds)


@dataclass
class SamplingOptions:
    """One run's sampling settings. ``steps`` / ``cfg`` None: the model's (``with_model_defaults``)."""

    seed: int = option(
        0, int, "noise seed, 0 to 2**64-1 (ComfyUI's range; default 0)", low=0, high=MAX_SEED, flag="--seed",
        api="seed", widget="seed", widget_required=True,
        widget_extra={"control_after_generate": True}, tooltip="The random seed used for creating the noise.")
    steps: Optional[int] = option(
        None, int, f"sampling steps, 1 to {MAX_STEPS} (default: the model's: {_per_model('steps')})",
        optional=True, low=1, high=MAX_STEPS, flag="--steps", api="num_inference_steps", widget="steps",
        widget_default=20, widget_required=True,
        tooltip=f"The number of denoising steps (ERNIE-Image {_per_model('steps', ('base', 'turbo'))}).")
    cfg: Optional[float] = option(
        None, float, f"guidance scale, 0 to {MAX_CFG:g} (default: the model's: {_per_model('cfg')}; 1 runs no "
        "negative branch)", optional=True, low=0.0, high=MAX_CFG, flag="--cfg", api="guidance_scale",
        widget="cfg", widget_default=4.0, widget_step=0.1, widget_extra={"round": 0.01}, widget_required=True,
        tooltip=f"Classifier-free guidance scale (ERNIE-Image {_per_model('cfg', ('base', 'turbo'))}; 1 skips the "
                "negative prompt).")
    sampler: str = option(
        "euler", str, "sampler (default euler)", choices=SAMPLERS, any_case=True, flag="--sampler",
        widget="sampler_name", widget_required=True, tooltip="The sampling algorithm.")
    scheduler: str = option(
        "simple", str, "sigma schedule (default simple)", choices=SCHEDULERS, any_case=True, flag="--scheduler",
        widget="scheduler", widget_required=True, tooltip="The sigma schedule.")
    denoise: float = option(
        1.0, float, "how much of the input to replace, 0 to 1 (default 1: all of it)", low=0.0, high=1.0,
        widget="denoise", widget_step=0.01, widget_required=True,
        tooltip="How much of the latent to replace; below 1 keeps the input's structure.")
    shift: float = option(
        DEFAULT_SHIFT, float, f"sigma shift, above 0 to {MAX_SHIFT:g} (default: a --model-path release's "
        f"scheduler_config.json's, else {DEFAULT_SHIFT:g}, ComfyUI's for ERNIE-Image)", low=0.0, low_open=True,
        high=MAX_SHIFT, flag="--shift", flag_default=None)

    def check(self) -> None:
        """Every value in range before any work: InputError naming the option and what is allowed (the limits of
        engine/sampling.py). ``steps`` / ``cfg`` must be set by now (the model's defaults filled in)."""
        check_sampler(self.sampler, self.scheduler)
        check_sampling_settings(steps=self.steps, cfg=self.cfg, denoise=self.denoise, shift=self.shift)
        check_seed(self.seed)

    @classmethod
    def of_widgets(cls, values: dict) -> "SamplingOptions":
        """The options of a node's widget values ({widget: value}), as given: ``check`` (the engine's, at prepare)
        names a bad one. A value of no option's widget is a TypeError naming it."""
        by_widget = {opt.widget: name for name, opt in declared(cls).items() if opt.widget}
        unknown = sorted(set(values) - set(by_widget))
        if unknown:
            raise TypeError(f"unknown sampling input(s) {', '.join(unknown)}; allowed: {', '.join(by_widget)}")
        return cls(**{by_widget[widget]: value for widget, value in values.items()})


@dataclass(kw_only=True)
class SampleRequest(SamplingOptions):
    """One sampling run as every entry point hands it over (``Engine.sample_request``, a batcher ``Job``, the
    /v1/sample wire): SamplingOptions' fields, inherited (a new option is a field of every request with no change
    here), and the run's inputs, given by name."""

    latent: Any  # [B, C, h, w] float (zeros for text-to-image); a batcher Job may hold one sample [C, h, w]
    cond: Any  # per-sample text features [T_i, C] (one entry is used for every sample); a Job: one tensor too
    uncond: Any = None  # the negative's, as ``cond`` (None, or cfg 1: no CFG)
    sigmas: Optional[torch.Tensor] = None  # the caller's own schedule (steps + 1 values) instead of scheduler / denoise / shift
    noise_mask: Optional[torch.Tensor] = None  # a LATENT's (inpainting): 1 repaint, 0 keep, any size
    batch_index: Optional[List[int]] = None  # a LATENT's (LatentFromBatch): the seed's draw of each sample
    noise: Optional[torch.Tensor] = None  # the caller's own starting noise instead of the seed's
    cache: Any = None  # a CacheConfig for this run (None: the engine's)
    # per-request LoRAs by name, [(name, strength), ...], that sgld serve resolves in its --lora-dir (None: the
    # engine's own set); a local engine's LoRAs are Engine.set_loras, so Engine.prepare refuses them
    loras: Any = None

    @property
    def options(self) -> SamplingOptions:
        """The request's sampling options as their own object."""
        return SamplingOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingOptions)})

    @classmethod
    def from_options(cls, latent, cond, uncond=None, options: Optional[SamplingOptions] = None, **inputs):
        """A request of ``options`` (None: the declared defaults) and the inputs (sigmas=, noise_mask=, ...)."""
        values = {f.name: getattr(options, f.name) for f in dataclasses.fields(SamplingOptions)} if options else {}
        return cls(latent=latent, cond=cond, uncond=uncond, **values, **inputs)


DEFAULT_SAMPLER = default_of(SamplingOptions, "sampler")  # RunStats' before a run (every request carries its own)


def model_kind(source: str) -> str:
    """Which model a file or folder is, for its defaults: a bundle's name ("demo": its metadata or its DiT's shapes,
    engine/models/bundle.py), else its family's variant (``Family.variant_of``: the config keys only that variant's
    release has, else "turbo" / "base" in the file's or folder's name). Reads headers only; a file that cannot be
    read is judged by its name, as the first family's (its loading says what is wrong)."""
    return _kind(source)[0]


def _kind(source: str) -> tuple:
    """(``model_kind``, the file's family or its Bundle): its header read once."""
    path = os.path.normpath(os.fspath(named_file(source)))
    checkpoint = None
    try:
        checkpoint = Checkpoint(path) if os.path.exists(path) else None
    except (CheckpointError, OSError, ValueError):
        pass  # what was read counts
    bundle = bundle_of_file(path, checkpoint)
    if bundle is not None:
        return bundle.name, bundle
    config = checkpoint.config_overrides if checkpoint is not None else {}
    family = (checkpoint.family if checkpoint is not None else None) or families()[0]
    name = os.path.basename(path)
    if name.lower() == "transformer":  # a diffusers folder's transformer/: the model's folder names it
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return family.variant_of(config, name), family


def model_defaults(source: str) -> dict:
    """{"steps", "cfg"}: the defaults of the model in ``source`` (``model_kind``; a bundled file's own, the
    demo-turbo's 8 steps at cfg 1; a file of another family, its family's)."""
    kind, family = _kind(source)
    if isinstance(family, Bundle):
        own = family.file_defaults(os.fspath(named_file(source)))
        return {"steps": own["steps"], "cfg": own["cfg"]}
    variants = family.sampling_defaults or families()[0].sampling_defaults
    return dict(variants.get(kind) or next(iter(variants.values())))


def with_model_defaults(given: dict, source: str) -> dict:
    """``given`` (field -> value, None = unset) with steps and cfg filled in from the model's defaults."""
    out = dict(given)
    defaults = model_defaults(source)
    for name, value in defaults.items():
        if out.get(name) is None:
            out[name] = value
    return out



def from_flags(args, source: str, names) -> dict:
    """{option: value} for the sampling options ``names`` from argparse ``args``: the flags given, else the
    defaults of the model in ``source`` (steps, cfg), else the declared ones. Checked before anything loads:
    InputError / ValueError naming the flag."""
    decl = declared(SamplingOptions)
    values = {n: getattr(args, flag_dest(decl[n]), None) for n in names}
    values = with_model_defaults({n: default_of(SamplingOptions, n) if v is None else v for n, v in values.items()},
                                 source)
    flags = {n: opt.flag for n, opt in decl.items()}
    numbers = {n: values[n] for n in ("steps", "cfg", "shift", "denoise") if n in values}
    check_sampling_settings(**{"steps": 1, "cfg": 0.0, **numbers}, names=flags)
    if "seed" in values:
        check_seed(values["seed"], flags["seed"])
    return {**{n: values[n] for n in names}, **from_args(SamplingOptions, args, names)}
