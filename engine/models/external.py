"""ERNIE-Image's own text encoder and VAE, for ``sgld generate --model --text-encoder --vae``.

Both come from their reference libraries, as optional extras (``pip install transformers
diffusers``): the text encoder is a Mistral3/Ministral3 model loaded by ``transformers``, the VAE is
diffusers' ``AutoencoderKLFlux2``. Each is a folder as in the HF release (``text_encoder/``, its
tokenizer files inside it or in the sibling ``tokenizer/``; ``vae/``) or a single file as ComfyUI keeps them
(``text_encoders/ministral-3-3b.safetensors``: ``model.layers.N.*`` keys, the text tower only;
``vae/flux2-vae.safetensors``: the original LDM/BFL layout), weights read from safetensors only. A single file's
config: ``config=`` (a folder holding config.json) or config.json beside the file; the VAE falls back on
AutoencoderKLFlux2's defaults (the Flux.2 VAE's own sizes), the text encoder has no such default.

Sizes are checked before anything is allocated (engine/io/shapes.py): the config's layer counts against the
weights' tensor count, then the model built on the meta device from the config against the safetensors header, and
only then the model built for real and loaded; a config saying ``block_out_channels [40000, 40000]`` beside a
small file is a CheckpointError naming the file, key and config field, not a 57.6 GB allocation.

Conventions (shared/reference/ernie_image.md §3): the prompt's features are the hidden states that
*enter* the last decoder layer (``hidden_states[-2]``, no final norm), one prompt at a time with
BOS first; the DiT's latent is the VAE latent patchified 2x2 (128 channels at 1/16 of the image)
and normalised by the VAE's BatchNorm running statistics with eps 1e-5.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import torch

from .. import device as device_rt
from ..compute_dtype import native
from ..errors import CheckpointError, InputError
from ..io.checkpoint import read_json_file
from ..io.readers import SAFETENSORS
from ..io.safetensors import refuse_pickle
from ..io.shapes import check_counts, check_sizes, on_meta, read_header
from ..sampling import MAX_TEXT_TOKENS

log = logging.getLogger("sgld.parts")
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


def _header(path: str):
    """(key -> meta tensor, key -> file) of a weight file or a folder's ``*.safetensors``: the header only
    (safetensors only: else a CheckpointError naming the file)."""
    names = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return read_header(SAFETENSORS.open(name) for name in names)


def _load(module: torch.nn.Module, sd: dict) -> None:
    """``sd`` (checked by ``check_sizes``) into the materialised ``module``."""
    want = module.state_dict()
    module.load_state_dict({**{k: v for k, v in want.items() if k.endswith("num_batches_tracked")}, **sd}, strict=True)


# ComfyUI's text encoder file holds the text tower (``model.*``) and the Tekken vocabulary as a tensor; an HF
# Mistral3Model file names the tower ``language_model.model.*`` beside a vision tower the features do not use.
_TE_PREFIXES = ("text_encoders.ministral3_3b.transformer.", "model.", "language_model.")
_TE_UNUSED = ("tekken_model", "lm_head.", "vision_tower.", "multi_modal_projector.")


def _te_name(key: str) -> str:
    """A text encoder key without the prefixes of the known layouts (transformers' Mistral3Model saves its text
    tower as ``language_model.model.*`` and names it ``language_model.*``)."""
    prefix = True
    while prefix:
        prefix = next((p for p in _TE_PREFIXES if key.startswith(p)), "")
        key = key[len(prefix):]
    return key


def _text_tower_keys(sd: dict) -> dict:
    return {name: v for name, v in ((_te_name(k), v) for k, v in sd.items()) if not name.startswith(_TE_UNUSED)}


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


def move_weights(model: torch.nn.Module, device: torch.device) -> None:
    """``model``'s weights and buffers to ``device`` in place, tensor by tensor (as ``.to`` without swapping the
    parameter objects: the memory rehearsal's fake tensors cannot be swapped)."""
    for p in model.parameters():
        p.data = p.data.to(device)
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def room_on(device: torch.device, weights: int, work: int) -> bool:
    """Does ``device`` have room now for ``weights`` brought from the host and their ``work`` beside what it holds
    (the DiT, a served batch's activations)? A device that cannot say (the CPU) has."""
    free = device_rt.free_bytes(device)
    return free is None or free >= weights + work


