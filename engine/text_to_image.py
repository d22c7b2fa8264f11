"""Prompt -> picture, written once: ``sgld generate``, each ``sgld serve`` job, ``ErnieImagePipeline`` and a bundled
model's ``generate`` (through ``Engine.pictures``) describe what they want as a ``Picture`` and turn it into the
engine's ``SampleRequest`` here (the size checked once, by the model's own rule; each distinct prompt encoded once;
the negatives only when the guidance reads them), then sample it with ``generate`` (the server hands the request to
its batcher instead). What differs between them stays theirs: the pipeline's diffusers schedule and generator noise
(``sigmas``, ``noise``), the server's one job per image."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from .image_parts import ImageParts
from .sampling import cfg_on
from .sampling_options import SampleRequest, SamplingOptions


@dataclass
class Picture:
    """Pictures from prompts: ``per_prompt`` of each of ``prompts`` (one batch: image j of prompt i is row
    i * per_prompt + j), ``negatives`` one per prompt (None: no negative branch, whatever the cfg), ``width`` x
    ``height`` pixels, the sampling ``options`` (steps
    and cfg set by now); ``sigmas`` / ``noise``: the caller's own schedule and starting noise; ``cache``: a CacheConfig
    for this run (None: the engine's); ``loras``: per-request LoRAs by name (the server's); ``latent_shape``: the
    batch's latent shape when the caller checked the size itself, before a prompt enhancer's seconds (the size is
    checked once)."""

    prompts: List[str]
    negatives: Optional[List[str]]
    width: int
    height: int
    options: SamplingOptions
    per_prompt: int = 1
    sigmas: Optional[torch.Tensor] = None
    noise: Optional[torch.Tensor] = None
    cache: Any = None
    loras: Any = None
    latent_shape: Optional[Tuple[int, ...]] = None  # the batch's, when the caller checked the size already


def sample_request(parts: ImageParts, picture: Picture, encode: Optional[Callable[[str], torch.Tensor]] = None
                   ) -> SampleRequest:
    """The engine's request for ``picture``: InputError for a size the model cannot make (before any prompt is
    encoded); ``encode``: the caller's way to a prompt's features (default ``parts.encode``)."""
    if picture.negatives is not None and len(picture.negatives) != len(picture.prompts):
        raise ValueError(f"{len(picture.negatives)} negative prompts for {len(picture.prompts)} prompts: one each")
    shape = picture.latent_shape or parts.latent_shape(picture.width, picture.height,
                                                       len(picture.prompts) * picture.per_prompt)
    encode = encode or parts.encode
    features = {}

    def feature(text: str) -> torch.Tensor:
        if text not in features:
            features[text] = encode(text)
        return features[text]

    cond = [feature(p) for p in picture.prompts for _ in range(picture.per_prompt)]
    uncond = None
    if cfg_on(picture.options.cfg, picture.negatives):  # cfg 1 runs the prompt alone: its negative is never read
        uncond = [feature(n) for n in picture.negatives for _ in range(picture.per_prompt)]
    return SampleRequest.from_options(torch.zeros(shape), cond, uncond, picture.options, sigmas=picture.sigmas,
                                      noise=picture.noise, cache=picture.cache, loras=picture.loras)


def generate(engine, parts: ImageParts, picture: Picture, callback=None) -> torch.Tensor:
    """The latent [B, C, h, w] of ``picture``, sampled by ``engine`` (``callback(i, n, x, denoised)`` per model call)."""
    return engine.sample_request(sample_request(parts, picture), callback=callback)
