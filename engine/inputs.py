"""The checks every input of a run passes before any work: InputError naming what is wrong and what is
allowed (the limits are in engine/sampling.py). One place for the engine, the CLI, the nodes and the server."""
from __future__ import annotations

import math
import operator
from typing import List, Optional

import torch

from .errors import InputError
from .models import Family, families, family_of
from .models.bundle import bundles
from .sampling import (
    DEFAULT_SHIFT,
    MAX_BATCH,
    MAX_BATCH_INDEX,
    MAX_CFG,
    MAX_IMAGE_SIDE,
    MAX_INPUT_VALUE,
    MAX_SCHEDULE,
    MAX_SEED,
    MAX_SHIFT,
    MAX_STEPS,
    SAMPLERS,
    SCHEDULERS,
)


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


def check_values(name: str, t: torch.Tensor, what: str = "") -> None:
    """NaN, inf or values beyond MAX_INPUT_VALUE in an input tensor: the model would make NaN from them, which
    would read as damaged weights. ``what``: where such values come from (for the message)."""
    if t.numel() == 0:
        return
    peak = float(t.detach().abs().amax())  # NaN and inf propagate: one reduction checks all three
    if peak <= MAX_INPUT_VALUE:
        return
    if math.isfinite(peak):
        raise InputError(f"{name} holds values up to {peak:.3g}; inputs are at most {MAX_INPUT_VALUE:g} in magnitude "
                         f"(larger ones overflow the model){what}")
    raise InputError(f"{name} holds NaN or inf values{what}")


def check_seed(seed, name: str = "seed") -> int:
    """0 .. 2**64-1, the seeds ComfyUI gives and torch.Generator.manual_seed takes."""
    return _integer(name, seed, 0, MAX_SEED)