class RoomCheck:
    """Where a model kept on the host (a text encoder, the prompt enhancer) computes its next call: on ``device`` when
    its weights and ``work`` bytes fit the memory free there now (beside the DiT, a served batch), else on the host,
    said once in the log: a full GPU makes it slower, never out of memory."""

    def __init__(self, what: str, work: int, doing: str, flag: str):
        self.what, self.work, self.doing, self.flag = what, work, doing, flag
        self.weights: Optional[int] = None  # counted at the first call (the weights keep their size)
        self.said = False

    def where(self, model: torch.nn.Module, device: torch.device, host: torch.device) -> torch.device:
        if self.weights is None:
            self.weights = weights_bytes(model)
        if room_on(device, self.weights, self.work):
            return device
        if not self.said:
            self.said = True
            log.warning("%s: %.1f GiB of weights and work do not fit the %.1f GiB free on %s beside the DiT: %s on the "
                        "CPU (slower; %s says so up front)", self.what, (self.weights + self.work) / 2**30,
                        device_rt.free_bytes(device) / 2**30, device, self.doing, self.flag)
        return host


PLACEMENTS = ("auto", "cpu", "resident")  # --text-encoder-device (TextEncoder.load's ``placement``)
ENCODE_WORK_BYTES = 512 << 20  # above the weights while a prompt is encoded (traced: 0.08 GiB at 256 tokens, 3B)


def text_encoder_dtype(device) -> torch.dtype:
    """Ministral 3 was trained in bf16: bf16 where ``device`` computes it natively (a GPU from compute capability 8,
    a CPU with AVX-512 BF16 / AMX), else float32 (engine/compute_dtype.py's rule; fp16 overflows its activations)."""
    return torch.bfloat16 if native(torch.bfloat16, torch.device(device))[0] else torch.float32


