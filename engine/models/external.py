"""ERNIE-Image's own text encoder and VAE, for ``sgld generate --model --text-encoder --vae``.

Both come from their reference libraries, as optional extras (``pip install transformers
diffusers``): the text encoder is a Mistral3/Ministral3 model loaded by ``transformers``, the VAE is
diffusers' ``AutoencoderKLFlux2``. Each is a folder as in the HF release (``text_encoder/``, its
tokenizer files inside it or in the sibling ``tokenizer/``; ``vae/``), weights read from safetensors only.

Conventions (shared/reference/ernie_image.md §3): the prompt's features are the hidden states that
*enter* the last decoder layer (``hidden_states[-2]``, no final norm), one prompt at a time with
BOS first; the DiT's latent is the VAE latent patchified 2x2 (128 channels at 1/16 of the image)
and normalised by the VAE's BatchNorm running statistics with eps 1e-5.
"""
from __future__ import annotations

import glob
import os
from typing import Optional

import torch

from ..errors import InputError

BN_EPS = 1e-5  # the pipeline's trained value; vae/config.json says 1e-4


def _require(module: str, what: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise InputError(f"{what} needs the '{module}' package (pip install {module}): {e}") from None


def _safetensors_folder(path: str, what: str) -> str:
    """A folder holding safetensors weights; pickled weights are refused before any library sees them."""
    if not os.path.isdir(path):
        raise InputError(f"{what} '{path}' is not a folder (expected the HF release's folder with "
                         f"config.json and *.safetensors)")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        found = [os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))]
        extra = f"; found {', '.join(found)}: pickled weights are refused" if found else ""
        raise InputError(f"{what} '{path}' has no .safetensors weights{extra}")
    return path


def _tokenizer_folder(path: str) -> str:
    """The text encoder's folder if it holds tokenizer files, else the release's sibling ``tokenizer/``."""
    sibling = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer")
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")) and os.path.isdir(sibling):
        return sibling
    return path


class TextEncoder:
    """Prompt -> [tokens, hidden] features for the DiT."""

    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)

    @classmethod
    def from_folder(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    tokenizer: Optional[str] = None) -> "TextEncoder":
        """``tokenizer``: its folder when it is not inside ``path`` or the sibling ``tokenizer/``."""
        _safetensors_folder(path, "text encoder")
        transformers = _require("transformers", "the text encoder")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer or _tokenizer_folder(path))
            model = transformers.AutoModel.from_pretrained(path, dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"text encoder '{path}' could not be loaded by transformers: {e}") from None
        return cls(model.to(device).eval(), tokenizer, device)

    def token_ids(self, prompt: str) -> torch.Tensor:
        ids = self.tokenizer(prompt, add_special_tokens=True, truncation=True, max_length=2048)["input_ids"]
        bos = self.tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):  # some tokenizer builds do not add BOS
            ids = [bos] + ids
        return torch.tensor([ids], device=self.device)

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        out = self.model(input_ids=self.token_ids(prompt), output_hidden_states=True)
        return out.hidden_states[-2][0].float().cpu()


class Flux2VAE:
    """DiT latent [B, 128, H/16, W/16] <-> RGB images, through diffusers' AutoencoderKLFlux2."""

    def __init__(self, vae, device: str = "cpu"):
        self.vae, self.device = vae, torch.device(device)
        self.patch = tuple(vae.config.patch_size)
        self.stride = 2 ** (len(vae.config.block_out_channels) - 1) * self.patch[0]

    @classmethod
    def from_folder(cls, path: str, device: str = "cpu") -> "Flux2VAE":
        _safetensors_folder(path, "VAE")
        diffusers = _require("diffusers", "the VAE")
        try:
            vae = diffusers.AutoencoderKLFlux2.from_pretrained(path, torch_dtype=torch.float32, use_safetensors=True,
                                                          low_cpu_mem_usage=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"VAE '{path}' could not be loaded as a Flux2 VAE by diffusers: {e}") from None
        return cls(vae.to(device).eval(), device)

    @property
    def channels(self) -> int:
        return self.vae.config.latent_channels * self.patch[0] * self.patch[1]

    def empty_latent(self, width: int, height: int, batch: int = 1) -> torch.Tensor:
        if width % self.stride or height % self.stride or width <= 0 or height <= 0:
            raise InputError(f"image size {width}x{height} is not a positive multiple of {self.stride}")
        return torch.zeros(batch, self.channels, height // self.stride, width // self.stride)

    def _pixels(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> the VAE's output [B, 3, H, W] (about -1..1): de-normalised, un-patchified, decoded."""
        bn = self.vae.bn
        z = latent.to(self.device, torch.float32)
        z = z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + BN_EPS) + bn.running_mean.view(1, -1, 1, 1)
        b, c, h, w = z.shape
        py, px = self.patch
        z = z.view(b, c // (py * px), py, px, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // (py * px), h * py, w * px)
        return self.vae.decode(z).sample

    @torch.no_grad()
    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> float images [B, H, W, 3] in 0..1, as diffusers' image processor makes them (x / 2 + 0.5)."""
        return (self._pixels(latent) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> uint8 images [B, H, W, 3]."""
        img = self._pixels(latent)
        return ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
