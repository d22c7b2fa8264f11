"""DBCache block runner inside Engine.sample: bit-equality when off, masks that happen, limits,
CFG branches, state reset, interrupts, TaylorSeer math."""
from dataclasses import replace

import pytest
import torch
from torch import nn

from engine.engine import Engine
from engine.features.cache import CacheConfig, DBCacheRunner, TaylorSeer, mask_str, preset_mask, resolve_config
from engine.models import family
from engine.models.family import run_blocks
from engine.models.random_weights import SIZES, random_model

ENV_VARS = ("ENABLED", "SCM_PRESET", "FN", "BN", "WARMUP", "RDT", "MC", "TAYLORSEER", "TS_ORDER", "SCM_POLICY")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for v in ENV_VARS:
        monkeypatch.delenv("SGLANG_CACHE_DIT_" + v, raising=False)


@pytest.fixture(scope="module")
def engine():
    return Engine(random_model(replace(SIZES["tiny"], num_layers=4), seed=0))


def inputs(b=1, hw=4):
    g = torch.Generator().manual_seed(0)
    lat = torch.zeros(b, 16, hw, hw)
    cond = [torch.randn(5 + i, 48, generator=g) for i in range(b)]
    uncond = [torch.randn(3, 48, generator=g)]
    return lat, cond, uncond


def run(engine, cache=None, steps=10, cfg=4.0, b=1, hw=4, **kw):
    lat, cond, uncond = inputs(b, hw)
    return engine.sample(lat, cond, uncond, seed=3, steps=steps, cfg=cfg, cache=cache, **kw)


def test_off_is_bit_equal_and_runner_untouched(engine, monkeypatch):
    base = run(engine)
    assert engine.last_run.cache == {} and engine.last_run.calls_computed == 10
    off = run(engine, CacheConfig(enabled=False))
    assert torch.equal(base, off)
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_SCM_PRESET", "fast")
    assert torch.equal(base, run(engine, CacheConfig(enabled=False)))  # explicit off beats the env
    assert engine.model.block_runner is run_blocks


def test_all_ones_mask_is_bit_equal(engine):
    base = run(engine)
    on = run(engine, CacheConfig(steps_mask="1" * 10, scm_policy="static"))
    assert torch.equal(base, on) and engine.last_run.cache["computed"] == 10


@pytest.mark.slow
def test_the_env_switches_the_cache_on_where_a_run_starts_not_inside_the_engine(engine, monkeypatch):
    base = run(engine, steps=20)
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_SCM_PRESET", "balanced")
    assert torch.equal(base, run(engine, steps=20)) and engine.last_run.cache == {}  # Engine.sample reads no env
    monkeypatch.setenv("SGLANG_CACHE_DIT_FN", "0")
    run(engine, steps=2)  # not even a bad value: the entry points refuse it (resolve_config)
    monkeypatch.delenv("SGLANG_CACHE_DIT_FN")
    out = run(engine, resolve_config(None), steps=20)  # what the CLI, the server's start, the nodes, the pipeline do
    st = engine.last_run
    assert st.cache["preset"] == "balanced"
    assert "".join("1" if m else "0" for m in st.step_mask) == mask_str(preset_mask("balanced", 20))
    assert st.calls_computed == sum(preset_mask("balanced", 20)) < 20
    assert not torch.equal(base, out)  # the cache engaged
    assert torch.isfinite(out).all()
    assert (out - base).abs().max() < 0.5 * base.abs().max()
    d = st.to_dict()
    assert d["calls_computed"] == st.calls_computed and d["speedup"] is not None and "cache" in d
    assert engine.model.block_runner is run_blocks


@pytest.mark.slow
def test_static_mask_needs_no_host_sync(engine):
    run(engine, CacheConfig(preset="fast"), steps=20)
    assert all(d is None for d in engine.last_run.cache["diffs"])


def test_first_and_last_always_computed(engine):
    run(engine, CacheConfig(rdt=0.99, warmup=0, mc=-1), steps=8)
    m = engine.last_run.step_mask
    assert m[0] and m[-1]


