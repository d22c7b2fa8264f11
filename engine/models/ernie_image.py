"""ERNIE-Image DiT (Baidu): single-stream transformer with one shared AdaLN modulation.

Parameter names are those of the released checkpoints (diffusers layout), so the 8B files
load unchanged. The configuration is read from tensor shapes (``ErnieImageConfig.from_shapes``),
so tiny test checkpoints and the release take the same path.

The forward is split into ``embed`` -> ``run_blocks`` -> ``unembed`` so that caching, offload and
parallelism can wrap the block loop from outside (``model.block_runner``) without forking the model.
Quirks reproduced on purpose (reference ernie_image.md §7.1): image tokens first, image RoPE axis 0
equals the sample's text length, the non-orthogonal rotate-half RoPE, exact GELU in the GeGLU,
no norm on text features, and a final AdaLN driven by the un-activated time embedding in
(scale, shift) order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .ernie_image_config import ARCHITECTURE, MAX_LAYERS, SIGNATURE_KEYS, ErnieImageConfig
from .external import Flux2VAE, TextEncoder
from .family import Companions, Family, Latent, RMSNorm, chunk_rope_context, register, run_blocks, sdpa
from .prompt_enhancer import PromptEnhancer


class Attention(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.to_q = nn.Linear(h, h, bias=False)
        self.to_k = nn.Linear(h, h, bias=False)
        self.to_v = nn.Linear(h, h, bias=False)
        self.norm_q = RMSNorm(cfg.head_dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.head_dim, cfg.eps)
        self.to_out = nn.ModuleList([nn.Linear(h, h, bias=False)])

    def forward(self, x: torch.Tensor, ctx: "BlockContext") -> torch.Tensor:
        b, s, _ = x.shape
        if "qkv" in self._modules:  # fused by engine/features/fuse.py: one GEMM
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        else:
            q, k, v = (lin(x).view(b, s, self.heads, -1) for lin in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rope(q, ctx.rope), apply_rope(k, ctx.rope)
        out = ctx.attention(q, k, v, ctx.key_mask)  # [B, S, heads, head_dim]
        return self.to_out[0](out.reshape(b, s, -1))


class GeGLU(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up" in self._modules:  # fused by engine/features/fuse.py: one GEMM
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.linear_fc2(up * F.gelu(gate))


class ErnieImageBlock(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.adaLN_sa_ln = RMSNorm(cfg.hidden_size, cfg.eps)
        self.self_attention = Attention(cfg)
        self.adaLN_mlp_ln = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = GeGLU(cfg)

    def forward(self, h: torch.Tensor, ctx: "BlockContext") -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ctx.modulation
        # RMSNorm's weight is folded into the (1 + scale) of the modulation: one pass less over h.
        y = torch.addcmul(shift_msa, self.adaLN_sa_ln.normalize(h), self.adaLN_sa_ln.weight * scale_msa)
        h = torch.addcmul(h, gate_msa, self.self_attention(y, ctx))
        y = torch.addcmul(shift_mlp, self.adaLN_mlp_ln.normalize(h), self.adaLN_mlp_ln.weight * scale_mlp)
        return torch.addcmul(h, gate_mlp, self.mlp(y))


@dataclass
class BlockContext:
    """Everything a block needs besides the hidden states; computed once per forward."""

    modulation: tuple  # six [B, 1, H] tensors; the scales already hold the "1 +"
    rope: tuple  # (cos, sin_signed), each [B, S, 1, head_dim]
    key_mask: Optional[torch.Tensor]  # bool [B, S] (True = attend) or None when nothing is padded
    attention: Callable
    num_image_tokens: int
    grid: tuple  # (Hp, Wp) patch grid of the image
    temb: torch.Tensor  # [B, H] time embedding (drives the final AdaLN)
    # tokens of this rank's sequence chunk that are real (sequence parallel pads the sequence to a multiple
    # of the ranks; the cache's distance leaves the padding out); None = all
    valid_tokens: Optional[int] = None
    # key_mask on the host when the lengths were given there (ring attention reads its blocks' valid lengths
    # from it without a device sync); None otherwise
    key_mask_host: Optional[torch.Tensor] = None


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """diffusers ``Timesteps(dim, flip_sin_to_cos=False, downscale_freq_shift=0)``: [sin | cos]."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device)
    args = t.float()[:, None] * torch.exp(exponent / half)[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def rope_angles(pos: torch.Tensor, axes_dim: Sequence[int], theta: float) -> torch.Tensor:
    """pos [B, S, 3] -> per-dim angles [B, S, head_dim] laid out as diffusers' ErnieImageEmbedND3.

    Computed in float32 like diffusers (ComfyUI uses float64; the difference is below 1e-6).
    """
    parts = []
    for i, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d))
        parts.append(pos[..., i : i + 1].float() * omega)
    emb = torch.cat(parts, dim=-1)  # [B, S, head_dim/2]
    return emb.repeat_interleave(2, dim=-1)  # [θ0, θ0, θ1, θ1, ...]


