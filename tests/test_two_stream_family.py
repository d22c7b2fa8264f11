"""A family whose blocks take two streams (issue 47 item 3): a toy MMDiT, each block ``block(text, image, ctx) ->
(text, image)`` with its own weights per stream and one joint attention (Qwen-Image's and Flux's double blocks),
declared with ``Family.block_patterns`` and run by the engine's block loop (``run_blocks``; its model has no loop
of its own) through the features that run blocks: Cache-DiT, a quantized format, layer-wise offload, served
batching of jobs with different text lengths, and Ulysses sequence parallel on two gloo ranks (a rank's chunk
holds image tokens, text tokens or both). Each against the blocks called as the toy writes them, in float32."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from test_second_family import (
    ToyConfig,
    ToyDiT,
    _close,
    _sample,
    assert_served_jobs_equal_solo_runs,
    registered,
)
from torch import nn

from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.models import Family, Latent, register
from engine.models.family import TWO_STREAMS, run_blocks

NAME = "toy-mmdit"
HEAD_DIM = 8


@dataclass(frozen=True)
class MMConfig(ToyConfig):
    """The toy's shapes, read from the MMDiT's own keys."""

    @classmethod
    def from_shapes(cls, shapes, overrides=None, source: str = "config") -> "MMConfig":
        blocks = {int(k.split(".")[1]) for k in shapes if k.startswith("joint.")}
        if blocks != set(range(len(blocks))) or len(blocks) > 64:
            raise ValueError(f"block numbers must run from 0 without gaps (got {sorted(blocks)[:8]})")
        hidden, in_channels = shapes["patchify.weight"]
        return cls(hidden_size=hidden, num_layers=len(blocks), num_attention_heads=hidden // HEAD_DIM,
                   ffn_hidden_size=shapes["joint.0.img.w1.weight"][0], in_channels=in_channels,
                   out_channels=shapes["head.weight"][0], text_in_dim=shapes["txt_in.weight"][1])


@dataclass
class MMContext:
    scale: torch.Tensor  # [B, 1, H] from the time embedding
    key_mask: Optional[torch.Tensor]  # [B, S] over image then text tokens
    attention: Callable
    image_tokens: int  # h's first tokens that are the image stream (in this chunk, under sequence parallel)
    grid: tuple
    valid_tokens: Optional[int] = None


def join_contexts(contexts: Sequence[MMContext], length: int, attention: Callable) -> MMContext:
    first = contexts[0]  # one latent size: the image stream has the same tokens in every job
    return MMContext(torch.cat([c.scale for c in contexts]), None, attention, first.image_tokens, first.grid)


def chunk_context(ctx: MMContext, pad: int, chunk: slice, attention: Callable, valid_tokens: int) -> MMContext:
    image = max(0, min(chunk.stop, ctx.image_tokens) - chunk.start)
    return replace(ctx, key_mask=None, attention=attention, valid_tokens=valid_tokens, image_tokens=image)


class Stream(nn.Module):
    """One stream's weights in a joint block."""

    def __init__(self, cfg: MMConfig):
        super().__init__()
        h = cfg.hidden_size
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(h, cfg.ffn_hidden_size), nn.Linear(cfg.ffn_hidden_size, h)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],))


class JointBlock(nn.Module):
    def __init__(self, cfg: MMConfig):
        super().__init__()
        self.img, self.txt = Stream(cfg), Stream(cfg)
        self.heads = cfg.num_attention_heads

    def forward(self, text, image, ctx: MMContext):
        b, n_img = image.shape[0], image.shape[1]
        streams = ((self.img, _norm(image) * ctx.scale), (self.txt, _norm(text) * ctx.scale))

        def joint(name):  # the streams' projections, one sequence in h's order (image, then text)
            return torch.cat([getattr(s, name)(x).view(b, x.shape[1], self.heads, HEAD_DIM) for s, x in streams], 1)

        out = ctx.attention(joint("wq"), joint("wk"), joint("wv"), ctx.key_mask).reshape(b, -1, self.heads * HEAD_DIM)
        image = image + self.img.wo(out[:, :n_img])
        text = text + self.txt.wo(out[:, n_img:])
        image = image + self.img.w2(F.gelu(self.img.w1(_norm(image))))
        return text + self.txt.w2(F.gelu(self.txt.w1(_norm(text)))), image


class MMDiT(ToyDiT):
    """The toy DiT's embedding and head around two-stream blocks, run by the engine's loop (``run_blocks``: it calls
    each block by the family's declared pattern)."""

    def __init__(self, cfg: MMConfig):
        super().__init__(cfg, blocks=("joint", JointBlock))
        self.block_runner = run_blocks

    def embed(self, x, timestep, text, text_lens):
        h, ctx = super().embed(x, timestep, text, text_lens)
        return h, MMContext(ctx.scale, ctx.key_mask, self.attention, ctx.image_tokens, ctx.grid)

    def reference(self, x, timestep, text, text_lens):
        """The blocks called as this model writes them (two streams through the list), no engine loop."""
        h, ctx = self.embed(x, timestep, text, text_lens)
        image, text = h[:, :ctx.image_tokens], h[:, ctx.image_tokens:]
        for block in self.joint:
            text, image = block(text, image, ctx)
        return self.unembed(torch.cat([image, text], dim=1), ctx)