def test_max_consecutive_limit(engine):
    run(engine, CacheConfig(rdt=1.0, warmup=0, mc=2), steps=12)
    assert engine.last_run.cache["mask"] == "100100100101"
    run(engine, CacheConfig(rdt=1.0, warmup=3, mc=1), steps=10)
    assert engine.last_run.cache["mask"] == "1110101011"


def test_max_cached_steps(engine):
    run(engine, CacheConfig(rdt=1.0, warmup=2, mc=-1, max_cached_steps=3), steps=10)
    assert engine.last_run.cache["mask"] == "1100011111"


def test_threshold_zero_never_caches(engine):
    base = run(engine)
    assert torch.equal(base, run(engine, CacheConfig(rdt=0.0, warmup=0)))


def test_dynamic_mask_respects_threshold(engine):
    run(engine, CacheConfig(preset="fast", scm_policy="dynamic", rdt=0.0), steps=20)
    assert engine.last_run.calls_computed == 20
    run(engine, CacheConfig(preset="fast", scm_policy="dynamic", rdt=1.0, mc=-1), steps=20)
    assert engine.last_run.cache["mask"] == mask_str(preset_mask("fast", 20))


@pytest.mark.slow
def test_state_resets_between_runs_and_resolutions(engine):
    cache = CacheConfig(rdt=0.5, warmup=1, mc=2, taylorseer=True)
    a1 = run(engine, cache, hw=4)
    m1 = engine.last_run.cache["mask"]
    b1 = run(engine, cache, hw=6, b=2)  # new resolution and batch
    a2 = run(engine, cache, hw=4)
    assert torch.equal(a1, a2) and engine.last_run.cache["mask"] == m1
    fresh = Engine(engine.model)
    assert torch.equal(b1, run(fresh, cache, hw=6, b=2))


def test_batch_denoise_heun(engine):
    out = run(engine, CacheConfig(preset="balanced"), steps=10, b=3, denoise=0.6)
    assert out.shape[0] == 3 and torch.isfinite(out).all()
    assert len(engine.last_run.step_mask) == 10
    run(engine, CacheConfig(preset="balanced"), steps=10, sampler="heun")
    st = engine.last_run
    assert len(st.step_mask) == 19 and st.cache["mask"] == mask_str(preset_mask("balanced", 19))
    run(engine, CacheConfig(preset="balanced"), steps=10, cfg=1.0)  # no CFG: one branch
    assert engine.last_run.calls_computed == sum(preset_mask("balanced", 10))


def test_interrupt_restores_the_default_runner(engine):
    class Stop(Exception):
        pass

    def cb(i, total, x, d):
        if i == 3:
            raise Stop()

    with pytest.raises(Stop):
        run(engine, CacheConfig(preset="fast"), steps=20, callback=cb)
    assert engine.model.block_runner is run_blocks
    assert engine.last_run.cache["calls"] == 4
    base = run(engine)
    assert torch.equal(base, run(engine, CacheConfig(enabled=False)))


def test_bad_config_fails_before_sampling(engine):
    with pytest.raises(ValueError) as err:
        run(engine, CacheConfig(fn=3, bn=1))
    assert "fn" in str(err.value)
    assert engine.model.block_runner is run_blocks


# -- the runner on a toy model: CFG branches, reuse arithmetic ---------------------------------------

class Add(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, h, ctx):
        return h + self.k * ctx


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Add(1.0), Add(2.0), Add(3.0)])


class ToyConfig:
    pass


@pytest.fixture(autouse=True)
def toy_family():
    """The toy is a DiT family of its own (the runner finds the blocks through engine/models/family.py)."""
    family.register(family.Family(
        name="toy-dbcache", title="Toy", config_class=ToyConfig, model_class=Toy, context_class=torch.Tensor,
        signature_keys=("layers.0.k",), blocks="layers", block_linears=(), shard_dims={}, partial_sum_modules=(),
        heads_module="", fuse_groups={}, latent=family.Latent(channels=4, stride=1, name="the toy latent"),
        join_contexts=None, chunk_context=None, activation_bytes=None))
    yield
    family.unregister("toy-dbcache")


