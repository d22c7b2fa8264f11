"""ComfyUI's description of a family's model for the comfy_model output (nodes/comfy_model.py): its settings class
(ComfyUI's own where this ComfyUI has one, else the same flow settings on ``BASE``), a bundled model's own latent
format, and the text conds that let prompts of different lengths share one call."""
from __future__ import annotations

from typing import Dict

import comfy.conds
import comfy.latent_formats
import comfy.supported_models
import comfy.supported_models_base
import torch

from ..engine.sampling import DEFAULT_SHIFT, MULTIPLIER

_bundle_latents: Dict[str, type] = {}


def _bundle_latent(bundle) -> type:
    """A bundled model's own latent format (the demo's 48-channel pixel latent), one class per bundle: previews show
    its pixels."""
    if bundle.name in _bundle_latents:
        return _bundle_latents[bundle.name]

    class BundleLatent(comfy.latent_formats.LatentFormat):
        latent_channels = bundle.latent_channels

        def __init__(self):
            self.latent_rgb_factors = bundle.preview_rgb_factors()
            self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]

    return _bundle_latents.setdefault(bundle.name, BundleLatent)


def settings_class(family, bundle):
    """ComfyUI's model settings for ``family`` (its own class where this ComfyUI has one), a bundled model's latent."""
    native = getattr(comfy.supported_models, family.comfy_model, None) if family.comfy_model else None
    if native is not None and bundle is None:
        return native

    class FamilySettings(comfy.supported_models_base.BASE):
        """The family's flow settings, for a ComfyUI without its own model of the family (ERNIE-Image: before 0.19)."""
        unet_config = dict(family.comfy_unet_config)
        unet_extra_config = {}
        sampling_settings = {"multiplier": MULTIPLIER, "shift": DEFAULT_SHIFT}
        latent_format = _bundle_latent(bundle) if bundle else getattr(comfy.latent_formats, family.latent.comfy_format)
        memory_usage_factor = 10.0
        supported_inference_dtypes = [torch.bfloat16, torch.float16, torch.float32]

    return FamilySettings


class PaddedText(comfy.conds.CONDRegular):
    """Text features [B, T, C] that batch with other lengths by zero-padding; ``text_lens`` tells the DiT which
    tokens are real, so prompt and negative of different lengths share one call (plain CONDRegular, as ComfyUI
    0.19+'s native ERNIE-Image uses, runs them as separate calls; docs/comfyui_model.md)."""

    def can_concat(self, other):
        a, b = self.cond.shape, other.cond.shape
        return a[0] == b[0] and a[2:] == b[2:] and self.cond.device == other.cond.device

    def concat(self, others):
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds])


class TextLengths(comfy.conds.CONDRegular):
    """The text's real token counts [B], kept on the host: ComfyUI moves every tensor it passes to the diffusion
    model onto the GPU, and the DiT reads "is anything padded" from the lengths; read from the GPU, that is a
    device sync every model call. Batched, they reach ``EngineCall`` as a tuple of ints (not a tensor: ComfyUI
    leaves it where it is)."""

    def concat(self, others):
        return tuple(int(n) for n in torch.cat([self.cond] + [o.cond for o in others]).tolist())
