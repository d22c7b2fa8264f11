"""A DiT family's description: everything the generic layers (loading, weight formats, LoRA, offload, Cache-DiT,
parallel, serving, the nodes) need to know about an architecture, declared once next to its model and read
through ``family_of(model)`` / ``detect(keys)``. The generic layers never name a family's modules, keys or
constants themselves (tests/test_imports.py enforces it); docs/architecture.md draws the seam.

A family's model follows one contract (ERNIE-Image's is the reference, engine/models/ernie_image.py):

* ``model_class(config)`` builds it; ``config_class.from_shapes(shapes, overrides, source)`` reads the
  configuration from a state dict's shapes (raising ValueError naming the tensor or field) and the config
  has the fields of ``CONFIG_FIELDS``, ``head_dim`` and ``to_dict()``;
* the forward is ``embed(x, timestep, text_bth, text_lens) -> (h, ctx)``, ``model.block_runner(model, h,
  ctx)`` (replaceable from outside: cache, offload, parallel) and ``unembed(h, ctx)``; each block is called
  by its list's pattern (``block_patterns``: ``block(h, ctx) -> h``, or two streams ``block(text, image, ctx) ->
  (text, image)``) and its attention calls ``ctx.attention(q, k, v, ctx.key_mask)`` ([B, S, H, D]);
  ``model.attention`` is the callable embed puts in the context, ``model.dtype`` the compute dtype;
* ``ctx`` (``context_class``) has the fields the generic layers read: ``key_mask``, ``attention``,
  ``valid_tokens`` (and, optionally, ``key_mask_host``: the key mask on the host, from which sequence
  parallel's Ring reads its blocks' lengths without a device sync); ``join_contexts`` makes one context for several jobs' rows (served batching) and
  ``chunk_context`` the context of one rank's chunk of the sequence (sequence parallel).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .block_loop import PATTERNS, TWO_STREAMS, LoopBlocks, TwoStreamBlocks, block_loop

# The configuration fields every family's config carries (the generic layers read only these).
CONFIG_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "in_channels",
                 "out_channels", "text_in_dim", "patch_size")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The default attention of every family, [B, S, H, D] in and out; ``key_mask`` [B, S_k], True = attend.
    The backends of engine/features/attention/ take the same arguments."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


_LAYER_INDEX = re.compile(r"0|[1-9][0-9]*")


def check_block_list(shapes: Mapping[str, Sequence[int]], name: str, max_layers: int, usual: str) -> int:
    """The number of blocks in list ``name``, after checking that ``name.N`` runs 0..N-1 without gaps (at most
    ``max_layers``: a header cannot ask for more work than that) and that every block has the same weights and
    biases as block 0, in the same shapes (other tensors, such as quantization scales, are checked by the
    loader). ``usual`` says what the family's release has, for the message. Raises ValueError naming the tensor."""
    prefix = name + "."
    per_layer: dict = {}
    for key, shape in shapes.items():
        if not key.startswith(prefix):
            continue
        index, _, rest = key[len(prefix):].partition(".")
        if not _LAYER_INDEX.fullmatch(index) or not rest:
            raise ValueError(f"tensor '{key}': '{prefix}' must be followed by a layer number and a tensor name")
        if len(index) > len(str(max_layers)) or int(index) >= max_layers:
            raise ValueError(f"tensor '{key}': layer number {index[:12]} is above the limit of {max_layers - 1} "
                             f"(at most {max_layers} layers are supported; {usual})")
        if rest.rpartition(".")[2] in ("weight", "bias"):
            per_layer.setdefault(int(index), {})[rest] = tuple(shape)
        else:
            per_layer.setdefault(int(index), {})
    count = len(per_layer)
    missing = next((i for i in range(count) if i not in per_layer), None)
    if missing is not None:
        stray = min(i for i in per_layer if i >= count)
        example = next(k for k in shapes if k.startswith(f"{prefix}{stray}."))
        raise ValueError(f"layer numbers must run from 0 without gaps: layer {missing} is missing but tensor "
                         f"'{example}' exists")
    first = per_layer.get(0, {})
    for i in range(1, count):
        layer = per_layer[i]
        if layer == first:
            continue
        absent = sorted(set(first) - set(layer))
        extra = sorted(set(layer) - set(first))
        if absent:
            raise ValueError(f"layer {i} is incomplete: tensor '{prefix}{i}.{absent[0]}' is missing (layer 0 has it)")
        if extra:
            raise ValueError(f"tensor '{prefix}{i}.{extra[0]}' has no counterpart in layer 0; every layer must hold the same tensors")
        key = next(n for n in first if first[n] != layer[n])
        raise ValueError(f"tensor '{prefix}{i}.{key}' has shape {layer[key]}, but '{prefix}0.{key}' has {first[key]}; "
                         "every layer must have the same shapes")
    return count