MM = Family(
    name=NAME, title="Toy-MMDiT", config_class=MMConfig, model_class=MMDiT, context_class=MMContext,
    signature_keys=("joint.0.img.wq.weight", "patchify.weight"), blocks="joint", block_patterns={"joint": TWO_STREAMS},
    block_linears=tuple(f"{s}.{w}" for s in ("img", "txt") for w in ("wq", "wk", "wv", "wo", "w1", "w2")),
    shard_dims={}, partial_sum_modules=(), heads_module="", fuse_groups={},
    latent=Latent(channels=4, stride=8, name="the toy latent"),
    join_contexts=join_contexts, chunk_context=chunk_context, max_layers=64,
    activation_bytes=lambda cfg, x_shape, text_tokens, dtype: (
        x_shape[0] * (x_shape[2] * x_shape[3] + text_tokens) * (2 * cfg.hidden_size + 2 * cfg.ffn_hidden_size) * 4),
)
CFG = MMConfig()


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    yield from registered(tmp_path_factory, MM, MMDiT, CFG)  # 30 image tokens, 7 or 4 text tokens


def test_the_engines_loop_runs_two_stream_blocks_as_written(mm):
    eng = mm["engine"]
    assert type(eng.model) is MMDiT and eng.model_config == CFG
    g = torch.Generator().manual_seed(2)
    x, text = torch.randn(2, 4, 5, 6, generator=g), torch.randn(2, 7, CFG.text_in_dim, generator=g)
    t, lens = torch.tensor([500.0]), torch.tensor([7, 5])  # the second row's text padded: its key mask
    with torch.inference_mode():
        torch.testing.assert_close(eng.dit_forward(x, t, text, lens), mm["model"].reference(x, t, text, lens),
                                   rtol=1e-5, atol=1e-5)
    assert mm["ref"].shape == (1, 4, 5, 6) and torch.isfinite(mm["ref"]).all()


def test_an_unknown_pattern_or_list_is_refused_by_name():
    with pytest.raises(ValueError, match="toy-mmdit.*'three_streams'.*single, two_streams"):
        register(replace(MM, block_patterns={"joint": "three_streams"}))
    with pytest.raises(ValueError, match="toy-mmdit.*'refiner'.*joint"):
        register(replace(MM, block_patterns={"refiner": TWO_STREAMS}))


def test_cache_dit_offload_and_a_quantized_format(mm):
    eng = mm["engine"]
    assert torch.equal(_sample(eng, mm["inputs"], CacheConfig(warmup=1, rdt=0.0)), mm["ref"])  # every step computed
    out = _sample(eng, mm["inputs"], CacheConfig(warmup=1, rdt=0.3))
    stats = eng.last_run.to_dict()
    assert stats["calls_computed"] < stats["model_calls"] and stats["step_mask"][0] == "x", stats
    assert torch.isfinite(out).all() and not torch.equal(out, mm["ref"])
    offloaded = open_engine(mm["path"], EngineConfig(offload="layerwise", resident_layers=2))
    assert offloaded.describe()["offload"]["blocks"] == CFG.num_layers
    assert torch.equal(_sample(offloaded, mm["inputs"], CacheConfig(enabled=False)), mm["ref"])
    # the loop's iteration of the two-stream list announced its blocks: each was prefetched but the very first
    assert offloaded.offload.stalls == 1 and offloaded.offload.transfers > CFG.num_layers
    quantized = open_engine(mm["path"], EngineConfig(quant="int8-weight"))
    out = _sample(quantized, mm["inputs"], CacheConfig(enabled=False))
    assert _close(out, mm["ref"], 5e-2) and not torch.equal(out, mm["ref"])


def test_served_jobs_with_different_text_lengths_equal_their_solo_runs(mm):
    """Text padded at the end of h, after the image stream, one job with its own Cache-DiT."""
    g = torch.Generator().manual_seed(9)
    assert_served_jobs_equal_solo_runs(mm["engine"], torch.zeros(4, 5, 6),
                                       [torch.randn(tokens, CFG.text_in_dim, generator=g) for tokens in (3, 9)],
                                       mm["inputs"]["uncond"][0], CacheConfig(warmup=1, rdt=0.3))


@pytest.mark.subprocess
def test_ulysses_on_two_gloo_ranks(mm):
    """37 tokens in chunks of 19: rank 0 holds image tokens only, rank 1 the last 11 image tokens and the text (the
    family's chunk_context says how many are the image's)."""
    import engine.parallel.pool as pool_mod

    saved = pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S
    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = 120.0, 60.0, 60.0
    eng = None
    try:
        eng = open_engine(mm["path"], EngineConfig(ulysses_degree=2))
        assert eng.runner.plan.world_size == 2
        out = _sample(eng, mm["inputs"], CacheConfig(enabled=False))
        assert _close(out, mm["ref"], 1e-4), (out - mm["ref"]).abs().max()
    finally:
        if eng is not None:
            eng.release()
        pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = saved


