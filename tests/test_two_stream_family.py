"""A family whose blocks take two streams (issue 47 item 3): a toy MMDiT, each block ``block(text, image, ctx) ->
(text, image)`` with its own weights per stream and one joint attention (Qwen-Image's and Flux's double blocks),
declared with ``Family.block_patterns`` and run by the engine's block loop (``run_blocks``; its model has no loop
of its own) through the features that run blocks: Cache-DiT, a quantized format, layer-wise offload, served
batching of jobs with different text lengths, and Ulysses sequence parallel on two gloo ranks (a rank's chunk
holds image tokens, text tokens or both). Each against the blocks called as the toy writes them, in float32."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.inputs import empty_latent_shape
from engine.models import Family, Latent, register, unregister
from engine.models.family import TWO_STREAMS, run_blocks, sdpa

NAME = "toy-mmdit"
TIME_DIM = 16
HEAD_DIM = 8


@dataclass(frozen=True)
class MMConfig:
    hidden_size: int = 32
    num_layers: int = 3
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64
    in_channels: int = 4
    out_channels: int = 4
    text_in_dim: int = 24
    patch_size: int = 1

    @property
    def head_dim(self) -> int:
        return HEAD_DIM

    def to_dict(self) -> dict:
        return asdict(self)

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


def _sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float32, device=t.device) / (dim // 2))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class MMDiT(nn.Module):
    def __init__(self, cfg: MMConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.patchify = nn.Linear(cfg.in_channels, h)
        self.txt_in = nn.Linear(cfg.text_in_dim, h, bias=False)
        self.time_in = nn.Linear(TIME_DIM, h)
        self.joint = nn.ModuleList([JointBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = nn.Linear(h, cfg.out_channels)
        self.attention = sdpa
        self.block_runner = run_blocks  # the engine's loop: it calls each block by the family's declared pattern

    @property
    def dtype(self):
        return self.head.weight.dtype

    def embed(self, x, timestep, text, text_lens):
        b, _, gh, gw = x.shape
        n_img = gh * gw
        img = self.patchify(x.to(self.dtype).flatten(2).transpose(1, 2))
        img = img + _sinusoid(torch.arange(n_img, device=img.device), img.shape[-1]).to(img.dtype)
        txt = self.txt_in(text.to(self.dtype))
        h = torch.cat([img, txt], dim=1)
        lens = torch.as_tensor(text_lens, device=h.device).reshape(-1).long().expand(b)
        timestep = torch.as_tensor(timestep, device=h.device).reshape(-1).expand(b)
        scale = 1 + torch.tanh(self.time_in(_sinusoid(timestep, TIME_DIM).to(h.dtype))).unsqueeze(1)
        key_mask = None
        if bool((lens < txt.shape[1]).any()):
            key_mask = torch.ones(b, h.shape[1], dtype=torch.bool, device=h.device)
            key_mask[:, n_img:] = torch.arange(txt.shape[1], device=h.device)[None] < lens[:, None]
        return h, MMContext(scale, key_mask, self.attention, n_img, (gh, gw))

    def unembed(self, h, ctx: MMContext):
        out = self.head(_norm(h[:, :ctx.image_tokens]))
        gh, gw = ctx.grid
        return out.transpose(1, 2).reshape(out.shape[0], -1, gh, gw)

    def forward(self, x, timestep, text, text_lens):
        h, ctx = self.embed(x, timestep, text, text_lens)
        return self.unembed(self.block_runner(self, h, ctx), ctx)

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
    """The toy MMDiT registered, its checkpoint written (random weights), the inputs and the plain run."""
    register(MM)
    try:
        folder = tmp_path_factory.mktemp("mm")
        torch.manual_seed(0)
        model = MMDiT(CFG)
        path = str(folder / "mm.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        g = torch.Generator().manual_seed(1)
        inputs = dict(latent=torch.zeros(empty_latent_shape(MM, 48, 40, 1)),  # 30 image tokens, 7 or 4 text tokens
                      cond=[torch.randn(7, CFG.text_in_dim, generator=g)],
                      uncond=[torch.randn(4, CFG.text_in_dim, generator=g)])
        plain = open_engine(path, EngineConfig())
        ref = _sample(plain, inputs, CacheConfig(enabled=False))
        yield dict(path=path, inputs=inputs, ref=ref, engine=plain, model=model)
    finally:
        from engine.parallel import shutdown_pools

        shutdown_pools()
        unregister(NAME)


def _sample(eng, inputs, cache, steps=6):
    with torch.inference_mode():
        return eng.sample(inputs["latent"], inputs["cond"], inputs["uncond"], seed=3, steps=steps, cfg=3.0, cache=cache)


def _close(out, ref, tol):
    return (out - ref).abs().max().item() <= tol * ref.abs().max().item()


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
    offloaded = open_engine(mm["path"], EngineConfig(offload="layerwise", resident_layers=1))
    assert offloaded.describe()["offload"]["blocks"] == CFG.num_layers
    assert torch.equal(_sample(offloaded, mm["inputs"], CacheConfig(enabled=False)), mm["ref"])
    quantized = open_engine(mm["path"], EngineConfig(quant="int8-weight"))
    out = _sample(quantized, mm["inputs"], CacheConfig(enabled=False))
    assert _close(out, mm["ref"], 5e-2) and not torch.equal(out, mm["ref"])


def test_served_jobs_with_different_text_lengths_equal_their_solo_runs(mm):
    """The server's batcher joins two jobs' rows in every step (text padded at the end of h, after the image stream),
    one with its own Cache-DiT: each equals its run alone."""
    from engine.serve.batcher import Batcher, Job

    eng = mm["engine"]
    g = torch.Generator().manual_seed(9)
    jobs = [Job(latent=torch.zeros(4, 5, 6), cond=torch.randn(tokens, CFG.text_in_dim, generator=g),
                uncond=mm["inputs"]["uncond"][0], seed=10 + i, steps=6, cfg=3.0, cache=cache)
            for i, (tokens, cache) in enumerate(((3, CacheConfig(warmup=1, rdt=0.3)), (9, CacheConfig(enabled=False))))]
    batcher = Batcher(eng, max_batch=4)
    try:
        with torch.inference_mode():
            got = [f.result(60) for f in batcher.submit_many(jobs)]
            refs = [eng.sample(j.latent[None], [j.cond], [j.uncond], seed=j.seed, steps=j.steps, cfg=j.cfg,
                               cache=j.cache)[0] for j in jobs]
    finally:
        batcher.close()
    assert False in jobs[0].stats.step_mask and all(jobs[1].stats.step_mask)
    for out, ref in zip(got, refs):
        assert _close(out, ref, 1e-5), (out - ref).abs().max()


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