def apply_rope(x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Non-interleaved rotate-half with per-dim angles: not an orthogonal rotation (ERNIE quirk)."""
    cos, sin_signed = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, rotated, sin_signed)


class FinalNorm(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.eps = cfg.eps
        self.linear = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)


class TimeEmbedding(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p)


class ErnieImageTransformer(nn.Module):
    """The ERNIE-Image DiT. ``forward`` matches diffusers' ErnieImageTransformer2DModel inputs."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.x_embedder = PatchEmbed(cfg)
        # Like diffusers, a text dim equal to the hidden size means no projection at all.
        self.text_proj = nn.Linear(cfg.text_in_dim, h, bias=False) if cfg.text_in_dim != h else None
        self.time_embedding = TimeEmbedding(cfg)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))
        self.layers = nn.ModuleList([ErnieImageBlock(cfg) for _ in range(cfg.num_layers)])
        self.final_norm = FinalNorm(cfg)
        self.final_linear = nn.Linear(h, cfg.patch_size * cfg.patch_size * cfg.out_channels)
        self.attention = sdpa
        # Replaceable by wrappers (cache, offload, parallel): (model, h, ctx) -> h.
        self.block_runner: Callable = run_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.final_linear.weight.dtype

    # -- forward, in three parts ------------------------------------------------------------
    def embed(self, hidden_states, timestep, text_bth, text_lens):
        cfg = self.config
        dtype = self.dtype
        b, _, height, width = hidden_states.shape
        p = cfg.patch_size
        gh, gw = height // p, width // p
        n_img = gh * gw
        img = self.x_embedder.proj(hidden_states.to(dtype)).flatten(2).transpose(1, 2)
        txt = text_bth.to(dtype)
        if self.text_proj is not None:
            txt = self.text_proj(txt)
        t_max = txt.shape[1]
        h = torch.cat([img, txt], dim=1)

        # "is anything padded" is decided where the lengths are: on the host when given there (the engine's
        # own calls: no device sync per forward, and fake-tensor traces can run it), else on their device
        lens_given = torch.as_tensor(text_lens).reshape(-1)
        padded = bool((lens_given < t_max).any())
        text_lens = lens_given.to(h.device, torch.long)
        if text_lens.numel() == 1 and b > 1:
            text_lens = text_lens.expand(b)
        timestep = torch.as_tensor(timestep, device=h.device).reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b)

        temb = self.time_embedding(timestep_sinusoid(timestep, cfg.hidden_size).to(dtype))
        mod = self.adaLN_modulation(temb).unsqueeze(1).chunk(6, dim=-1)
        modulation = (mod[0], 1 + mod[1], mod[2], mod[3], 1 + mod[4], mod[5])

        rope = self.rope(text_lens, t_max, gh, gw, dtype, h.device)
        key_mask = key_mask_host = None
        if padded:  # made where the lengths are, then copied (from the host: no read of a device value)
            where = lens_given.device
            mask = torch.ones(b, n_img + t_max, dtype=torch.bool, device=where)
            mask[:, n_img:] = torch.arange(t_max, device=where)[None] < lens_given.long().expand(b)[:, None]
            key_mask = mask.to(h.device)
            key_mask_host = mask if where.type == "cpu" else None
        ctx = BlockContext(modulation, rope, key_mask, self.attention, n_img, (gh, gw), temb,
                           key_mask_host=key_mask_host)
        return h, ctx

    def rope(self, text_lens: torch.Tensor, t_max: int, gh: int, gw: int, dtype, device) -> tuple:
        """cos and signed sin [B, S, 1, head_dim], computed once per forward for all layers."""
        b = text_lens.shape[0]
        yy, xx = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
        img = torch.stack([torch.zeros_like(yy), yy, xx], dim=-1).reshape(1, -1, 3).repeat(b, 1, 1)
        img[..., 0] = text_lens[:, None]
        txt = torch.zeros(b, t_max, 3, dtype=torch.long, device=device)
        txt[..., 0] = torch.arange(t_max, device=device)
        pos = torch.cat([img, txt], dim=1)
        angles = rope_angles(pos, self.config.rope_axes_dim, self.config.rope_theta)
        half = angles.shape[-1] // 2
        sin = torch.sin(angles)
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return torch.cos(angles).to(dtype).unsqueeze(2), sin_signed.to(dtype).unsqueeze(2)

    def unembed(self, h: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        cfg = self.config
        scale, shift = self.final_norm.linear(ctx.temb).unsqueeze(1).chunk(2, dim=-1)
        h = F.layer_norm(h[:, : ctx.num_image_tokens], (h.shape[-1],), eps=self.final_norm.eps)
        out = self.final_linear(torch.addcmul(shift, h, 1 + scale))
        b = out.shape[0]
        gh, gw = ctx.grid
        p = cfg.patch_size
        out = out.view(b, gh, gw, p, p, cfg.out_channels).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, cfg.out_channels, gh * p, gw * p)

    def forward(self, hidden_states, timestep, text_bth, text_lens):
        h, ctx = self.embed(hidden_states, timestep, text_bth, text_lens)
        h = self.block_runner(self, h, ctx)
        return self.unembed(h, ctx)