class TextEncoder:
    """Prompt -> [tokens, hidden] features for the DiT. The weights live on ``home`` and compute on ``device``: with
    ``home`` the CPU and ``device`` a GPU, each prompt moves them onto the GPU and back, so the GPU holds the DiT
    alone while it samples (3B in bf16: 6.4 GiB not held beside it). A family's encoder is this class with its own
    way of writing the prompt (``template``, ``bos_first``, ``max_tokens``): ERNIE-Image's, the prompt as it is."""

    template = "{}"  # the text the tokenizer reads, the prompt in its place
    bos_first = True  # a BOS token first, when the tokenizer has one and did not add it
    max_tokens = MAX_TEXT_TOKENS  # the tokens read (the rest cut off)

    def __init__(self, model, tokenizer, device: str = "cpu", home: Optional[str] = None, placement: str = "resident"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.home = torch.device(home) if home is not None else self.device
        self.placement = placement
        self.room = RoomCheck("text encoder", ENCODE_WORK_BYTES, "encoding", "--text-encoder-device cpu")

    def to(self, device) -> "TextEncoder":
        """Compute on ``device`` from now on, as the placement says (``cpu`` stays; ``resident`` moves the weights)."""
        if self.placement != "cpu":
            self.device = torch.device(device)
            if self.placement == "resident":
                self.home = self.device
                self.model.to(self.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @classmethod
    def load(cls, path: str, dtype: Optional[torch.dtype] = None, device: str = "cpu",
             tokenizer: Optional[str] = None, config: Optional[str] = None, placement: str = "auto") -> "TextEncoder":
        """``path``: the release's folder or a single file (see the module's docstring; ``config``: its config
        folder). ``tokenizer``: its folder when it is not in the (config) folder or the sibling ``tokenizer/``.
        ``dtype`` None: ``text_encoder_dtype`` of where it computes. ``placement`` (PLACEMENTS): ``auto`` computes
        on ``device`` and keeps the weights on the host between prompts; ``cpu`` computes on the CPU; ``resident``
        keeps them on ``device``."""
        if placement not in PLACEMENTS:
            raise InputError(f"text encoder placement {placement!r} is not one of {', '.join(PLACEMENTS)} "
                             "(--text-encoder-device)")
        device = "cpu" if placement == "cpu" else device
        home = "cpu" if placement == "auto" else device
        dtype = dtype or text_encoder_dtype(device)
        transformers = _require("transformers", "the text encoder")
        single = os.path.isfile(path)
        folder = _config_folder(path, config) if single else _safetensors_folder(path, "text encoder", config)
        if folder is None:
            raise CheckpointError(f"text encoder '{path}': a single file needs its config: give text_encoder_config= "
                                  "(sgld: put them beside the file), e.g. the release's text_encoder/ folder: "
                                  "config.json, with the tokenizer files inside it or in a sibling tokenizer/ (the "
                                  "Tekken vocabulary inside ComfyUI's file is not read)")
        config_path = os.path.join(folder, "config.json")
        header, origin = _header(path)  # first the sizes: the header, the config's counts, a meta build
        check_counts(read_json_file(config_path), len(header), config_path)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer or _tokenizer_folder(folder))
            full = transformers.AutoConfig.from_pretrained(folder)
            cfg = getattr(full, "text_config", full) if single else full  # a single file: the text tower alone
            meta = on_meta(lambda: transformers.AutoModel.from_config(cfg, dtype=dtype))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"text encoder '{path}' could not be loaded by transformers: {e}") from None
        have = _text_tower_keys(header) if single else {_te_name(k): v for k, v in header.items()}
        check_sizes(meta, have, f"text encoder '{path}'", "text encoder file", full.to_dict(), config_path,
                    strict=single, rename=_te_name, origin={_te_name(k): f for k, f in origin.items()}, weights=path)
        del meta
        try:
            if not single:
                model = transformers.AutoModel.from_pretrained(path, dtype=dtype, use_safetensors=True)
            else:  # not randomly initialised: every weight is the file's (the features never enter the vision tower)
                from transformers.initialization import no_init_weights

                with no_init_weights():
                    model = transformers.AutoModel.from_config(cfg, dtype=dtype)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"text encoder '{path}' could not be loaded by transformers: {e}") from None
        if single:
            _load(model, _text_tower_keys(_read_single_file(path)))
        return cls(model.to(home).eval(), tokenizer, device, home, placement)

    def token_ids(self, prompt: str) -> torch.Tensor:
        ids = self.tokenizer(self.template.format(prompt), add_special_tokens=True, truncation=True,
                             max_length=self.max_tokens)["input_ids"]
        bos = self.tokenizer.bos_token_id if self.bos_first else None
        if bos is not None and (not ids or ids[0] != bos):  # some tokenizer builds do not add BOS
            ids = [bos] + ids
        return torch.tensor([ids])

    def computes_on(self) -> torch.device:
        """Where the next prompt is encoded. ``auto``: on the device when the weights and their work fit its free
        memory now (beside the DiT), else where the weights are (the host: slower, and said once)."""
        if self.placement != "auto" or self.home == self.device:
            return self.device
        return self.room.where(self.model, self.device, self.home)

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        where = self.computes_on()
        away = where != self.home
        if away:
            move_weights(self.model, where)
        try:
            out = self.model(input_ids=self.token_ids(prompt).to(where), output_hidden_states=True)
            return out.hidden_states[-2][0].float().cpu()
        finally:
            if away:
                move_weights(self.model, self.home)