def toy_runner(calls=10, branches=2, **kw):
    cfg = CacheConfig(**{"warmup": 0, "mc": -1, **kw})
    return DBCacheRunner(cfg.resolve(calls, 3), branches=branches)


def test_cfg_branches_are_judged_separately():
    model = Toy()
    r = toy_runner(rdt=0.1)
    h = torch.zeros(2, 4)
    r(model, h, torch.ones(2, 4))
    # cond branch (row 0) unchanged, uncond (row 1) changes by 50%: must compute
    r(model, h, torch.tensor([[1.0] * 4, [1.5] * 4]))
    assert r.computed == [True, True]
    assert r.diffs[1].tolist() == pytest.approx([0.0, 0.5])
    # both within 10% of their own reference (the last computed call): cached
    out = r(model, h, torch.tensor([[1.05] * 4, [1.55] * 4]))
    assert r.computed[-1] is False
    assert r.diffs[2].tolist() == pytest.approx([0.05, 0.05 / 1.5], rel=1e-4)
    # reuse: first block (1*ctx) + saved middle residual of the last compute (5 * [1, 1.5])
    assert torch.allclose(out, torch.tensor([[1.05 + 5.0] * 4, [1.55 + 7.5] * 4]))
    # the reference stays at the last computed call (not updated on cached calls)
    r(model, h, torch.tensor([[1.09] * 4, [1.64] * 4]))
    assert r.computed[-1] is False


def test_one_branch_diff_is_whole_batch():
    r = toy_runner(rdt=0.1, branches=1)
    r(Toy(), torch.zeros(2, 4), torch.ones(2, 4))
    r(Toy(), torch.zeros(2, 4), torch.tensor([[1.0] * 4, [1.1] * 4]))
    assert r.diffs[1].shape == (1,) and r.computed[-1] is False


def test_bn_blocks_run_on_cached_calls():
    model = Toy()
    r = toy_runner(rdt=1.0, fn=1, bn=1, branches=1)
    r(model, torch.zeros(1, 2), torch.ones(1, 2))
    out = r(model, torch.zeros(1, 2), 2 * torch.ones(1, 2))
    # fn block: 2, cached middle residual: 2 (from ctx=1), bn block: 3*2 = 6 -> 10
    assert r.computed == [True, False] and torch.allclose(out, torch.full((1, 2), 10.0))


def test_taylorseer_in_the_runner():
    model = Toy()
    r = toy_runner(calls=10, rdt=1.0, branches=1, taylorseer=True, ts_order=1, steps_mask="1101", scm_policy="static")
    outs = [r(model, torch.zeros(1, 1), torch.full((1, 1), float(t))) for t in range(3)]
    # middle residual (2+3)*ctx = 0, 5 at calls 0, 1; linear prediction at call 2 = 10; first block 2
    assert r.computed == [True, True, False] and outs[2].item() == pytest.approx(12.0)


def test_taylorseer_math():
    ts = TaylorSeer(order=1)
    for t in (0, 2):
        ts.update(torch.tensor([3.0 * t + 1]), t)
    assert ts.predict(3).item() == pytest.approx(10.0) and ts.predict(5).item() == pytest.approx(16.0)
    ts2 = TaylorSeer(order=2)
    f = lambda t: 0.5 * t * t - 2 * t + 7  # noqa: E731
    for t in (0, 1, 4):  # uneven spacing
        ts2.update(torch.tensor([f(t)]), t)
    for t in (5, 6, 9):
        assert ts2.predict(t).item() == pytest.approx(f(t), rel=1e-6)
    # before enough points the order drops: one point -> reuse, two -> linear
    ts3 = TaylorSeer(order=2)
    ts3.update(torch.tensor([2.0]), 0)
    assert ts3.predict(4).item() == 2.0
    ts3.update(torch.tensor([4.0]), 1)
    assert ts3.predict(3).item() == pytest.approx(8.0)
    assert TaylorSeer(1).coefficients(3) == [1.0]
    with pytest.raises(ValueError):
        TaylorSeer(3)
