"""Z-Image DiT (Tongyi-MAI): a single-stream transformer whose image and caption tokens each pass their own
refiner blocks first (the noise refiner modulated by the time, the context refiner not), then run together through
the main blocks, each block with its own modulation from the time embedding.

Parameter names are diffusers' (``ZImageTransformer2DModel``), so a diffusers folder loads unchanged. The forward
follows the engine's convention (engine/models/family.py): the timestep is 1000 x sigma and the output is the
velocity; Z-Image's own t is 1 - sigma and its output the negated velocity (diffusers' pipeline negates it).
Reproduced on purpose: image tokens first; image and caption runs each padded to a multiple of 32 with learned pad
tokens that attend like real ones (only a batch's padding is masked); caption positions (1 + j, 0, 0), image
positions (padded caption length + 1, row, column), image pad tokens at (0, 0, 0); RoPE on interleaved pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..family import Companions, Family, Latent, RMSNorm, chunk_rope_context, register, run_blocks, sdpa
from .config import ARCHITECTURE, MAX_LAYERS, ORIGINAL_LAYOUT, PATCH, SEQUENCE_MULTIPLE, SIGNATURE_KEYS, ZImageConfig
from .parts import FluxVAE, QwenTextEncoder


class Attention(nn.Module):
    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.to_q = nn.Linear(h, h, bias=False)
        self.to_k = nn.Linear(h, h, bias=False)
        self.to_v = nn.Linear(h, h, bias=False)
        self.norm_q = RMSNorm(cfg.head_dim, 1e-5)  # diffusers' Attention(qk_norm="rms_norm", eps=1e-5)
        self.norm_k = RMSNorm(cfg.head_dim, 1e-5)
        self.to_out = nn.ModuleList([nn.Linear(h, h, bias=False)])

    def forward(self, x: torch.Tensor, ctx: "ZImageContext") -> torch.Tensor:
        b, s, _ = x.shape
        if "qkv" in self._modules:  # fused by engine/features/fuse.py: one GEMM
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        else:
            q, k, v = (lin(x).view(b, s, self.heads, -1) for lin in (self.to_q, self.to_k, self.to_v))
        q, k = apply_rope(self.norm_q(q), ctx.rope), apply_rope(self.norm_k(k), ctx.rope)
        out = ctx.attention(q, k, v, ctx.key_mask)  # [B, S, heads, head_dim]
        return self.to_out[0](out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "w13" in self._modules:  # fused by engine/features/fuse.py: one GEMM
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class ZImageBlock(nn.Module):
    """A main or refiner block: ``modulated`` blocks scale and gate by the time embedding (tanh gates)."""

    def __init__(self, cfg: ZImageConfig, modulated: bool = True):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.eps
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm1, self.ffn_norm1 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(h, eps), RMSNorm(h, eps)
        if modulated:
            self.adaLN_modulation = nn.Sequential(nn.Linear(cfg.time_dim, 4 * h))

    def forward(self, h: torch.Tensor, ctx: "ZImageContext") -> torch.Tensor:
        if "adaLN_modulation" not in self._modules:  # the context refiner
            h = h + self.attention_norm2(self.attention(self.attention_norm1(h), ctx))
            return h + self.ffn_norm2(self.feed_forward(self.ffn_norm1(h)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(ctx.temb).unsqueeze(1).chunk(4, dim=-1)
        h = h + gate_msa.tanh() * self.attention_norm2(self.attention(self.attention_norm1(h) * (1 + scale_msa), ctx))
        return h + gate_mlp.tanh() * self.ffn_norm2(self.feed_forward(self.ffn_norm1(h) * (1 + scale_mlp)))


@dataclass
class ZImageContext:
    """Everything a block needs besides the hidden states; computed once per forward."""

    temb: torch.Tensor  # [B, time_dim] time embedding (every modulation and the final layer read it)
    rope: tuple  # (cos, sin), each float32 [B, S, 1, head_dim / 2]
    key_mask: Optional[torch.Tensor]  # bool [B, S] (True = attend) or None when no row is padded
    attention: Callable
    num_image_tokens: int  # real image tokens (the image run's pad tokens follow them)
    grid: tuple  # (Hp, Wp) patch grid of the image
    valid_tokens: Optional[int] = None  # sequence parallel: the real tokens of this rank's chunk (None = all)
    key_mask_host: Optional[torch.Tensor] = None  # key_mask on the host, when the lengths were given there


def round_up(n: int, multiple: int = SEQUENCE_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """diffusers' Z-Image ``TimestepEmbedder.timestep_embedding``: [cos | sin], max period 10000, in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(pos: torch.Tensor, axes_dim: Sequence[int], theta: float) -> tuple:
    """pos [B, S, 3] -> (cos, sin) [B, S, 1, head_dim / 2]: angles in float64 rounded to float32 as diffusers'
    ``RopeEmbedder`` tabulates them (its complex64 table), then cos and sin in float32."""
    parts = []
    for i, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d))
        parts.append((pos[..., i : i + 1].double() * omega).float())
    angles = torch.cat(parts, dim=-1).unsqueeze(2)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the token's angles, in float32 (diffusers' complex product)."""
    cos, sin = rope
    re, im = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2).type_as(x)


class TimestepEmbedder(nn.Module):
    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, cfg.time_mid_dim), nn.SiLU(), nn.Linear(cfg.time_mid_dim, cfg.time_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_sinusoid(t).to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden_size, cfg.patch_size ** 2 * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.time_dim, cfg.hidden_size))

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.adaLN_modulation(temb).unsqueeze(1)
        return self.linear(F.layer_norm(h, (h.shape[-1],), eps=1e-6) * scale)


class ZImageTransformer(nn.Module):
    """The Z-Image DiT (text to image): ``embed`` (patches, caption, both refiners) -> blocks -> ``unembed``."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.config = cfg
        h, p = cfg.hidden_size, cfg.patch_size
        self.all_x_embedder = nn.ModuleDict({PATCH: nn.Linear(p * p * cfg.in_channels, h)})
        self.all_final_layer = nn.ModuleDict({PATCH: FinalLayer(cfg)})
        self.noise_refiner = nn.ModuleList([ZImageBlock(cfg) for _ in range(cfg.num_refiner_layers)])
        self.context_refiner = nn.ModuleList([ZImageBlock(cfg, modulated=False)
                                              for _ in range(cfg.num_refiner_layers)])
        self.t_embedder = TimestepEmbedder(cfg)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.text_in_dim, cfg.eps), nn.Linear(cfg.text_in_dim, h))
        self.x_pad_token = nn.Parameter(torch.zeros(1, h))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, h))
        self.layers = nn.ModuleList([ZImageBlock(cfg) for _ in range(cfg.num_layers)])
        self.attention = sdpa
        # Replaceable by wrappers (cache, offload, parallel): (model, h, ctx) -> h.
        self.block_runner: Callable = run_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.all_x_embedder[PATCH].weight.dtype

    def embed(self, hidden_states, timestep, text_bth, text_lens):
        cfg, dtype = self.config, self.dtype
        b, c, height, width = hidden_states.shape
        if height % 2 or width % 2:
            raise ValueError(f"a Z-Image latent needs an even height and width (got {height}x{width} cells: 2x2 cells "
                             "make a token); make pictures whose sides are multiples of 16 pixels")
        gh, gw = height // cfg.patch_size, width // cfg.patch_size
        n_img, t_max = gh * gw, text_bth.shape[1]
        n_img_run, t_run = round_up(n_img), round_up(t_max)
        limits = cfg.rope_axes_len  # the positions the release's RoPE tables hold (diffusers fails past them)
        if t_run + 1 >= limits[0] or gh > limits[1] or gw > limits[2]:
            raise ValueError(f"Z-Image's positions end at {limits[0] - 2} caption tokens and a {limits[1]}x{limits[2]} "
                             f"token grid (got {t_max} tokens, {gh}x{gw}); shorten the prompt or the picture")
        device = hidden_states.device

        # the lengths are read where they are given: on the host for the engine's calls (no device sync per forward)
        lens_given = torch.as_tensor(text_lens).reshape(-1).long().expand(b)
        caption_runs = (lens_given + SEQUENCE_MULTIPLE - 1) // SEQUENCE_MULTIPLE * SEQUENCE_MULTIPLE
        padded = bool((caption_runs < t_run).any())
        lens, runs = lens_given.to(device), caption_runs.to(device)
        timestep = torch.as_tensor(timestep, device=device).reshape(-1).expand(b)
        # the engine's timestep is 1000 x sigma; Z-Image's t is 1 - sigma, scaled by t_scale
        temb = self.t_embedder((1 - timestep.float() / 1000) * cfg.t_scale).to(dtype)

        patches = hidden_states.to(dtype).view(b, c, gh, 2, gw, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, n_img, 4 * c)
        img = self.all_x_embedder[PATCH](patches)
        img = torch.cat([img, self.x_pad_token.to(dtype).expand(b, n_img_run - n_img, -1)], dim=1)
        txt = self.cap_embedder(F.pad(text_bth.to(dtype), (0, 0, 0, t_run - t_max)))
        j = torch.arange(t_run, device=device)[None, :, None]
        txt = torch.where(j < lens[:, None, None], txt, self.cap_pad_token.to(dtype))

        pos_img = torch.zeros(b, n_img_run, 3, dtype=torch.long, device=device)  # the pad tokens at (0, 0, 0)
        yy, xx = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
        pos_img[:, :n_img, 0] = runs[:, None] + 1
        pos_img[:, :n_img, 1], pos_img[:, :n_img, 2] = yy.reshape(-1), xx.reshape(-1)
        pos_txt = torch.zeros(b, t_run, 3, dtype=torch.long, device=device)
        pos_txt[..., 0] = torch.arange(1, t_run + 1, device=device)
        rope_img = rope_tables(pos_img, cfg.rope_axes_dim, cfg.rope_theta)
        rope_txt = rope_tables(pos_txt, cfg.rope_axes_dim, cfg.rope_theta)

        key_mask = key_mask_host = txt_mask = None
        if padded:  # made where the lengths are, then copied (from the host: no read of a device value)
            where = caption_runs.device
            mask = torch.ones(b, n_img_run + t_run, dtype=torch.bool, device=where)
            mask[:, n_img_run:] = torch.arange(t_run, device=where)[None] < caption_runs[:, None]
            key_mask, txt_mask = mask.to(device), mask[:, n_img_run:].to(device)
            key_mask_host = mask if where.type == "cpu" else None
        grid = (gh, gw)
        img_ctx = ZImageContext(temb, rope_img, None, self.attention, n_img, grid)
        for block in self.noise_refiner:
            img = block(img, img_ctx)
        txt_ctx = replace(img_ctx, rope=rope_txt, key_mask=txt_mask)
        for block in self.context_refiner:
            txt = block(txt, txt_ctx)
        rope = tuple(torch.cat([a, t], dim=1) for a, t in zip(rope_img, rope_txt))
        ctx = ZImageContext(temb, rope, key_mask, self.attention, n_img, grid, key_mask_host=key_mask_host)
        return torch.cat([img, txt], dim=1), ctx

    def unembed(self, h: torch.Tensor, ctx: ZImageContext) -> torch.Tensor:
        cfg = self.config
        out = self.all_final_layer[PATCH](h[:, : ctx.num_image_tokens], ctx.temb)
        b, (gh, gw) = out.shape[0], ctx.grid
        out = out.view(b, gh, gw, 2, 2, cfg.out_channels).permute(0, 5, 1, 3, 2, 4)
        return -out.reshape(b, cfg.out_channels, gh * 2, gw * 2)  # the velocity: Z-Image predicts its negation

    def forward(self, hidden_states, timestep, text_bth, text_lens):
        h, ctx = self.embed(hidden_states, timestep, text_bth, text_lens)
        h = self.block_runner(self, h, ctx)
        return self.unembed(h, ctx)


