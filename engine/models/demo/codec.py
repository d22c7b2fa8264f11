"""Lossless pixel codec of the demo model: 4x4 space-to-depth.

64x64x3 uint8 image <-> [48, 16, 16] latent with values (v - 127.5) / 127.5 in [-1, 1].
Channel order inside a token is (dy, dx, rgb), i.e. channel = (dy * 4 + dx) * 3 + c.
``decode(encode(x)) == x`` exactly for every uint8 image.
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

FACTOR = 4
LATENT_CHANNELS = 3 * FACTOR * FACTOR  # 48
SCALE = 127.5


def preview_rgb_factors() -> list:
    """[48][3] weights taking a latent pixel to RGB in [-1, 1] (each colour: the mean of its 16 sub-pixels), in
    the form ComfyUI's latent previews take (``LatentFormat.latent_rgb_factors``)."""
    return [[1.0 / (FACTOR * FACTOR) if ch % 3 == c else 0.0 for c in range(3)] for ch in range(LATENT_CHANNELS)]


def encode(images: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
    """images uint8 [B, H, W, 3] (or float in 0..1, or one image [H, W, 3]) -> latent float32 [B, 48, H/4, W/4]."""
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.dim() == 3:
        x = x[None]
    if x.dtype == torch.uint8:
        x = x.float()
    else:
        x = x.float() * 255.0
    b, h, w, c = x.shape
    if c != 3 or h % FACTOR or w % FACTOR:
        raise ValueError(f"images must be [B, H, W, 3] with H and W multiples of {FACTOR}; got {tuple(x.shape)}")
    x = (x - SCALE) / SCALE
    x = x.view(b, h // FACTOR, FACTOR, w // FACTOR, FACTOR, 3).permute(0, 2, 4, 5, 1, 3)
    return x.reshape(b, LATENT_CHANNELS, h // FACTOR, w // FACTOR).contiguous()


def decode_float(latent: torch.Tensor) -> torch.Tensor:
    """latent [B, 48, h, w] -> float image [B, 4h, 4w, 3] in 0..1 (clamped)."""
    z = latent.detach().float().cpu()
    if z.dim() == 3:
        z = z[None]
    b, ch, h, w = z.shape
    if ch != LATENT_CHANNELS:
        raise ValueError(f"demo latent must have {LATENT_CHANNELS} channels; got {ch}")
    x = z.view(b, FACTOR, FACTOR, 3, h, w).permute(0, 4, 1, 5, 2, 3).reshape(b, h * FACTOR, w * FACTOR, 3)
    return ((x * SCALE + SCALE) / 255.0).clamp(0.0, 1.0)


def decode(latent: torch.Tensor) -> np.ndarray:
    """latent [B, 48, h, w] -> uint8 images [B, 4h, 4w, 3] (rounded to the nearest level)."""
    return (decode_float(latent) * 255.0).round().to(torch.uint8).numpy()