@dataclass(frozen=True)
class Latent:
    """The latent a family's DiT denoises: ``channels`` per cell, one cell per ``stride`` x ``stride`` pixels."""

    channels: int
    stride: int
    name: str  # what users know it as, for messages ("the Flux2 latent")
    makers: str = ""  # the ComfyUI nodes that make an empty one, for the wrong-latent message
    comfy_format: str = ""  # its class in comfy.latent_formats (previews, ComfyUI's samplers on our MODEL)
    cells_per_token: int = 1  # a DiT token covers this many cells a side (its patch): sides are multiples of it
    # the DiT denoises (VAE latent - shift) x scale: ComfyUI's latent format (process_in / process_out), diffusers'
    # VAE config (scaling_factor, shift_factor)
    scale: float = 1.0
    shift: float = 0.0

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        """A VAE latent (what ComfyUI's LATENT holds) in the DiT's space."""
        return latent if (self.scale, self.shift) == (1.0, 0.0) else (latent - self.shift) * self.scale

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        return latent if (self.scale, self.shift) == (1.0, 0.0) else latent / self.scale + self.shift

    @property
    def pixel_multiple(self) -> int:
        """What each side of a picture must be a multiple of, in pixels."""
        return self.stride * self.cells_per_token

    def tokens(self, width: int, height: int) -> int:
        """The DiT's image tokens for a picture of ``width`` x ``height`` pixels (diffusers' ``image_seq_len``)."""
        return (width // self.pixel_multiple) * (height // self.pixel_multiple)


@dataclass(frozen=True)
class Layout:
    """Another tool's names for a family's tensors (Z-Image's original names, which ComfyUI's repack keeps: q, k and
    v fused in one tensor). engine/io/layouts.py reads such a file in the family's own names."""

    name: str  # for messages: "the original (ComfyUI) layout"
    signature: Tuple[str, ...]  # tensors (no prefix) that mark a file written in it
    renames: Tuple[Tuple[str, str], ...]  # (their text, ours) replaced in every name, in order
    splits: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)  # a fused tensor's name ending -> the
    # endings of its equal parts along dim 0 (".attention.qkv.weight" -> to_q, to_k, to_v); the fused module's other
    # tensors (a bias, a quantized weight's scales) go to each part too, cut or whole (engine/io/layouts.py)
    drops: Tuple[str, ...] = ()  # tensors the family's model has no use for

    def translate(self, key: str) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
        """Our names for their tensor ``key``, each with its (part, parts) when the tensor is split; [] to drop."""
        if key in self.drops:
            return []
        for theirs, ours in self.renames:
            key = key.replace(theirs, ours)
        for ending, parts in self.splits.items():
            if key.endswith(ending):
                stem = key[: -len(ending)]
                return [(stem + part, (i, len(parts))) for i, part in enumerate(parts)]
            head, _, leaf = key.rpartition(".")  # a companion of the fused weight (a scale, a bias): each part's
            module, weight = ending.rsplit(".", 1)
            if head.endswith(module) and leaf != weight:
                stem = head[: -len(module)]
                return [(stem + part[: -len(weight)] + leaf, (i, len(parts))) for i, part in enumerate(parts)]
        return [(key, None)]

    def their_name(self, key: str) -> str:
        """``translate``'s inverse: their name of our tensor ``key`` (a part of a fused tensor: the fused one)."""
        for ending, parts in self.splits.items():
            part = next((p for p in parts if key.endswith(p)), None)
            if part is not None:
                key = key[: -len(part)] + ending
                break
        for theirs, ours in reversed(self.renames):
            key = key.replace(ours, theirs)
        return key


def run_blocks(model: nn.Module, h: torch.Tensor, ctx) -> torch.Tensor:
    """Every block on every row (engine/models/block_loop.py with no runner): a model's ``block_runner`` until a
    feature replaces it (Cache-DiT's runner; offload and parallel wrap the blocks or call this)."""
    return block_loop(family_of(model).loop_blocks(model), h, [(h, ctx)], [None], lambda active: ctx)


