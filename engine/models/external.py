"""ERNIE-Image's own text encoder and VAE, for ``sgld generate --model --text-encoder --vae``.

Both come from their reference libraries, as optional extras (``pip install transformers
diffusers``): the text encoder is a Mistral3/Ministral3 model loaded by ``transformers``, the VAE is
diffusers' ``AutoencoderKLFlux2``. Each is a folder as in the HF release (``text_encoder/``, its
tokenizer files inside it or in the sibling ``tokenizer/``; ``vae/``) or a single file as ComfyUI keeps them
(``text_encoders/ministral-3-3b.safetensors``: ``model.layers.N.*`` keys, the text tower only;
``vae/flux2-vae.safetensors``: the original LDM/BFL layout), weights read from safetensors only. A single file's
config: ``config=`` (a folder holding config.json) or config.json beside the file; the VAE falls back on
AutoencoderKLFlux2's defaults (the Flux.2 VAE's own sizes), the text encoder has no such default.

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

from ..errors import CheckpointError, InputError
from ..io.checkpoint import read_json_file
from ..io.readers import SAFETENSORS
from ..io.safetensors import refuse_pickle

BN_EPS = 1e-5  # the pipeline's trained value; vae/config.json says 1e-4


def _require(module: str, what: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise InputError(f"{what} needs the '{module}' package (pip install {module}): {e}") from None


def _safetensors_folder(path: str, what: str, config: Optional[str] = None) -> str:
    """A folder holding safetensors weights; pickled weights are refused before any library sees them. A
    ``config`` is for single files only: a folder has its own config.json, so one given here is refused."""
    if config is not None and os.path.isdir(path):
        raise InputError(f"{what} '{path}' is a folder with its own config.json: a separate config ('{config}') is "
                         "only for a single file")
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


def _config_folder(path: str, config: Optional[str]) -> Optional[str]:
    """A single file's config folder: ``config`` (a folder with config.json, or that file) or the file's own folder."""
    if config is not None:
        folder = os.path.dirname(os.path.abspath(config)) if os.path.isfile(config) else config
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise InputError(f"config '{config}' for '{path}': no config.json there")
        return folder
    own = os.path.dirname(os.path.abspath(path))
    return own if os.path.isfile(os.path.join(own, "config.json")) else None


def _read_single_file(path: str) -> dict:
    refuse_pickle(path)
    f = SAFETENSORS.open(path)  # safetensors only: raises CheckpointError naming the file otherwise
    return dict(f.tensors(list(f.keys())))


def _load_checked(module: torch.nn.Module, sd: dict, path: str, what: str) -> None:
    """Load ``sd`` into ``module`` after checking every key and shape, so a wrong file is named, not a torch trace."""
    want = module.state_dict()
    sd = {**{k: v for k, v in want.items() if k.endswith("num_batches_tracked")}, **sd}  # a counter, not a weight
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    bad = next((k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)), None)
    if missing or extra or bad:
        key = bad or (missing or extra)[0]
        why = (f"shape {tuple(sd[key].shape)} where the config gives {tuple(want[key].shape)}" if bad else
               "missing" if missing else "not part of the model")
        raise CheckpointError(f"{what} '{path}': not a {what} file of this layout/config: key '{key}' is {why} "
                              f"({len(missing)} missing, {len(extra)} unknown of {len(want)} keys)")
    module.load_state_dict(sd, strict=True)


# ComfyUI's text encoder file holds the text tower (``model.*``) and the Tekken vocabulary as a tensor; an HF
# Mistral3Model file names the tower ``language_model.model.*`` beside a vision tower the features do not use.
_TE_PREFIXES = ("text_encoders.ministral3_3b.transformer.", "model.", "language_model.")
_TE_UNUSED = ("tekken_model", "lm_head.", "vision_tower.", "multi_modal_projector.")


def _text_tower_keys(sd: dict) -> dict:
    out = {}
    for key, value in sd.items():
        prefix = True
        while prefix:
            prefix = next((p for p in _TE_PREFIXES if key.startswith(p)), "")
            key = key[len(prefix):]
        if not key.startswith(_TE_UNUSED):
            out[key] = value
    return out


def _vae_keys(sd: dict, config) -> dict:
    """ComfyUI's / BFL's Flux.2 VAE file (LDM names: encoder.down.N.block.M, mid.attn_1 as 1x1 convs, the quant
    convs inside encoder/decoder in BFL's file) -> diffusers' names, through diffusers' own LDM VAE converter; the
    latent BatchNorm's statistics keep their names. A file already in diffusers' names is returned as is."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    for prefix in ("first_stage_model.", "vae."):
        if any(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not any(k.startswith("encoder.down.") for k in sd):
        return sd
    renamed = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
    sd = {next((new + k[len(old):] for old, new in renamed.items() if k.startswith(old)), k): v for k, v in sd.items()}
    out = convert_ldm_vae_checkpoint(sd, dict(config))
    out.update({k: v for k, v in sd.items() if k.startswith("bn.")})
    return out


class TextEncoder:
    """Prompt -> [tokens, hidden] features for the DiT."""

    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)

    @classmethod
    def load(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
             tokenizer: Optional[str] = None, config: Optional[str] = None) -> "TextEncoder":
        """``path``: the release's folder or a single file (see the module's docstring; ``config``: its config
        folder). ``tokenizer``: its folder when it is not in the (config) folder or the sibling ``tokenizer/``."""
        transformers = _require("transformers", "the text encoder")
        single = os.path.isfile(path)
        folder = _config_folder(path, config) if single else _safetensors_folder(path, "text encoder", config)
        if folder is None:
            raise CheckpointError(f"text encoder '{path}': a single file needs its config: give text_encoder_config= "
                                  "(sgld: put them beside the file), e.g. the release's text_encoder/ folder: "
                                  "config.json, with the tokenizer files inside it or in a sibling tokenizer/ (the "
                                  "Tekken vocabulary inside ComfyUI's file is not read)")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer or _tokenizer_folder(folder))
            if not single:
                model = transformers.AutoModel.from_pretrained(path, dtype=dtype, use_safetensors=True)
            else:  # the text tower alone (the features never enter the vision tower), not randomly initialised:
                from transformers.initialization import no_init_weights  # every weight is the file's

                cfg = transformers.AutoConfig.from_pretrained(folder)
                with no_init_weights():
                    model = transformers.AutoModel.from_config(getattr(cfg, "text_config", cfg), dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"text encoder '{path}' could not be loaded by transformers: {e}") from None
        if single:
            _load_checked(model, _text_tower_keys(_read_single_file(path)), path, "text encoder")
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
    def load(cls, path: str, device: str = "cpu", config: Optional[str] = None) -> "Flux2VAE":
        """``path``: the release's vae/ folder or a single file (see the module's docstring)."""
        diffusers = _require("diffusers", "the VAE")
        single = os.path.isfile(path)
        folder = _config_folder(path, config) if single else _safetensors_folder(path, "VAE", config)
        try:
            if not single:
                vae = diffusers.AutoencoderKLFlux2.from_pretrained(path, torch_dtype=torch.float32,
                                                                   use_safetensors=True, low_cpu_mem_usage=False)
            else:
                cfg = read_json_file(os.path.join(folder, "config.json")) if folder else {}
                vae = diffusers.AutoencoderKLFlux2.from_config(cfg)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"VAE '{path}' could not be loaded as a Flux2 VAE by diffusers: {e}") from None
        if single:
            _load_checked(vae, _vae_keys(_read_single_file(path), vae.config), path, "VAE")
        return cls(vae.float().to(device).eval(), device)

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