# -- what the generic layers know of Z-Image (engine/models/family.py) ------------------------------------------
def activation_bytes(cfg: ZImageConfig, x_shape: Sequence[int], text_tokens: int, dtype: torch.dtype) -> int:
    """A forward's device bytes besides the weights at its peak, inside a block's SwiGLU: per token row the residual
    stream, the normed input and the modulated copy (3 x hidden), w1 and w3's outputs, SiLU and the product (4 x
    ffn), and one ffn width more for per-format temporaries; RoPE's float32 tables beside them."""
    rows, _, height, width = x_shape
    tokens = round_up((height // cfg.patch_size) * (width // cfg.patch_size)) + round_up(int(text_tokens))
    itemsize = torch.empty(0, dtype=dtype, device="meta").element_size()
    return int(rows) * tokens * ((3 * cfg.hidden_size + 5 * cfg.ffn_hidden_size) * itemsize + 4 * cfg.head_dim)


def join_contexts(contexts: Sequence[ZImageContext], length: int, attention: Callable) -> ZImageContext:
    """One context for several jobs' rows, in order, each padded to ``length`` tokens; ``attention`` (the served
    batch's grouped attention) holds each job's own key mask."""
    first = contexts[0]
    rope = tuple(torch.cat([F.pad(c.rope[j], (0, 0, 0, 0, 0, length - c.rope[j].shape[1])) for c in contexts])
                 for j in range(2))
    return ZImageContext(torch.cat([c.temb for c in contexts]), rope, None, attention, first.num_image_tokens,
                         first.grid)


FAMILY = register(Family(
    name=ARCHITECTURE, title="Z-Image",
    config_class=ZImageConfig, model_class=ZImageTransformer, context_class=ZImageContext,
    signature_keys=SIGNATURE_KEYS, blocks="layers",
    block_linears=("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                   "attention.qkv", "feed_forward.w13"),  # the last two: fused by engine/features/fuse.py
    shard_dims={"attention.to_q": 0, "attention.to_k": 0, "attention.to_v": 0, "feed_forward.w1": 0,
                "feed_forward.w3": 0, "attention.to_out.0": 1, "feed_forward.w2": 1},
    partial_sum_modules=("attention", "feed_forward"), heads_module="attention",
    fuse_groups={Attention: ("qkv", ("to_q", "to_k", "to_v")), FeedForward: ("w13", ("w1", "w3"))},
    latent=Latent(channels=16, stride=8, name="the Flux latent (16 channels)", comfy_format="Flux",
                  makers="EmptySD3LatentImage", cells_per_token=2, scale=0.3611, shift=0.1159),
    join_contexts=join_contexts, chunk_context=chunk_rope_context, activation_bytes=activation_bytes,
    config_metadata_key="z_image_config",
    checkpoint_prefixes=("model.diffusion_model.", "diffusion_model.", "transformer."), layouts=(ORIGINAL_LAYOUT,),
    diffusers_class="ZImageTransformer2DModel", comfy_model="ZImage", max_layers=MAX_LAYERS,
    comfy_unet_config={"image_model": "lumina2"},
    sampling_defaults={"turbo": {"steps": 9, "cfg": 1.0}},  # ComfyUI's Z-Image-Turbo template and diffusers' example
    sizes=((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344)),
    compute_dtypes=(torch.bfloat16, torch.float32),
    companions=Companions(QwenTextEncoder, FluxVAE, default_size=1024, pipeline_class="ZImagePipeline",
                          guidance_offset=1.0, dynamic_shift=True),
    block_lists=("noise_refiner", "context_refiner", "layers"),
))