@dataclass(frozen=True)
class Companions:
    """What a prompt-to-picture entry point (``sgld generate`` / ``serve``, the pipeline) loads beside a family's DiT:
    the classes of its text encoder and VAE (each ``load(path, device=..., config=...)``; the text encoder also
    ``dtype``, ``tokenizer``, ``placement``: engine/models/external.py), its prompt enhancer's, and what a picture is
    by default."""

    text_encoder: type
    vae: type
    default_size: int  # the picture's side in pixels when a caller gives none (the release pipeline's default)
    pipeline_class: str  # ``_class_name`` of the release's model_index.json (diffusers' pipeline)
    # diffusers' ``guidance_scale`` of that pipeline plus this is the engine's cfg (Z-Image's pipeline guides as
    # cond + g (cond - uncond): cfg g + 1, and Turbo's guidance_scale=0.0 is cfg 1)
    guidance_offset: float = 0.0
    # its prompt enhancer (``from_pretrained(path, tokenizer=, device=, dtype=)``, engine/models/prompt_enhancer.py), or
    # None: its release ships none, and ``--pe`` / ``use_pe`` are refused by name
    prompt_enhancer: Optional[type] = None
    # its pipeline computes a release's resolution-dependent shift (diffusers' use_dynamic_shifting: ``mu`` from the
    # token count); False: a release that asks for one is refused by name (its diffusers pipeline passes no ``mu``)
    dynamic_shift: bool = False