def check_run_sigmas(sigmas) -> torch.Tensor:
    """Any sampler's sigmas (float32, CPU; ComfyUI's samplers take increasing ones too): 1-D, at most
    MAX_SCHEDULE + 1, finite, non-negative, and 0 only last (the samplers divide by sigma: a 0 before the
    end makes inf / NaN)."""
    t = torch.as_tensor(sigmas).detach().to("cpu", torch.float32)
    if t.dim() != 1 or not 1 <= t.numel() <= MAX_SCHEDULE + 1:
        raise InputError(f"sigmas must be a 1-D list of 1 to {MAX_SCHEDULE + 1} values; got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise InputError(f"sigmas must be finite and non-negative (got {t.tolist()!r:.200})")
    zeros = (t[:-1] == 0).nonzero().flatten().tolist()
    if zeros:
        raise InputError(f"sigma {zeros[0] + 1} of {t.numel()} is 0: only the last sigma may be 0 (the samplers divide "
                         "by sigma; SetFirstSigma 0 or a schedule of zeros makes inf / NaN). Use a small sigma such as 1e-4")
    return t


def check_sigmas(sigmas, steps) -> torch.Tensor:
    """A caller's own sigma schedule (float32, CPU): ``check_run_sigmas``, non-increasing, ``steps`` + 1
    entries (at least 2)."""
    t = check_run_sigmas(sigmas)
    if t.numel() < 2:
        raise InputError(f"sigmas must be a 1-D list of 2 to {MAX_SCHEDULE + 1} values; got shape {tuple(t.shape)}")
    if bool((t[1:] > t[:-1]).any()):
        raise InputError("sigmas must be finite, non-negative and non-increasing")
    if steps != t.numel() - 1:
        raise InputError(f"steps is {steps} but the sigmas make {t.numel() - 1} steps; they must agree")
    return t


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


def latent_hint(channels: int) -> str:
    """Which latent a model of ``channels`` latent channels takes (and the ComfyUI node that makes it),
    for the wrong-latent error: a bundled model's (the demo's 48-channel pixel latent), or a registered family's own."""
    for bundle in bundles():
        if channels == bundle.latent_channels:  # one size only: a latent of another size is not a way to get one
            return f" ({bundle.latent_hint})"
    for family in families():
        latent = family.latent
        if channels == latent.channels:
            use = f"; use {latent.makers}" if latent.makers else ""
            return (f" ({family.title} uses {latent.name}: {channels} channels at 1/{latent.stride} of the image "
                    f"size{use})")
    return ""


def empty_latent_shape(family: Family, width, height, batch_size, names=None) -> tuple:
    """[batch, channels, height/stride, width/stride]: the empty latent ``family``'s DiT takes for a picture of
    width x height pixels (ERNIE-Image's: the Flux2 latent, as ComfyUI's EmptyFlux2LatentImage makes it).
    InputError unless each side is a multiple of the latent's stride up to MAX_IMAGE_SIDE: another size would
    be cut down to one without a word. ``names``: how the caller spells width and height (the CLI: ``--width``)."""
    stride, multiple = family.latent.stride, family.latent.pixel_multiple
    sides = {}
    for key, value in (("width", width), ("height", height)):
        name = (names or {}).get(key, key)
        v = _integer(name, value, multiple, MAX_IMAGE_SIDE)
        if v % multiple:
            per_token = f", and a token covers {multiple}x{multiple}" if multiple != stride else ""
            raise InputError(f"{name} must be a multiple of {multiple} pixels (got {v}; {family.title}'s latent has "
                             f"one cell per {stride}x{stride} pixels{per_token})")
        sides[key] = v // stride
    batch = _integer("batch_size", batch_size, 1, MAX_BATCH)
    return (batch, family.latent.channels, sides["height"], sides["width"])


def max_image_tokens(family: Family) -> int:
    """The image tokens a sample may have: the latent cells of a MAX_IMAGE_SIDE x MAX_IMAGE_SIDE picture in
    ``family``'s latent (a bound on the work; one token per cell at patch size 1)."""
    return (MAX_IMAGE_SIDE // family.latent.stride) ** 2


def check_sampler(sampler: str, scheduler: str) -> None:
    if sampler not in SAMPLERS:
        raise InputError(f"sampler '{sampler}' is not supported; choose one of {', '.join(SAMPLERS)}")
    if scheduler not in SCHEDULERS:
        raise InputError(f"scheduler '{scheduler}' is not supported; choose one of {', '.join(SCHEDULERS)}")


def check_conditioning(cfg, name: str, cond, batch: int, values: bool = True) -> List[torch.Tensor]:
    """Per-sample text features [T_i, C] for a batch of ``batch`` (one entry is used for all), checked against
    the model configuration ``cfg`` (``values``: their values too, one reduction each)."""
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
        if values:
            check_values(f"{name} conditioning #{i}", c, ": is the text encoder's output damaged?")
        feats.append(c)
    if len(feats) == 1 and batch > 1:
        feats = feats * batch
    if len(feats) != batch:
        raise InputError(f"{name} conditioning has {len(feats)} entries for a latent batch of {batch}")
    return feats


def check_latent(cfg, latent, name: str = "latent", values: bool = True) -> None:
    """A latent [B, C, H, W] the model of configuration ``cfg`` takes (``name``: what the message calls it;
    ``values``: its values too)."""
    if not isinstance(latent, torch.Tensor) or latent.dim() != 4:
        shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise InputError(f"{name} has shape {shape}; expected [batch, {cfg.in_channels}, height, width]")
    if latent.shape[1] != cfg.in_channels:
        raise InputError(f"{name} has {latent.shape[1]} channels but this model takes {cfg.in_channels}"
                         + latent_hint(cfg.in_channels))
    p = cfg.patch_size
    if latent.shape[2] < p or latent.shape[3] < p or latent.shape[2] % p or latent.shape[3] % p:
        raise InputError(f"{name} size {tuple(latent.shape[2:])} is not a multiple of the patch size {p}")
    tokens = (latent.shape[2] // p) * (latent.shape[3] // p)
    family = family_of(cfg)
    limit = max_image_tokens(family)
    if tokens > limit:
        raise InputError(f"{name} size {tuple(latent.shape[2:])} makes {tokens} image tokens per sample; the limit is "
                         f"{limit} ({MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels for {family.title})")
    if values:
        check_values(name, latent)


def check_model_call(cfg, x, text, branches=("conditioning",), values: bool = True) -> None:
    """One model call of a sampling loop outside the engine (ComfyUI's samplers on the MODEL output): the
    sampler's latent x [B, C, H, W] and the text features [B, T, C] of each CFG branch (``branches``: their
    names, in batch order), with the checks ``Engine.sample`` makes on its inputs. ``values`` False: shapes
    only (a value check is a reduction, and on a GPU a sync: once per run is enough)."""
    check_latent(cfg, x, "the sampler's latent", values)
    if not isinstance(text, torch.Tensor) or text.dim() != 3:
        shape = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
        raise InputError(f"the text features have shape {shape}; expected [batch, tokens, {cfg.text_in_dim}]")
    for name, part in zip(branches, text.chunk(len(branches))):
        check_conditioning(cfg, name, list(part), part.shape[0], values)


MASK_SHAPES = "[height, width], [batch, height, width] or [batch, 1, height, width] (any size: it is scaled to the latent's)"


def check_noise_mask(mask) -> Optional[torch.Tensor]:
    """A denoise mask as a LATENT's ``noise_mask`` holds it (SetLatentNoiseMask, VAEEncodeForInpaint): one
    channel, values from 0 (keep the input) to 1 (repaint). Returns it as float32 on the CPU (None: no mask)."""
    if mask is None:
        return None
    if (not isinstance(mask, torch.Tensor) or mask.is_complex() or mask.dim() not in (2, 3, 4) or mask.numel() == 0
            or (mask.dim() == 4 and mask.shape[1] != 1)):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(f"noise_mask has shape {shape}; expected {MASK_SHAPES}")
    mask = mask.detach().to("cpu", torch.float32)
    check_values("noise_mask", mask, "; it takes values from 0 (keep) to 1 (repaint)")
    lo, hi = float(mask.min()), float(mask.max())
    if lo < 0.0 or hi > 1.0:
        raise InputError(f"noise_mask values must be from 0 (keep) to 1 (repaint) (got {lo:g} to {hi:g})")
    return mask


def check_batch_index(batch_index, batch: int) -> Optional[List[int]]:
    """A LATENT's ``batch_index`` (LatentFromBatch): which sample of the seed's noise each of ``batch`` latents takes."""
    if batch_index is None:
        return None
    try:
        index = [None if isinstance(i, bool) else operator.index(i) for i in batch_index]
    except TypeError:
        index = None
    if index is None or len(index) != batch or not all(i is not None and 0 <= i <= MAX_BATCH_INDEX for i in index):
        raise InputError(f"batch_index must be a list of {batch} integers from 0 to {MAX_BATCH_INDEX}, one per latent "
                         f"(got {batch_index!r:.80})")
    return index