class DiffusersVAE:
    """A family's VAE through diffusers (``diffusers_class``): DiT latents <-> RGB images. A subclass says how the
    DiT's latent maps onto the VAE's (``_vae_latent``), its ``channels`` and pixels per latent cell (``stride``)."""

    diffusers_class = ""  # the diffusers class the weights and config are for
    channels: int
    stride: int

    def __init__(self, vae, device: str = "cpu"):
        self.vae, self.device = vae, torch.device(device)

    @classmethod
    def load(cls, path: str, device: str = "cpu", config: Optional[str] = None) -> "DiffusersVAE":
        """``path``: the release's vae/ folder or a single file (see the module's docstring)."""
        diffusers = _require("diffusers", "the VAE")
        model_class = getattr(diffusers, cls.diffusers_class)
        what = f"VAE '{path}' could not be loaded as a {cls.diffusers_class} by diffusers"
        single = os.path.isfile(path)
        folder = _config_folder(path, config) if single else _safetensors_folder(path, "VAE", config)
        config_path = os.path.join(folder, "config.json") if folder else ""
        if config_path and not os.path.isfile(config_path):
            raise InputError(f"VAE '{path}': no config.json in the folder (the release's vae/ folder has one)")
        cfg = read_json_file(config_path) if folder else {}  # none: the class's defaults (the release's sizes)
        header, origin = _header(path)  # first the sizes: the header, the config's counts, a meta build
        check_counts(cfg, len(header), config_path or path)
        try:
            meta = on_meta(lambda: model_class.from_config(cfg))
            have = _vae_keys(header, meta.config) if single else header
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{what}: {e}") from None
        check_sizes(meta, have, f"VAE '{path}'", "VAE file", cfg, config_path, strict=single, origin=origin,
                    weights=path)
        del meta
        try:
            vae = model_class.from_config(cfg) if single else model_class.from_pretrained(
                path, torch_dtype=torch.float32, use_safetensors=True, low_cpu_mem_usage=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{what}: {e}") from None
        if single:
            _load(vae, _vae_keys(_read_single_file(path), vae.config))
        # diffusers' tiled decode above the VAE's trained size (config sample_size, 1024 px): a 2048² picture decodes
        # in overlapping 1024² tiles, blended, with a quarter of the working memory (its error: bench/RESULTS.md)
        vae.enable_tiling()
        return cls(vae.float().to(device).eval(), device)

    def latent_shape(self, width: int, height: int, batch: int = 1) -> tuple:
        """[batch, channels, height / stride, width / stride]; InputError unless each side is a positive multiple
        of the stride."""
        if width % self.stride or height % self.stride or width <= 0 or height <= 0:
            raise InputError(f"image size {width}x{height} is not a positive multiple of {self.stride}")
        return (batch, self.channels, height // self.stride, width // self.stride)

    def empty_latent(self, width: int, height: int, batch: int = 1) -> torch.Tensor:
        return torch.zeros(self.latent_shape(width, height, batch))

    def _vae_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """The DiT's latent [B, C, h, w] as the VAE's decoder takes it."""
        raise NotImplementedError

    def _pixels(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> the VAE's output [B, 3, H, W] (about -1..1)."""
        return self.vae.decode(self._vae_latent(latent.to(self.device, torch.float32))).sample

    @torch.no_grad()
    def decode_float(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> float images [B, H, W, 3] in 0..1, as diffusers' image processor makes them (x / 2 + 0.5)."""
        return (self._pixels(latent) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """DiT latent -> uint8 images [B, H, W, 3]."""
        img = self._pixels(latent)
        return ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


class Flux2VAE(DiffusersVAE):
    """ERNIE-Image's: the DiT latent [B, 128, H/16, W/16] is the Flux2 VAE's latent patchified 2x2 and normalised by
    its BatchNorm's running statistics."""

    diffusers_class = "AutoencoderKLFlux2"

    def __init__(self, vae, device: str = "cpu"):
        super().__init__(vae, device)
        self.patch = tuple(vae.config.patch_size)
        self.stride = 2 ** (len(vae.config.block_out_channels) - 1) * self.patch[0]
        self.channels = vae.config.latent_channels * self.patch[0] * self.patch[1]

    def _vae_latent(self, z: torch.Tensor) -> torch.Tensor:
        bn = self.vae.bn
        z = z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + BN_EPS) + bn.running_mean.view(1, -1, 1, 1)
        b, c, h, w = z.shape
        py, px = self.patch
        return z.view(b, c // (py * px), py, px, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // (py * px), h * py,
                                                                                         w * px)