@dataclass(frozen=True)
class Family:
    """One DiT architecture as the generic layers see it (the module docstring gives the model's contract)."""

    name: str  # "ernie-image": the architecture name in files and messages
    title: str  # "ERNIE-Image": for messages
    config_class: type
    model_class: type
    context_class: type
    signature_keys: Tuple[str, ...]  # tensors (no prefix) that identify the family's state dict
    blocks: str  # the model attribute holding the nn.ModuleList of blocks, also the keys' prefix ("layers")
    block_linears: Tuple[str, ...]  # nn.Linear paths inside a block that weight formats, LoRA and TP handle
    shard_dims: Mapping[str, int]  # tensor parallel: block linear -> split dim (0 column, 1 row parallel)
    partial_sum_modules: Tuple[str, ...]  # block submodules whose output is a partial sum under TP (all-reduced)
    heads_module: str  # the block submodule whose ``heads`` is divided by the TP degree
    fuse_groups: Mapping[type, Tuple[str, Tuple[str, ...]]]  # module class -> (fused name, its member linears)
    latent: Latent
    join_contexts: Callable  # (contexts, length, attention) -> one context over their rows, each padded to ``length``
    chunk_context: Callable  # (ctx, pad, chunk slice, attention, valid_tokens) -> the context of one rank's chunk
    # (config, x shape [rows, C, h, w], text tokens, dtype) -> the device bytes one forward holds besides the
    # weights at its peak (offload "auto" decides per call with it; checked against the fake-CUDA trace)
    activation_bytes: Callable
    config_metadata_key: str = ""  # a safetensors metadata entry that may carry the config as JSON
    checkpoint_prefixes: Tuple[str, ...] = ()  # prefixes other tools put before the keys (stripped on load)
    layouts: Tuple[Layout, ...] = ()  # other tools' names for the tensors, read in ours (engine/io/layouts.py)
    diffusers_class: str = ""  # the diffusers transformer class of this family, for engine.accelerate
    gguf_architecture: str = ""  # ``general.architecture`` of the family's GGUF files (what other tools write)
    comfy_model: str = ""  # ComfyUI's name for the family (comfy.supported_models / comfy.model_base)
    comfy_unet_config: Mapping[str, object] = field(default_factory=dict)  # ComfyUI's unet_config marking the family
    # variant ("base", "turbo") -> {"steps", "cfg"} its release is run with; the first is a file's when its name
    # and config name no variant of the family
    sampling_defaults: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # variant -> config keys only its release's transformer config has (ERNIE-Image-Turbo's lora_rank, use_lora)
    variant_config_keys: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    sizes: Tuple[Tuple[int, int], ...] = ()  # recommended (width, height) in pixels, for tooltips
    max_layers: int = 512  # a bound on the blocks a file's header can ask for
    # the dtypes it computes in safely, fastest first (ComfyUI's supported_inference_dtypes): the default compute
    # dtype is the first the device computes natively (engine/compute_dtype.py); fp16 only where it does not overflow
    compute_dtypes: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    companions: Optional[Companions] = None  # its text encoder and VAE (None: the DiT alone runs, in sgld bench)
    # every ModuleList of blocks a forward runs, in the order it runs them, ``blocks`` among them (Z-Image's refiners
    # before its main blocks); () is ``blocks`` alone. Layer-wise offload streams them all; the cache, compile and
    # parallel wrap ``blocks`` (the others run inside ``embed``)
    block_lists: Tuple[str, ...] = ()
    # list -> how its blocks are called (``PATTERNS``); a list not named is ``SINGLE_STREAM``
    block_patterns: Mapping[str, str] = field(default_factory=dict)
    # the lists the block loop runs, one after the other, ``blocks`` first (() is ``blocks`` alone): Flux's double
    # blocks, then its single blocks. The config's ``num_layers`` counts them all (Cache-DiT's fn / bn index the
    # loop); tensor parallel shards ``blocks`` only (the others run whole on each rank)
    loop_lists: Tuple[str, ...] = ()

    # -- what the generic layers ask ---------------------------------------------------------------------
    def blocks_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(model, self.blocks)

    @property
    def loop_names(self) -> Tuple[str, ...]:
        """The lists the block loop runs, in order (``loop_lists``, else ``blocks`` alone)."""
        return self.loop_lists or (self.blocks,)

    def loop_blocks(self, model: nn.Module) -> Sequence[Callable]:
        """The blocks the loop runs, as it calls them, ``(h, ctx) -> h`` whatever their list's pattern (their slices
        and iteration announce them to layer-wise offload, as a ModuleList's own do)."""
        parts = [TwoStreamBlocks(getattr(model, name)) if self.block_patterns.get(name) == TWO_STREAMS
                 else getattr(model, name) for name in self.loop_names]
        return parts[0] if len(parts) == 1 else LoopBlocks(parts)

    @property
    def list_names(self) -> Tuple[str, ...]:
        """The attributes of its lists of blocks, in a forward's order (``block_lists``, else ``blocks`` alone)."""
        return self.block_lists or (self.blocks,)

    def block_lists_of(self, model: nn.Module) -> List[nn.ModuleList]:
        """Every list of blocks, in the order a forward runs them (``block_lists``)."""
        return [getattr(model, name) for name in self.list_names]

    def variant_of(self, config: Mapping[str, object], name: str) -> str:
        """Which of its variants (``sampling_defaults``) a file is: the one whose own config keys ``config`` has, else
        the one ``name`` (the file's or its folder's) names, else the first."""
        for variant, keys in self.variant_config_keys.items():
            if any(key in config for key in keys):
                return variant
        named = [variant for variant in self.sampling_defaults if variant in name.lower()]
        return named[0] if named else next(iter(self.sampling_defaults), "")

    def device_of(self, model: nn.Module) -> torch.device:
        """The compute device: that of the model's parameters outside the blocks (layer-wise offload keeps blocks
        on the host and brings each to this device when it runs)."""
        prefixes = tuple(name + "." for name in self.list_names)
        return next(p.device for name, p in model.named_parameters() if not name.startswith(prefixes))

    def block_key(self, index: int, path: str = "") -> str:
        """The state-dict / module name of block ``index`` (and ``path`` inside it)."""
        return f"{self.blocks}.{index}.{path}" if path else f"{self.blocks}.{index}"

    def split_block_key(self, key: str, lists: Optional[Sequence[str]] = None) -> Optional[Tuple[int, str]]:
        """(block index, path inside the block) of a module or tensor name in the main blocks (or in any of
        ``lists``), or None outside them."""
        head, _, rest = key.partition(".")
        index, _, path = rest.partition(".")
        if head not in (lists or (self.blocks,)) or not index.isdigit():
            return None
        return int(index), path

    def block_linear_of(self, layer: str) -> Optional[str]:
        """The block-linear path (``block_linears``) of module name ``layer`` in any list of blocks (Z-Image's
        refiners too), or None if it is not one."""
        parts = self.split_block_key(layer, self.list_names)
        return parts[1] if parts is not None and parts[1] in self.block_linears else None

    def is_block_linear(self, name: str) -> bool:
        """Is module ``name`` one of the block linears (what weight formats replace and LoRA handles)?"""
        return self.block_linear_of(name) is not None

    def shard_dim(self, key: str) -> Optional[int]:
        """The dim tensor ``key`` is split along under tensor parallel, or None (kept whole on every rank): the main
        blocks' linears (the other lists run whole on every rank, inside ``embed``)."""
        parts = self.split_block_key(key[: -len(".weight")]) if key.endswith(".weight") else None
        return None if parts is None or parts[1] not in self.block_linears else self.shard_dims.get(parts[1])

    def has_signature(self, keys: Iterable[str], prefix: str = "") -> bool:
        keys = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        return all(prefix + k in keys for k in self.signature_keys)

    def config_from_shapes(self, shapes, overrides=None, source: str = "config"):
        return self.config_class.from_shapes(shapes, overrides, source)

    def build(self, config, device="meta") -> nn.Module:
        with torch.device(device):
            return self.model_class(config)


