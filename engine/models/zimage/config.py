"""Z-Image's configuration (Tongyi-MAI's single-stream DiT), read from a state dict's shapes in diffusers' layout
(``ZImageTransformer2DModel``: the key names of the diffusers folder), and the keys that identify its files."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from ..family import Layout, check_block_list

ARCHITECTURE = "z-image"
PATCH = "2-1"  # diffusers' key of the one patch size the releases use: 2x2 pixels, 1 frame
SIGNATURE_KEYS = ("layers.0.attention.to_q.weight", "layers.0.feed_forward.w2.weight", "cap_pad_token",
                  "x_pad_token", f"all_x_embedder.{PATCH}.weight")
# Z-Image's original names, which ComfyUI's repack (z_image_turbo_bf16.safetensors) keeps: q, k and v fused
ORIGINAL_LAYOUT = Layout(
    name="Z-Image's original layout (ComfyUI's repack)",
    signature=("x_embedder.weight", "layers.0.attention.qkv.weight", "cap_pad_token"),
    renames=(("final_layer.", f"all_final_layer.{PATCH}."), ("x_embedder.", f"all_x_embedder.{PATCH}."),
             (".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
             (".attention.k_norm.", ".attention.norm_k.")),
    splits={".attention.qkv.weight": (".attention.to_q.weight", ".attention.to_k.weight", ".attention.to_v.weight")},
    drops=("norm_final.weight",))  # ComfyUI's NextDiT builds it and never uses it
TIME_DIM = 256  # diffusers' ADALN_EMBED_DIM: the width of the time embedding every modulation reads
SEQUENCE_MULTIPLE = 32  # image and caption token runs are each padded to a multiple of this (pad tokens attend)
MAX_LAYERS = 256  # the release has 30 (and 2 + 2 refiners); a bound on the work a header can ask for
USUAL = "Z-Image has 30"


@dataclass(frozen=True)
class ZImageConfig:
    hidden_size: int = 3840
    num_layers: int = 30
    num_refiner_layers: int = 2
    num_attention_heads: int = 30
    ffn_hidden_size: int = 10240
    in_channels: int = 16
    out_channels: int = 16
    text_in_dim: int = 2560
    time_mid_dim: int = 1024  # the time MLP's hidden width (ComfyUI builds min(hidden, 1024): equal at the release)
    patch_size: int = 2
    rope_axes_dim: tuple = (32, 48, 48)
    rope_axes_len: tuple = (1536, 512, 512)
    rope_theta: float = 256.0
    eps: float = 1e-5
    t_scale: float = 1000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def time_dim(self) -> int:
        return min(self.hidden_size, TIME_DIM)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_axes_dim"], d["rope_axes_len"] = list(self.rope_axes_dim), list(self.rope_axes_len)
        return d

    @staticmethod
    def default_rope_axes(head_dim: int) -> tuple:
        """The release splits its 128-dim head 32/48/48; smaller heads keep the 1/4, 3/8, 3/8 split."""
        a0 = 2 * round(head_dim / 8)
        a1 = 2 * ((head_dim - a0) // 4)
        return (a0, a1, head_dim - a0 - a1)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Sequence[int]], overrides: Optional[dict] = None,
                    source: str = "config") -> "ZImageConfig":
        """The configuration from tensor shapes (keys without a prefix): block lists checked first (contiguous, at
        most MAX_LAYERS, alike), so a small header cannot ask for a huge model. ``overrides`` (a file's config, named
        ``source`` in messages; diffusers' names) may restate what the shapes say and set ``axes_dims``,
        ``axes_lens``, ``rope_theta``, ``norm_eps`` and ``t_scale``. Raises ValueError naming the tensor or field."""

        def dims(key: str, rank: int) -> tuple:
            if key not in shapes:
                raise ValueError(f"tensor '{key}' is missing")
            shape = tuple(shapes[key])
            if len(shape) != rank or not all(d > 0 for d in shape):
                raise ValueError(f"tensor '{key}' has shape {shape}; a {rank}-D shape with positive sizes is needed")
            return shape

        layers = check_block_list(shapes, "layers", MAX_LAYERS, USUAL)
        refiners = check_block_list(shapes, "noise_refiner", MAX_LAYERS, "Z-Image has 2")
        if check_block_list(shapes, "context_refiner", MAX_LAYERS, "Z-Image has 2") != refiners:
            raise ValueError("the noise and context refiners must have as many blocks each "
                             f"('noise_refiner' has {refiners})")
        hidden, patch_in = dims(f"all_x_embedder.{PATCH}.weight", 2)
        (head_dim,) = dims("layers.0.attention.norm_q.weight", 1)
        if hidden % head_dim or patch_in % 4:
            raise ValueError(f"tensor 'layers.0.attention.norm_q.weight' gives a head size of {head_dim} for hidden size "
                             f"{hidden} and 'all_x_embedder.{PATCH}.weight' {patch_in} inputs: the head must divide the "
                             "hidden size and the inputs be 4 (2x2 patch) x channels")
        kw = dict(hidden_size=hidden, num_layers=layers, num_refiner_layers=refiners,
                  num_attention_heads=hidden // head_dim, ffn_hidden_size=dims("layers.0.feed_forward.w1.weight", 2)[0],
                  in_channels=patch_in // 4, out_channels=dims(f"all_final_layer.{PATCH}.linear.weight", 2)[0] // 4,
                  text_in_dim=dims("cap_embedder.1.weight", 2)[1], patch_size=2,
                  time_mid_dim=dims("t_embedder.mlp.0.weight", 2)[0],
                  rope_axes_dim=cls.default_rope_axes(head_dim))
        named = {"dim": "hidden_size", "n_layers": "num_layers", "n_refiner_layers": "num_refiner_layers",
                 "n_heads": "num_attention_heads", "in_channels": "in_channels", "cap_feat_dim": "text_in_dim"}
        for k, v in (overrides or {}).items():
            if k in named:
                if type(v) is not int or v != kw[named[k]]:
                    raise ValueError(f"{source}: field '{k}' = {v!r} disagrees with the tensors, which give "
                                     f"{kw[named[k]]}")
            elif k in ("axes_dims", "axes_lens"):
                if not (isinstance(v, (list, tuple)) and len(v) == 3 and all(type(d) is int and d > 0 for d in v)):
                    raise ValueError(f"{source}: field '{k}' = {v!r} must be a list of 3 positive integers")
                kw["rope_axes_dim" if k == "axes_dims" else "rope_axes_len"] = tuple(v)
            elif k in ("rope_theta", "norm_eps", "t_scale"):
                if type(v) not in (int, float) or not math.isfinite(v) or v <= 0 or (k == "norm_eps" and v >= 1):
                    raise ValueError(f"{source}: field '{k}' = {v!r} must be a finite number > 0"
                                     + (" and < 1" if k == "norm_eps" else ""))
                kw[{"norm_eps": "eps"}.get(k, k)] = float(v)
            elif k in ("n_kv_heads", "qk_norm", "all_patch_size", "all_f_patch_size", "siglip_feat_dim") and v not in (
                    kw["num_attention_heads"], True, [2], (2,), [1], (1,), None):
                raise ValueError(f"{source}: field '{k}' = {v!r} is not supported (Z-Image's text-to-image DiT: as many "
                                 "key/value heads as heads, q/k norms, 2x2 patches of one frame, no SigLIP inputs)")
        axes = kw["rope_axes_dim"]
        if sum(axes) != head_dim or any(d % 2 for d in axes):
            raise ValueError(f"rope axes {list(axes)} must be 3 even sizes that sum to the head size {head_dim} "
                             "(from tensor 'layers.0.attention.norm_q.weight'; a config's 'axes_dims' sets them)")
        return cls(**kw)
