"""What a prompt-to-picture entry point needs of a model besides its DiT, as one protocol: encode a prompt, the
latent of a picture size (the one check of a size), decode a latent, the default size. ``sgld generate``,
``sgld serve`` and ``ErnieImagePipeline`` run on it; the demo model's parts and a family's files' (the text encoder
and VAE its description names: ``Family.companions``) are here. Latents are [batch, C, h, w] everywhere, pictures
[batch, H, W, 3]: no entry point adds or removes a batch axis of its own."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Sequence, Tuple

import numpy as np
import torch

from .errors import InputError
from .sampling import MAX_IMAGE_SIDE

PROMPT_CACHE_BYTES = 256 << 20  # recent prompts' features kept (a 512-token prompt of Ministral 3B: 6 MiB)


class ImageParts:
    """The protocol; ``default_size``: the picture's side in pixels when a caller gives none."""

    default_size: int
    pictures = True  # it encodes prompts and decodes pictures (False: a DiT served alone, for POST /v1/sample)

    def encode(self, prompt: str) -> torch.Tensor:
        """A prompt -> its text features [tokens, C] (float32, CPU)."""
        raise NotImplementedError

    def latent_shape(self, width: int, height: int, batch: int = 1) -> Tuple[int, ...]:
        """[batch, C, h, w] of a picture of width x height pixels: InputError for a size the model cannot make."""
        raise NotImplementedError

    def empty_latent(self, width: int, height: int, batch: int = 1) -> torch.Tensor:
        """Zeros [batch, C, h, w] (text-to-image's start), the size checked by ``latent_shape``."""
        return torch.zeros(self.latent_shape(width, height, batch))

    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [B, C, h, w] -> float pictures [B, H, W, 3] in 0..1."""
        raise NotImplementedError

    def decode(self, latent: torch.Tensor) -> np.ndarray:
        """Latent [B, C, h, w] -> uint8 pictures [B, H, W, 3]."""
        raise NotImplementedError

    def warnings(self, prompts: Sequence[str], negatives: Sequence[str],
                 names: Sequence[str] = ("prompt", "negative_prompt")) -> List[str]:
        """What the prompts ask that the model cannot draw (none by default); ``names``: the caller's spelling of
        the prompt and the negative."""
        return []


class BundledParts(ImageParts):
    """A bundled model's text encoder and picture codec (one file with its DiT: engine/models/bundle.py, the demo)."""

    def __init__(self, model):
        self.model = model
        self.default_size = model.image_size

    def encode(self, prompt: str) -> torch.Tensor:
        return self.model.encode([prompt])[0]

    def latent_shape(self, width: int, height: int, batch: int = 1) -> Tuple[int, ...]:
        return self.model.latent_shape(width, height, batch)

    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        return self.model.decode_float(latent)

    def decode(self, latent: torch.Tensor) -> np.ndarray:
        return self.model.decode(latent)

    def warnings(self, prompts: Sequence[str], negatives: Sequence[str],
                 names: Sequence[str] = ("prompt", "negative_prompt")) -> List[str]:
        """What the prompts ask that it cannot draw (the demo: the words it does not know, "top right")."""
        return self.model.warnings(prompts, negatives, names)


class NoParts(ImageParts):
    """A DiT served alone (``sgld serve --sample-only``): its clients send text features and latents and decode
    themselves (the SGLDiffusion Server nodes, in ComfyUI), so nothing is loaded besides the DiT."""

    pictures = False
    WHY = ("this server samples only (sgld serve --sample-only): it has no text encoder or VAE; send latents and "
           "text features to POST /v1/sample, or start it with a text encoder and a VAE for pictures")

    def __init__(self, default_size: int):
        self.default_size = default_size

    def encode(self, prompt: str) -> torch.Tensor:
        raise InputError(self.WHY)

    def latent_shape(self, width: int, height: int, batch: int = 1) -> Tuple[int, ...]:
        raise InputError(self.WHY)

    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        raise InputError(self.WHY)

    decode = decode_float


class FileParts(ImageParts):
    """A family's text encoder and VAE, loaded from their files (``Family.companions``: engine/models/external.py)."""

    def __init__(self, text_encoder, vae, family, prompt_cache_bytes: int = PROMPT_CACHE_BYTES):
        self.text_encoder, self.vae, self.family = text_encoder, vae, family
        self.default_size = family.companions.default_size
        self.prompt_cache_bytes = prompt_cache_bytes
        self._features: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._kept_bytes = 0
        self._lock, self._encoding = threading.Lock(), threading.Lock()

    def encode(self, prompt: str) -> torch.Tensor:
        """The features of a recent prompt come from memory (least recently used out past ``prompt_cache_bytes``):
        a server's repeated prompt does not wake the text encoder, nor move it onto the GPU. Read-only: callers
        copy them (``pad_text``)."""
        with self._lock:
            if prompt in self._features:
                self._features.move_to_end(prompt)
                return self._features[prompt]
        with self._encoding:  # one prompt at a time: a placement that moves the weights moves them once
            features = self.text_encoder.encode(prompt)
        size = features.numel() * features.element_size()
        with self._lock:
            if size <= self.prompt_cache_bytes and prompt not in self._features:
                self._features[prompt] = features
                self._kept_bytes += size
                while self._kept_bytes > self.prompt_cache_bytes:
                    gone = self._features.popitem(last=False)[1]
                    self._kept_bytes -= gone.numel() * gone.element_size()
        return features

    def forget_prompts(self) -> None:
        """The text encoder changed (dtype, device): the kept features are not its own any more."""
        with self._lock:
            self._features.clear()
            self._kept_bytes = 0

    def latent_shape(self, width: int, height: int, batch: int = 1) -> Tuple[int, ...]:
        if not (1 <= width <= MAX_IMAGE_SIDE and 1 <= height <= MAX_IMAGE_SIDE):
            raise InputError(f"each side must be from 1 to {MAX_IMAGE_SIDE} pixels")
        multiple = self.vae.stride * self.family.latent.cells_per_token  # the DiT's patches of the VAE's cells
        if width % multiple or height % multiple:
            raise InputError(f"image size {width}x{height} is not a positive multiple of {multiple}")
        return self.vae.latent_shape(width, height, batch)  # the VAE's own rule (a multiple of its stride)

    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        return self.vae.decode_float(latent)

    def decode(self, latent: torch.Tensor) -> np.ndarray:
        return self.vae.decode(latent).numpy()
