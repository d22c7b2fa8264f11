"""Z-Image's text encoder and VAE, as its release and diffusers' ``ZImagePipeline`` run them.

The text encoder is Qwen3-4B through transformers (the release's ``text_encoder/``, or ComfyUI's single file
``qwen_3_4b.safetensors`` with its config.json and tokenizer beside it): the prompt is written as a chat turn
(``_encode_prompt``'s ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)``, the text
ComfyUI's ``ZImageTokenizer`` writes), no BOS, at most 512 tokens, and the features are the hidden states entering
the last layer (``hidden_states[-2]``) of the prompt's own tokens. The VAE is FLUX.1's 16-channel
``AutoencoderKL`` (``vae/``, or ComfyUI's ``ae.safetensors`` in BFL's names): the DiT's latent is the VAE's,
normalised by its config's ``scaling_factor`` and ``shift_factor``; the DiT's 2x2 patches make each side a multiple
of 16 pixels (the family's ``Latent.pixel_multiple``)."""
from __future__ import annotations

import torch

from ..external import DiffusersVAE, TextEncoder

CHAT_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


class QwenTextEncoder(TextEncoder):
    """Qwen3-4B writing Z-Image's prompt features."""

    template = CHAT_TURN
    bos_first = False
    max_tokens = 512  # diffusers' max_sequence_length


class FluxVAE(DiffusersVAE):
    """FLUX.1's VAE: the DiT latent [B, 16, H/8, W/8] is (VAE latent - shift_factor) x scaling_factor."""

    diffusers_class = "AutoencoderKL"

    def __init__(self, vae, device: str = "cpu"):
        super().__init__(vae, device)
        self.stride = 2 ** (len(vae.config.block_out_channels) - 1)
        self.channels = vae.config.latent_channels
        self.scale, self.shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0

    def _vae_latent(self, z: torch.Tensor) -> torch.Tensor:
        return z / self.scale + self.shift
