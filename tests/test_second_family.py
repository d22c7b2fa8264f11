"""The seam of engine/models/family.py: a second DiT family, declared entirely in this module (its own config read
from its own key names, blocks under ``stages``, linears ``attn.wq/wk/wv/wo`` and ``ffn.w1/w2``, a 4-channel
latent of stride 8, its own block context and join / chunk functions), registered with ``engine.models.register``
and run through the engine's public entry points without touching engine code: load -> sample -> Cache-DiT ->
a quantized format -> layer-wise offload -> LoRA -> served batching -> two gloo ranks (sequence and tensor parallel).
Each stage asserts behaviour against the plain run of the same file."""
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
from engine.models.family import sdpa

NAME = "toy-dit"
TIME_DIM = 16


@dataclass(frozen=True)
class ToyConfig:
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
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_shapes(cls, shapes, overrides=None, source: str = "config") -> "ToyConfig":
        def shape(key):
            if key not in shapes:
                raise ValueError(f"tensor '{key}' is missing")
            return tuple(shapes[key])

        stages = {int(k.split(".")[1]) for k in shapes if k.startswith("stages.")}
        if stages != set(range(len(stages))) or len(stages) > 64:
            raise ValueError(f"stage numbers must run from 0 without gaps (got {sorted(stages)[:8]})")
        hidden, in_channels = shape("patchify.weight")
        (head_dim,) = shape("stages.0.attn.q_norm.weight")
        return cls(hidden_size=hidden, num_layers=len(stages), num_attention_heads=hidden // head_dim,
                   ffn_hidden_size=shape("stages.0.ffn.w1.weight")[0], in_channels=in_channels,
                   out_channels=shape("head.weight")[0], text_in_dim=shape("txt_in.weight")[1])


@dataclass
class ToyContext:
    scale: torch.Tensor  # [B, 1, H] from the time embedding
    gate: torch.Tensor  # [B, S, 1] per token: 1 for image tokens, 0.5 for text tokens
    key_mask: Optional[torch.Tensor]
    attention: Callable
    image_tokens: int
    grid: tuple
    valid_tokens: Optional[int] = None


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, length - t.shape[1]))


def join_contexts(contexts: Sequence[ToyContext], length: int, attention: Callable) -> ToyContext:
    first = contexts[0]
    return ToyContext(torch.cat([c.scale for c in contexts]), torch.cat([_pad(c.gate, length) for c in contexts]),
                      None, attention, first.image_tokens, first.grid)


def chunk_context(ctx: ToyContext, pad: int, chunk: slice, attention: Callable, valid_tokens: int) -> ToyContext:
    gate = F.pad(ctx.gate, (0, 0, 0, pad))[:, chunk]
    return replace(ctx, gate=gate, key_mask=None, attention=attention, valid_tokens=valid_tokens)


class QNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class ToyAttention(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.q_norm = QNorm(cfg.head_dim)

    def forward(self, x, ctx: ToyContext):
        b, s, _ = x.shape
        if "wqkv" in self._modules:  # the engine's fusion of the family's fuse group
            q, k, v = self.wqkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        else:
            q, k, v = (lin(x).view(b, s, self.heads, -1) for lin in (self.wq, self.wk, self.wv))
        out = ctx.attention(self.q_norm(q), k, v, ctx.key_mask)
        return self.wo(out.reshape(b, s, -1))


class ToyFFN(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class ToyStage(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.attn = ToyAttention(cfg)
        self.ffn = ToyFFN(cfg)

    def forward(self, h, ctx: ToyContext):
        h = h + ctx.gate * self.attn(F.layer_norm(h, (h.shape[-1],)) * ctx.scale, ctx)
        return h + self.ffn(F.layer_norm(h, (h.shape[-1],)))


def _sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float32, device=t.device) / (dim // 2))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def run_stages(model, h, ctx):
    for stage in model.stages:
        h = stage(h, ctx)
    return h


class ToyDiT(nn.Module):
    def __init__(self, cfg: ToyConfig, blocks=("stages", ToyStage)):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.patchify = nn.Linear(cfg.in_channels, h)
        self.txt_in = nn.Linear(cfg.text_in_dim, h, bias=False)
        self.time_in = nn.Linear(TIME_DIM, h)
        name, block = blocks  # (attribute, block class): tests/test_two_stream_family.py's MMDiT has its own
        setattr(self, name, nn.ModuleList([block(cfg) for _ in range(cfg.num_layers)]))
        self.head = nn.Linear(h, cfg.out_channels)
        self.attention = sdpa
        self.block_runner = run_stages

    @property
    def dtype(self):
        return self.head.weight.dtype

    def embed(self, x, timestep, text, text_lens):
        b, _, gh, gw = x.shape
        n_img = gh * gw
        img = self.patchify(x.to(self.dtype).flatten(2).transpose(1, 2))
        img = img + _sinusoid(torch.arange(n_img, device=img.device), img.shape[-1]).to(img.dtype)
        txt = self.txt_in(text.to(self.dtype))
        t_max = txt.shape[1]
        h = torch.cat([img, txt], dim=1)
        lens = torch.as_tensor(text_lens, device=h.device).reshape(-1).long().expand(b)
        timestep = torch.as_tensor(timestep, device=h.device).reshape(-1).expand(b)
        scale = 1 + torch.tanh(self.time_in(_sinusoid(timestep, TIME_DIM).to(h.dtype))).unsqueeze(1)
        gate = torch.cat([h.new_ones(b, n_img, 1), h.new_full((b, t_max, 1), 0.5)], dim=1)
        key_mask = None
        if bool((lens < t_max).any()):
            key_mask = torch.ones(b, n_img + t_max, dtype=torch.bool, device=h.device)
            key_mask[:, n_img:] = torch.arange(t_max, device=h.device)[None] < lens[:, None]
        return h, ToyContext(scale, gate, key_mask, self.attention, n_img, (gh, gw))

    def unembed(self, h, ctx: ToyContext):
        out = self.head(F.layer_norm(h[:, :ctx.image_tokens], (h.shape[-1],)))
        gh, gw = ctx.grid
        return out.transpose(1, 2).reshape(out.shape[0], -1, gh, gw)

    def forward(self, x, timestep, text, text_lens):
        h, ctx = self.embed(x, timestep, text, text_lens)
        return self.unembed(self.block_runner(self, h, ctx), ctx)


TOY = Family(
    name=NAME, title="Toy-DiT", config_class=ToyConfig, model_class=ToyDiT, context_class=ToyContext,
    signature_keys=("stages.0.attn.wq.weight", "patchify.weight"), blocks="stages",
    block_linears=("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w2", "attn.wqkv"),
    shard_dims={"attn.wq": 0, "attn.wk": 0, "attn.wv": 0, "ffn.w1": 0, "attn.wo": 1, "ffn.w2": 1},
    partial_sum_modules=("attn", "ffn"), heads_module="attn",
    fuse_groups={ToyAttention: ("wqkv", ("wq", "wk", "wv"))},
    latent=Latent(channels=4, stride=8, name="the toy latent"),
    join_contexts=join_contexts, chunk_context=chunk_context, max_layers=64,
    # the residual, the FFN input, its hidden layer and its activation per token row
    activation_bytes=lambda cfg, x_shape, text_tokens, dtype: (
        x_shape[0] * (x_shape[2] * x_shape[3] + text_tokens) * (2 * cfg.hidden_size + 2 * cfg.ffn_hidden_size) * 4),
)
CFG = ToyConfig()
LORA_TARGETS = ("attn.wq", "attn.wo", "ffn.w1")
RANK = 2


def registered(tmp_path_factory, family, model_class, cfg):
    """A toy family registered, its checkpoint written (random weights), the inputs and the plain run (a module
    fixture's body: tests/test_two_stream_family.py makes its own family's with it)."""
    register(family)
    try:
        folder = tmp_path_factory.mktemp(family.name)
        torch.manual_seed(0)
        model = model_class(cfg)
        path = str(folder / f"{family.name}.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        g = torch.Generator().manual_seed(1)
        inputs = dict(latent=torch.zeros(empty_latent_shape(family, 48, 40, 1)),  # 6x5 cells: odd sequence with text
                      cond=[torch.randn(7, cfg.text_in_dim, generator=g)],
                      uncond=[torch.randn(4, cfg.text_in_dim, generator=g)])
        plain = open_engine(path, EngineConfig())
        ref = _sample(plain, inputs, CacheConfig(enabled=False))
        yield dict(path=path, folder=folder, inputs=inputs, ref=ref, engine=plain, model=model,
                   state=model.state_dict())
    finally:
        from engine.parallel import shutdown_pools

        shutdown_pools()
        unregister(family.name)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    yield from registered(tmp_path_factory, TOY, ToyDiT, CFG)


def _sample(eng, inputs, cache, steps=6):
    with torch.inference_mode():  # as ComfyUI runs a node
        return eng.sample(inputs["latent"], inputs["cond"], inputs["uncond"], seed=3, steps=steps, cfg=3.0, cache=cache)


def _close(out, ref, tol):
    return (out - ref).abs().max().item() <= tol * ref.abs().max().item()


def assert_served_jobs_equal_solo_runs(eng, latent, conds, uncond, cached):
    """The server's batcher joins two jobs of different text lengths (``conds``) in every step through the
    family's join_contexts, the first with ``cached`` (its own Cache-DiT: its rows skip the middle blocks when it
    reuses), the second uncached: each equals its run alone."""
    from engine.serve.batcher import Batcher, Job

    jobs = [Job(latent=latent, cond=cond, uncond=uncond, seed=10 + i, steps=6, cfg=3.0, cache=cache)
            for i, (cond, cache) in enumerate(zip(conds, (cached, CacheConfig(enabled=False))))]
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


def test_load_and_sample(toy):
    eng = toy["engine"]
    assert type(eng.model) is ToyDiT and eng.model_config == CFG  # the config read from the toy's own keys
    assert toy["ref"].shape == (1, 4, 5, 6) and torch.isfinite(toy["ref"]).all()
    assert empty_latent_shape(TOY, 64, 16, 2) == (2, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of 8 pixels"):
        empty_latent_shape(TOY, 60, 16, 1)
    # the forward is the toy's own: the loaded engine's DiT equals a ToyDiT with the file's weights
    ref_model = ToyDiT(CFG)
    ref_model.load_state_dict(toy["state"])
    x, t, text, lens = torch.randn(1, 4, 5, 6), torch.tensor([500.0]), toy["inputs"]["cond"][0][None], torch.tensor([7])
    torch.testing.assert_close(eng.dit_forward(x, t, text, lens), ref_model(x, t, text, lens), rtol=1e-5, atol=1e-5)


def test_cache_dit(toy):
    eng = toy["engine"]
    # a threshold of 0 computes every step: bit-equal to the plain run
    assert torch.equal(_sample(eng, toy["inputs"], CacheConfig(warmup=1, rdt=0.0)), toy["ref"])
    out = _sample(eng, toy["inputs"], CacheConfig(warmup=1, rdt=0.3))  # the residual's change decides
    stats = eng.last_run.to_dict()
    assert stats["calls_computed"] < stats["model_calls"] and stats["step_mask"][0] == "x", stats
    assert torch.isfinite(out).all() and not torch.equal(out, toy["ref"])


def test_quantized_format(toy):
    eng = open_engine(toy["path"], EngineConfig(quant="int8-weight"))
    assert eng.describe()["quant"] == "int8-weight"
    out = _sample(eng, toy["inputs"], CacheConfig(enabled=False))
    assert _close(out, toy["ref"], 5e-2) and not torch.equal(out, toy["ref"])


def test_layerwise_offload(toy):
    eng = open_engine(toy["path"], EngineConfig(offload="layerwise", resident_layers=1))
    assert eng.offload is not None and eng.describe()["offload"]["blocks"] == CFG.num_layers
    assert torch.equal(_sample(eng, toy["inputs"], CacheConfig(enabled=False)), toy["ref"])


def test_lora(toy):
    """A PEFT file for the toy's linears: merged exactly as W + B A (alpha = rank), removal restores bit-exactly."""
    g = torch.Generator().manual_seed(5)
    sd, merged = {}, dict(toy["state"])
    for i in range(CFG.num_layers):
        for target in LORA_TARGETS:
            w = toy["state"][f"stages.{i}.{target}.weight"]
            a, b = 0.1 * torch.randn(RANK, w.shape[1], generator=g), 0.1 * torch.randn(w.shape[0], RANK, generator=g)
            sd[f"base_model.model.stages.{i}.{target}.lora_A.weight"] = a
            sd[f"base_model.model.stages.{i}.{target}.lora_B.weight"] = b
            merged[f"stages.{i}.{target}.weight"] = w + b @ a
    path = str(toy["folder"] / "toy_lora.safetensors")
    save_file(sd, path)
    eng = toy["engine"]
    try:
        assert eng.set_loras([(path, 1.0)]) == [] and eng.lora_report == []
        out = _sample(eng, toy["inputs"], CacheConfig(enabled=False))
        ref_model = ToyDiT(CFG)
        ref_model.load_state_dict(merged)
        x, t, text, lens = torch.randn(1, 4, 5, 6), torch.tensor([700.0]), toy["inputs"]["cond"][0][None], torch.tensor([7])
        torch.testing.assert_close(eng.dit_forward(x, t, text, lens), ref_model(x, t, text, lens), rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, toy["ref"])
    finally:
        eng.set_loras([])
    assert torch.equal(_sample(eng, toy["inputs"], CacheConfig(enabled=False)), toy["ref"])


def test_served_batch_joins_the_toys_contexts(toy):
    """The server's joint forward (the family's join_contexts) over two jobs of different text lengths equals
    each job's own forward."""
    from engine.serve.forward import Call, joint_velocity

    model = toy["engine"].model
    g = torch.Generator().manual_seed(7)
    calls = []
    for tokens in (3, 9):
        text = torch.randn(2, tokens, CFG.text_in_dim, generator=g)
        calls.append(Call(torch.randn(2, 4, 5, 6, generator=g), torch.tensor([0.7, 0.7]), text,
                          torch.tensor([tokens, tokens - 1])))
    joint = joint_velocity(model, calls, torch.device("cpu"))
    for call, out in zip(calls, joint):
        alone = toy["engine"].velocity(call.x, call.sigma, call.text, call.lens)
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)


def test_served_jobs_with_their_own_caches_equal_their_solo_runs(toy):
    g = torch.Generator().manual_seed(9)
    assert_served_jobs_equal_solo_runs(toy["engine"], torch.zeros(4, 5, 6),
                                       [torch.randn(tokens, CFG.text_in_dim, generator=g) for tokens in (3, 9)],
                                       toy["inputs"]["uncond"][0], CacheConfig(warmup=1, rdt=0.3))


def test_a_rank_learns_the_family_from_its_model_classs_module(toy):
    """What a worker rank does with the family of the load it is sent (engine/parallel/worker.py)."""
    from engine.models import get
    from engine.parallel.worker import know_family

    unregister(NAME)
    know_family(NAME, ToyDiT.__module__)
    assert get(NAME) is TOY
    with pytest.raises(ValueError, match="module 'math' .* declares no module-level Family"):
        know_family("no-such-family", "math")


@pytest.mark.subprocess
def test_two_gloo_ranks(toy):
    """Sequence parallel (Ulysses: the family's chunk_context) and tensor parallel (its shard_dims, heads_module and
    partial_sum_modules, biases included) on two gloo ranks that learn the toy family from this module; one pool
    of workers serves both engines."""
    import engine.parallel.pool as pool_mod

    saved = pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S
    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = 120.0, 60.0, 60.0
    engines = []
    try:
        for mode in (dict(ulysses_degree=2), dict(tp=2)):
            engines.append(open_engine(toy["path"], EngineConfig(**mode)))
            assert engines[-1].runner.plan.world_size == 2
            out = _sample(engines[-1], toy["inputs"], CacheConfig(enabled=False))
            assert _close(out, toy["ref"], 1e-4), (mode, (out - toy["ref"]).abs().max())
    finally:
        for eng in engines:
            eng.release()
        pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = saved


def test_sgld_generate_names_a_family_without_a_text_encoder_and_vae(toy, tmp_path, sgld_in_process):
    """A family whose description names no text encoder and VAE (``Family.companions`` None) is refused by name
    before anything loads; it runs in sgld bench and the engine."""
    path = toy["path"]
    code, _, err = sgld_in_process("generate", "--model", path, "--text-encoder", path, "--vae", path, "--prompt", "a",
                                   "--out", tmp_path / "t.png")
    assert code == 2 and "is a Toy-DiT DiT, whose text encoder and VAE this version does not load" in err
    assert not (tmp_path / "t.png").exists()
