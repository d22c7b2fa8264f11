"""ERNIE-Image's configuration, read from a state dict's shapes (``ErnieImageConfig.from_shapes``), and the keys
that identify its files. Kept beside the model (engine/models/ernie_image.py) so that checks of a file's header
stay readable on their own."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from .family import check_block_list

ARCHITECTURE = "ernie-image"
# Keys that identify an ERNIE-Image DiT state dict (as ComfyUI and other tools detect it).
SIGNATURE_KEYS = ("layers.0.mlp.linear_fc2.weight", "layers.0.adaLN_sa_ln.weight")


@dataclass(frozen=True)
class ErnieImageConfig:
    hidden_size: int = 4096
    num_layers: int = 36
    num_attention_heads: int = 32
    ffn_hidden_size: int = 12288
    in_channels: int = 128
    out_channels: int = 128
    text_in_dim: int = 3072
    patch_size: int = 1
    rope_axes_dim: tuple = (32, 48, 48)
    rope_theta: float = 256.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_axes_dim"] = list(self.rope_axes_dim)
        return d

    @staticmethod
    def default_rope_axes(head_dim: int) -> tuple:
        """The release splits its 128-dim head 32/48/48; smaller heads keep the 1/4, 3/8, 3/8 split."""
        if head_dim == 128:
            return (32, 48, 48)
        a0 = 2 * round(head_dim / 8)
        a1 = 2 * ((head_dim - a0) // 4)
        return (a0, a1, head_dim - a0 - a1)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Sequence[int]], overrides: Optional[dict] = None,
                    source: str = "config") -> "ErnieImageConfig":
        """Derive the configuration from tensor shapes (keys without any prefix), checking the key set first
        so that a small header cannot ask for a huge model: layer indices contiguous from 0 and at most
        MAX_LAYERS, every layer with the weights and biases of layer 0 in the same shapes. ``overrides``
        (a file's config, named ``source`` in messages) may restate what the shapes say and set
        rope_axes_dim / rope_theta / eps; other keys (``_class_name``, ``lora_rank`` ...) are ignored, as
        diffusers does. Raises ValueError naming the tensor or field."""

        def dims(key: str, rank: int) -> tuple:
            if key not in shapes:
                raise ValueError(f"tensor '{key}' is missing")
            shape = tuple(shapes[key])
            if len(shape) != rank or not all(d > 0 for d in shape):
                raise ValueError(f"tensor '{key}' has shape {shape}; a {rank}-D shape with positive sizes is needed")
            return shape

        num_layers = _check_layers(shapes)
        hidden, in_ch, patch, patch_w = dims("x_embedder.proj.weight", 4)
        if patch != patch_w:
            raise ValueError(f"tensor 'x_embedder.proj.weight' has shape {(hidden, in_ch, patch, patch_w)}; the patch must be square")
        (head_dim,) = dims("layers.0.self_attention.norm_q.weight", 1)
        if hidden % head_dim:
            raise ValueError(f"tensor 'layers.0.self_attention.norm_q.weight' gives a head size of {head_dim}, which does "
                             f"not divide the hidden size {hidden}")
        final_out = dims("final_linear.weight", 2)[0]
        if final_out % (patch * patch):
            raise ValueError(f"tensor 'final_linear.weight' has {final_out} outputs, not a multiple of patch_size^2 = {patch * patch}")
        kw = dict(
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=hidden // head_dim,
            ffn_hidden_size=dims("layers.0.mlp.gate_proj.weight", 2)[0],
            in_channels=in_ch,
            out_channels=final_out // (patch * patch),
            text_in_dim=dims("text_proj.weight", 2)[1] if "text_proj.weight" in shapes else hidden,
            patch_size=patch,
            rope_axes_dim=cls.default_rope_axes(head_dim),
        )
        for k, v in (overrides or {}).items():
            if k in kw and k != "rope_axes_dim":
                if type(v) is not int or v != kw[k]:
                    raise ValueError(f"{source}: field '{k}' = {v!r} disagrees with the tensors, which give {kw[k]}")
            elif k == "rope_axes_dim":
                if not (isinstance(v, (list, tuple)) and len(v) == 3 and all(type(d) is int for d in v)):
                    raise ValueError(f"{source}: field 'rope_axes_dim' = {v!r} must be a list of 3 integers")
                kw[k] = tuple(v)
            elif k in ("rope_theta", "eps"):
                if type(v) not in (int, float) or not math.isfinite(v) or v <= 0 or (k == "eps" and v >= 1):
                    allowed = "a number between 0 and 1 (exclusive)" if k == "eps" else "a finite number > 0"
                    raise ValueError(f"{source}: field '{k}' = {v!r} must be {allowed}")
                kw[k] = float(v)
            elif k == "qk_layernorm" and v is not True:
                raise ValueError(f"{source}: field 'qk_layernorm' = {v!r}: this model always normalises q and k (allowed: true)")
        axes = kw["rope_axes_dim"]
        if sum(axes) != head_dim or any(d < 0 or d % 2 for d in axes):
            what = f"{source}: field 'rope_axes_dim' = {list(axes)}" if "rope_axes_dim" in (overrides or {}) else \
                f"the default rope_axes_dim {list(axes)}"
            raise ValueError(f"{what} must be 3 non-negative even sizes that sum to the head size {head_dim} "
                             "(from tensor 'layers.0.self_attention.norm_q.weight')")
        return cls(**kw)


MAX_LAYERS = 512  # the release has 36; a bound on the work a file's header can ask for


def _check_layers(shapes: Mapping[str, Sequence[int]]) -> int:
    return check_block_list(shapes, "layers", MAX_LAYERS, "ERNIE-Image has 36")