def chunk_rope_context(ctx, pad: int, chunk: slice, attention: Callable, valid_tokens: int):
    """``Family.chunk_context`` for a context whose ``rope`` is a pair of [B, S, ...] tables (ERNIE-Image's, Z-Image's):
    the tables of one sequence-parallel rank's ``chunk`` of the sequence padded by ``pad`` tokens, ``attention`` over
    the whole sequence (it holds the key mask)."""
    cos, sin = (F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t for t in ctx.rope)
    return dataclasses.replace(ctx, rope=(cos[:, chunk], sin[:, chunk]), key_mask=None, attention=attention,
                               valid_tokens=valid_tokens, key_mask_host=None)


class RMSNorm(nn.Module):
    """RMS norm with a weight, in the parameter layout both families' files use (``weight``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without its weight (callers fold the weight into a following scale)."""
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)


_FAMILIES: Dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` known to detection and ``family_of``; registering the same name again replaces it.
    ValueError for a pattern of a list it does not have, or a pattern the loop does not know."""
    for name, pattern in family.block_patterns.items():
        if name not in family.list_names or pattern not in PATTERNS:
            raise ValueError(f"family {family.name}: block pattern {name!r}: {pattern!r}; its lists are "
                             f"{', '.join(family.list_names)}, the patterns {', '.join(PATTERNS)}")
    loop = family.loop_names
    if loop[0] != family.blocks or not set(loop) <= set(family.list_names) or len(set(loop)) < len(loop):
        raise ValueError(f"family {family.name}: loop_lists {', '.join(loop)}: each of its lists once, "
                         f"'{family.blocks}' (its blocks) first, the others among {', '.join(family.list_names)}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> List[Family]:
    return list(_FAMILIES.values())


def family_of(model) -> Family:
    """The family of a model (an instance, its class or its config): the family of the nearest class in its MRO (a
    family whose model subclasses another's is its own)."""
    for klass in (model if isinstance(model, type) else type(model)).__mro__:
        for fam in _FAMILIES.values():
            if klass is fam.model_class or klass is fam.config_class:
                return fam
    raise TypeError(f"{type(model).__name__} is not a model of a registered DiT family "
                    f"({', '.join(_FAMILIES) or 'none registered'})")


def detect(keys: Iterable[str]) -> Optional[Tuple[Family, str]]:
    """The family whose signature keys a state dict holds, and the prefix its keys carry ('' for none)."""
    keys = set(keys)
    for fam in _FAMILIES.values():
        for prefix in ("",) + fam.checkpoint_prefixes:
            if fam.has_signature(keys, prefix):
                return fam, prefix
    return None


def detect_layout(keys: Iterable[str]) -> Optional[Tuple[Family, str, Layout]]:
    """The family and layout whose signature a state dict in another tool's names holds, and the keys' prefix."""
    keys = set(keys)
    for fam in _FAMILIES.values():
        for layout in fam.layouts:
            for prefix in ("",) + fam.checkpoint_prefixes:
                if all(prefix + k in keys for k in layout.signature):
                    return fam, prefix, layout
    return None


def get(name: str) -> Family:
    if name not in _FAMILIES:
        raise KeyError(f"unknown DiT family '{name}' (known: {', '.join(_FAMILIES)})")
    return _FAMILIES[name]