# -- a loop over two lists (Flux: its double-stream blocks, then its single-stream blocks over the joined sequence) --
class SingleBlock(Stream):
    """A single-stream block over h (image then text tokens): one stream's weights."""

    def __init__(self, cfg: ToyConfig):
        super().__init__(cfg)
        self.heads = cfg.num_attention_heads

    def forward(self, h, ctx: MMContext):
        b, s, _ = h.shape
        x = _norm(h) * ctx.scale
        q, k, v = (lin(x).view(b, s, self.heads, HEAD_DIM) for lin in (self.wq, self.wk, self.wv))
        h = h + self.wo(ctx.attention(q, k, v, ctx.key_mask).reshape(b, s, -1))
        return h + self.w2(F.gelu(self.w1(_norm(h))))


@dataclass(frozen=True)
class FluxConfig(ToyConfig):
    """``num_layers`` counts the loop's blocks: 3 double, then ``single_layers`` single."""

    num_layers: int = 5
    single_layers: int = 2

    @classmethod
    def from_shapes(cls, shapes, overrides=None, source: str = "config") -> "FluxConfig":
        dual, single = ({int(k.split(".")[1]) for k in shapes if k.startswith(p)} for p in ("dual.", "single."))
        hidden, in_channels = shapes["patchify.weight"]
        return cls(hidden_size=hidden, num_layers=len(dual) + len(single), single_layers=len(single),
                   num_attention_heads=hidden // HEAD_DIM, ffn_hidden_size=shapes["single.0.w1.weight"][0],
                   in_channels=in_channels, out_channels=shapes["head.weight"][0], text_in_dim=shapes["txt_in.weight"][1])


class FluxDiT(MMDiT):
    def __init__(self, cfg: FluxConfig):
        ToyDiT.__init__(self, cfg, blocks=("dual", JointBlock))
        self.dual = nn.ModuleList(list(self.dual)[:cfg.num_layers - cfg.single_layers])
        self.single = nn.ModuleList([SingleBlock(cfg) for _ in range(cfg.single_layers)])
        self.block_runner = run_blocks

    def reference(self, x, timestep, text, text_lens):
        """Both lists called as this model writes them, no engine loop."""
        h, ctx = self.embed(x, timestep, text, text_lens)
        image, text = h[:, :ctx.image_tokens], h[:, ctx.image_tokens:]
        for block in self.dual:
            text, image = block(text, image, ctx)
        h = torch.cat([image, text], dim=1)
        for block in self.single:
            h = block(h, ctx)
        return self.unembed(h, ctx)


FLUX = replace(MM, name="toy-flux", title="Toy-Flux", config_class=FluxConfig, model_class=FluxDiT,
               signature_keys=("dual.0.img.wq.weight", "single.0.wq.weight"), blocks="dual",
               block_lists=("dual", "single"), loop_lists=("dual", "single"), block_patterns={"dual": TWO_STREAMS},
               block_linears=MM.block_linears + ("wq", "wk", "wv", "wo", "w1", "w2"))


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    yield from registered(tmp_path_factory, FLUX, FluxDiT, FluxConfig())


def test_a_loop_over_two_lists_runs_them_as_written_through_cache_and_offload(flux):
    """Cache-DiT's middle (fn 2, bn 1) crosses from the double blocks into the single ones; offload streams both
    lists and prefetches the single list's first block at the double list's end."""
    eng, cfg = flux["engine"], FluxConfig()
    g = torch.Generator().manual_seed(2)
    x, text = torch.randn(2, 4, 5, 6, generator=g), torch.randn(2, 7, cfg.text_in_dim, generator=g)
    t, lens = torch.tensor([500.0]), torch.tensor([7, 5])
    with torch.inference_mode():
        torch.testing.assert_close(eng.dit_forward(x, t, text, lens), flux["model"].reference(x, t, text, lens),
                                   rtol=1e-5, atol=1e-5)
    cache = dict(fn=2, bn=1, warmup=1, taylorseer=False)
    assert torch.equal(_sample(eng, flux["inputs"], CacheConfig(rdt=0.0, **cache)), flux["ref"])
    cached = _sample(eng, flux["inputs"], CacheConfig(rdt=0.3, **cache))
    mask = eng.last_run.step_mask
    assert not all(mask) and torch.isfinite(cached).all()
    offloaded = open_engine(flux["path"], EngineConfig(offload="layerwise", resident_layers=2))
    assert offloaded.describe()["offload"]["blocks"] == cfg.num_layers
    assert torch.equal(_sample(offloaded, flux["inputs"], CacheConfig(enabled=False)), flux["ref"])
    assert offloaded.offload.stalls == 1  # every block prefetched but the very first, across the lists' boundary
    assert torch.equal(_sample(offloaded, flux["inputs"], CacheConfig(rdt=0.3, **cache)), cached)
    assert offloaded.last_run.step_mask == mask


def test_a_loop_list_out_of_place_is_refused_by_name():
    with pytest.raises(ValueError, match="toy-flux: loop_lists single, dual: .*'dual' .* first"):
        register(replace(FLUX, loop_lists=("single", "dual")))