# -- what the generic layers know of ERNIE-Image (engine/models/family.py) ------------------------------------
def activation_bytes(cfg: ErnieImageConfig, x_shape: Sequence[int], text_tokens: int, dtype: torch.dtype) -> int:
    """A forward's device bytes besides the weights at its peak, inside a block's GeGLU: per token row the
    residual stream and the MLP input (2 x hidden), the fused gate/up output, GELU(gate) and their product
    (4 x ffn), and one ffn width more for the per-format temporaries (row chunks of quantized activations,
    RoPE, the key mask). The fake-CUDA trace of the 8B release shape (docs/memory.md) is within it for every
    weight format at 1024² and 2048² (tests/test_memory_rehearsal.py)."""
    rows, _, height, width = x_shape
    tokens = (height // cfg.patch_size) * (width // cfg.patch_size) + int(text_tokens)
    itemsize = torch.empty(0, dtype=dtype, device="meta").element_size()
    return int(rows) * tokens * (2 * cfg.hidden_size + 5 * cfg.ffn_hidden_size) * itemsize


def _pad_tokens(t: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, S, ...] zero-padded to [rows, length, ...]."""
    if t.shape[1] == length:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], length - t.shape[1]) + tuple(t.shape[2:]))], dim=1)


def join_contexts(contexts: Sequence[BlockContext], length: int, attention: Callable) -> BlockContext:
    """One context for several jobs' rows, in order, each padded to ``length`` tokens; ``attention`` (the
    served batch's grouped attention) holds each job's own key mask."""
    first = contexts[0]
    return BlockContext(
        modulation=tuple(torch.cat([c.modulation[j] for c in contexts]) for j in range(6)),
        rope=tuple(torch.cat([_pad_tokens(c.rope[j], length) for c in contexts]) for j in range(2)),
        key_mask=None, attention=attention, num_image_tokens=first.num_image_tokens, grid=first.grid,
        temb=torch.cat([c.temb for c in contexts]))


FAMILY = register(Family(
    name=ARCHITECTURE, title="ERNIE-Image",
    config_class=ErnieImageConfig, model_class=ErnieImageTransformer, context_class=BlockContext,
    signature_keys=SIGNATURE_KEYS, blocks="layers",
    block_linears=("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2",
                   "self_attention.qkv", "mlp.gate_up"),  # the last two: fused by engine/features/fuse.py
    shard_dims={"self_attention.to_q": 0, "self_attention.to_k": 0, "self_attention.to_v": 0, "mlp.gate_proj": 0,
                "mlp.up_proj": 0, "self_attention.to_out.0": 1, "mlp.linear_fc2": 1},
    partial_sum_modules=("self_attention", "mlp"), heads_module="self_attention",
    fuse_groups={Attention: ("qkv", ("to_q", "to_k", "to_v")), GeGLU: ("gate_up", ("gate_proj", "up_proj"))},
    latent=Latent(channels=128, stride=16, name="the Flux2 latent", comfy_format="Flux2",
                  makers="EmptyFlux2LatentImage or SGLDiffusion Empty Latent (ERNIE)"),
    join_contexts=join_contexts, chunk_context=chunk_rope_context, activation_bytes=activation_bytes,
    config_metadata_key="ernie_image_config",
    checkpoint_prefixes=("model.diffusion_model.", "diffusion_model.", "transformer."),
    diffusers_class="ErnieImageTransformer2DModel", gguf_architecture="wan",  # as the community's GGUF files say
    comfy_model="ErnieImage", max_layers=MAX_LAYERS,
    comfy_unet_config={"image_model": "ernie"},
    sampling_defaults={"base": {"steps": 50, "cfg": 4.0}, "turbo": {"steps": 8, "cfg": 1.0}},  # the model cards
    variant_config_keys={"turbo": ("lora_rank", "use_lora")},  # Turbo's transformer/config.json has them, Base's not
    sizes=((1024, 1024), (848, 1264), (1264, 848), (768, 1376), (1376, 768), (896, 1200), (1200, 896)),  # model card
    compute_dtypes=(torch.bfloat16, torch.float32),  # trained in bf16; fp16 overflows (its activations pass 65504)
    companions=Companions(TextEncoder, Flux2VAE, default_size=1024, pipeline_class="ErnieImagePipeline",
                          prompt_enhancer=PromptEnhancer),
))
