"""Attention backends: parity with SDPA for every backend that runs on this machine, the unpadded
per-sample path used by mask-less kernels, selection (auto order, one log line) and fallbacks."""
import importlib.metadata
import json
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import attention as A
from engine.models.random_weights import SIZES, random_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv(b=2, s=24, h=4, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(device, dtype) for _ in range(3)]


def prefix_mask(b, s, lens, device="cpu"):
    return torch.arange(s, device=device)[None] < torch.tensor(lens, device=device)[:, None]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", A.available_backends(DEVICE, torch.bfloat16, 64))
@pytest.mark.parametrize("masked", [False, True])
def test_every_available_backend_matches_sdpa(name, masked):
    dtypes = [torch.bfloat16] if name in ("sage", "flash") else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        q, k, v = qkv(dtype=dtype, device=DEVICE, d=64)
        mask = prefix_mask(2, 24, [24, 15], DEVICE) if masked else None
        out = A.FUNCTIONS[name](q, k, v, mask)
        ref = A.sdpa(q, k, v, mask)
        assert out.shape == ref.shape == q.shape
        tol = {"sage": 0.05, "flash": 0.01}.get(name, 1e-5 if dtype == torch.float32 else 1e-2)
        assert rel(out, ref) < tol, (name, dtype, rel(out, ref))


def test_sdpa_mask_excludes_padded_keys():
    q, k, v = qkv()
    mask = prefix_mask(2, 24, [24, 10])
    k2, v2 = k.clone(), v.clone()
    k2[1, 10:] += 100.0  # garbage in the padding must not matter
    v2[1, 10:] -= 50.0
    assert torch.allclose(A.sdpa(q, k, v, mask), A.sdpa(q, k2, v2, mask), atol=1e-5)
    assert not torch.allclose(A.sdpa(q, k, v, None), A.sdpa(q, k2, v2, None), atol=1e-2)


def _maskless(q, k, v):
    """A kernel without a mask argument, like sageattn / flash_attn_func (NHD layout)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_unpadded_per_sample_equals_masked_sdpa():
    q, k, v = qkv(b=3, s=20)
    mask = prefix_mask(3, 20, [20, 13, 6])
    out = A.per_sample(_maskless, q, k, v, mask)
    assert rel(out, A.sdpa(q, k, v, mask)) < 1e-5
    # all rows full: one call, no mask needed
    full = torch.ones(3, 20, dtype=torch.bool)
    assert rel(A.per_sample(_maskless, q, k, v, full), A.sdpa(q, k, v)) < 1e-6
    # a mask that is not a prefix cannot be unpadded: it must go to sdpa, not be mis-handled
    holes = full.clone()
    holes[1, 3] = False
    assert A.prefix_lengths(holes) is None
    assert rel(A.per_sample(_maskless, q, k, v, holes), A.sdpa(q, k, v, holes)) < 1e-6


def _fake_sage_1_0_6(calls):
    """A stand-in for sageattention 1.0.6's ``sageattn`` (the real kernel is Triton on a CUDA GPU, which
    this machine has not): its input checks and its in-place key smoothing (``k -= k.mean``), then
    exact attention. The smoothing shifts every score of a query by the same amount, so the result is
    unchanged; what changes is the caller's K, unless the op passes a copy."""

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kw):
        assert tensor_layout == "NHD" and not is_causal
        assert q.shape[-1] in (64, 96, 128), "headdim should be in [64, 96, 128]."
        calls.append((q.shape[1], k.shape[1]))
        if smooth_k:
            k -= k.mean(dim=1, keepdim=True)
        return _maskless(q, k, v)

    return types.SimpleNamespace(sageattn=sageattn, __version__="1.0.6")


def test_sage_op_with_a_fake_kernel_unpads_per_sample(monkeypatch):
    """The registered custom op runs the kernel per sample on its valid keys."""
    calls = []
    monkeypatch.setitem(sys.modules, "sageattention", _fake_sage_1_0_6(calls))
    q, k, v = qkv(s=128, d=64)
    mask = prefix_mask(2, 128, [128, 64])
    out = torch.ops.sgld.sage_attention(q, k, v, mask)
    assert rel(out, A.sdpa(q, k, v, mask)) < 1e-5
    assert calls == [(128, 128), (128, 64)]


def test_sage_op_leaves_the_callers_key_unchanged(monkeypatch):
    """sageattention 1.x subtracts the key mean in place; the op is declared ``mutates_args=()`` (and
    torch.compile relies on that), so the caller's K must come back bit-identical."""
    calls = []
    monkeypatch.setitem(sys.modules, "sageattention", _fake_sage_1_0_6(calls))
    q, k, v = qkv(s=128, d=64)
    before = [t.clone() for t in (q, k, v)]
    for mask in (None, prefix_mask(2, 128, [128, 64])):  # the whole batch, and sliced per sample
        torch.ops.sgld.sage_attention(q, k, v, mask)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))
    assert calls  # the kernel really ran


def test_sage_routes_key_lengths_its_version_cannot_mask_to_sdpa(monkeypatch):
    """With 1.0.6, a sample whose key count is not a multiple of 64 would let zero-padded keys into the
    softmax: it goes to sdpa (exact); the others still run the kernel. Counted in ``sage_calls``."""
    calls = []
    monkeypatch.setitem(sys.modules, "sageattention", _fake_sage_1_0_6(calls))
    for key in ("sage", "split", "sdpa"):
        monkeypatch.setitem(A.sage_calls, key, 0)
    q, k, v = qkv(s=128, d=64)
    mask = prefix_mask(2, 128, [128, 100])
    out = torch.ops.sgld.sage_attention(q, k, v, mask)
    assert rel(out, A.sdpa(q, k, v, mask)) < 1e-5
    assert calls == [(128, 128)]  # the 100-key sample did not reach the kernel: 1.0.6 returns no LSE to split by
    assert A.sage_calls == {"sage": 1, "split": 0, "sdpa": 1}
    q, k, v = qkv(s=128, d=80)  # head_dim 1.0.6 asserts against: sdpa, not an AssertionError
    assert rel(torch.ops.sgld.sage_attention(q, k, v, None), A.sdpa(q, k, v)) < 1e-5
    assert calls == [(128, 128)]


@pytest.mark.parametrize("version,cap,head_dim,keys,ok", [
    ("1.0.6", (9, 0), 128, 4224, True),     # 4096 image + 128 text tokens: 66 blocks of 64
    ("1.0.6", (9, 0), 128, 4128, False),    # 4096 + 32: the last block is half padding
    ("1.0.6", (9, 0), 128, 300, False),
    ("1.0.6", (9, 0), 96, 640, True),
    ("1.0.6", (9, 0), 80, 640, False),      # asserts head_dim in {64, 96, 128}
    ("1.0.6", (9, 0), 256, 640, False),
    ("2.2.0", (9, 0), 80, 300, True),       # 2.x pads head_dim; its sm90 CUDA kernel masks the tail
    ("2.2.0", (8, 6), 128, 300, True),      # sm86 runs 2.x's Triton kernel: tail not masked, but it returns
    ("2.2.0", None, 128, 300, True),        # the LSE: 256 keys by sage, 44 exact, merged (capability unknown too)
    ("2.2.0", (8, 6), 128, 40, False),      # fewer keys than one block: nothing for the kernel
    ("2.2.0", (9, 0), 192, 640, False),
    ("unknown", (9, 0), 128, 300, False),   # an unreadable version gets 1.x's limits
    ("3.0.0", (9, 0), 128, 4224, True),
])
def test_sage_route_follows_the_installed_versions_limits(version, cap, head_dim, keys, ok):
    limits = A.sage_limits(version, cap)
    why = A.sage_route(limits, head_dim, keys)
    assert (why is None) == ok, why
    if not ok:
        assert version in why


def _block_kernel_with_lse(block=64):
    """A CPU stand-in for a sage kernel (sage needs CUDA, absent here) with sage's block constraint: it refuses
    key counts that are not a multiple of ``block`` (what sage 1.x and 2.x's Triton path cannot mask) and, like
    sage 2.x's ``return_lse=True``, returns the natural-log log-sum-exp beside the output (the engine's [B, S, H])."""
    seen = []

    def kernel(q, k, v):
        assert k.shape[1] % block == 0, f"{k.shape[1]} keys is not a multiple of {block}"
        seen.append(k.shape[1])
        return A.attention_with_lse(q, k, v)
    return kernel, seen


@pytest.mark.parametrize("keys", [64 * 5 + 13, 64 + 1, 64 * 3 + 63])
def test_split_tail_equals_sdpa_at_any_key_count(keys):
    """Issue 29 point 4: a block-constrained kernel on the largest multiple of its block, the tail exact, merged by
    log-sum-exp, equals attention over all keys (a typical prompt: 4096 image + 77 text keys, 4173 = 65 x 64 + 13)."""
    kernel, seen = _block_kernel_with_lse()
    q, k, v = qkv(b=2, s=keys, h=3, d=64)
    main = A.sage_split(A.sage_limits("2.2.0", (8, 6)), keys)
    assert main == keys - keys % 64
    out = A.split_tail(kernel, q, k, v, main)[0]
    assert seen == [main]
    assert rel(out, A.sdpa(q, k, v)) < 1e-5
    assert A.sage_split(A.sage_limits("1.0.6", (9, 0)), keys) == 0  # 1.0.6 returns no LSE: not split


def test_ring_attention_blocks_run_the_chosen_backends_lse_kernel():
    """Issue 34 item 4: ring attention's blocks take their kernel from the backend table. A registered backend
    whose attention-with-LSE is the sage stand-in (block-constrained, the tail split off exact) is what the blocks
    run, per sample on a padded block's valid keys, and the result equals masked sdpa; the model's chosen backend
    is what the parallel forward passes; without one (or one with no LSE kernel) blocks run sdpa's."""
    from engine.parallel.comm import ring_attention

    kernel, seen = _block_kernel_with_lse()

    def standin_lse(q, k, v):
        return A.split_tail(kernel, q, k, v, k.shape[1] - k.shape[1] % 64)

    A.register_backend(A.Backend("sage_standin", A.math_attention, lambda device, dtype, head_dim: (True, "test kernel"),
                                 lse=lambda device, dtype, head_dim: ("sage stand-in", standin_lse)))
    try:
        assert A.lse_kernel(torch.device("cpu"), torch.float32, 64, "sage_standin") is standin_lse
        assert seen == []  # the probe's 37 keys are below one block: all exact, the kernel not called
        q, k, v = qkv(s=160, d=64)
        mask = prefix_mask(2, 160, [160, 100])
        out = ring_attention(q, k, v, [A.block_lens(mask)], None, [0], 0, backend="sage_standin")  # one ring position
        assert seen == [128, 64]  # 160 keys: 128 by the kernel + 32 exact; 100 keys: 64 + 36
        assert rel(out, A.sdpa(q, k, v, mask)) < 1e-5
        m = random_model(SIZES["tiny"], seed=0)
        assert A.AttentionBackend.chosen(m) is None
        A.apply_attention(m, A.select_backend("sage_standin", "cpu", torch.float32, 64, log_choice=False))
        assert A.AttentionBackend.chosen(m) == "sage_standin"
    finally:
        A.unregister_backend("sage_standin")
    assert A.lse_kernel(torch.device("cpu"), torch.float32, 64, "flash") is A.lse_kernel(torch.device("cpu"), torch.float32, 64)
    assert A.lse_kernel(torch.device("cpu"), torch.float32, 64, "math") is A.attention_with_lse


def _fake_sage_2(calls, block=64):
    """sageattention 2.x's ``sageattn`` as its Triton path behaves (no tail mask: only multiples of ``block``),
    with ``return_lse`` (its log-sum-exp [B, H, S]); math on CPU stands in for the CUDA kernel."""
    kernel, _ = _block_kernel_with_lse(block)

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kw):
        assert tensor_layout == "NHD" and not is_causal
        calls.append(k.shape[1])
        out, lse = kernel(q, k, v)
        return (out.to(q.dtype), lse.transpose(1, 2)) if return_lse else out.to(q.dtype)
    return types.SimpleNamespace(sageattn=sageattn, __version__="2.2.0")


def test_sage_op_splits_a_tail_its_kernel_cannot_mask(monkeypatch):
    """Through the registered op: a padded sample with 100 keys runs the kernel on 64 and 36 exact keys merged by
    log-sum-exp (counted as ``split``); the whole sample runs it whole; both equal masked sdpa."""
    calls = []
    monkeypatch.setitem(sys.modules, "sageattention", _fake_sage_2(calls))
    for key in ("sage", "split", "sdpa"):
        monkeypatch.setitem(A.sage_calls, key, 0)
    q, k, v = qkv(s=128, d=64)
    mask = prefix_mask(2, 128, [128, 100])
    out = torch.ops.sgld.sage_attention(q, k, v, mask)
    assert rel(out, A.sdpa(q, k, v, mask)) < 1e-5
    assert calls == [128, 64] and A.sage_calls == {"sage": 1, "split": 1, "sdpa": 0}
    assert "merged by log-sum-exp" in A.sage_limits("2.2.0", (8, 6)).describe()


def test_sage_selection_reports_the_version_and_its_limits(monkeypatch):
    """The attention description names the installed version (from the package metadata when the
    module has no ``__version__``, as 1.0.6 has none) and what it routes to sdpa."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fake = _fake_sage_1_0_6([])
    monkeypatch.setitem(sys.modules, "sageattention", fake)
    ch = A.select_backend("sage", "cuda", torch.bfloat16, 128)
    assert ch.name == "sage" and "sageattention 1.0.6" in ch.describe()
    assert "not a multiple of 64 use sdpa" in ch.describe()
    ch = A.select_backend("sage", "cuda", torch.bfloat16, 80)
    assert ch.name == "sdpa" and "head_dim 64/96/128, not 80" in ch.warnings[0]
    del fake.__version__
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0.6" if name == "sageattention" else "0")
    assert A.installed_version("sageattention") == "1.0.6"


def test_selection_on_this_machine_and_fallback_warnings(caplog):
    caplog.set_level(logging.INFO, logger="sgld.attention")
    choice = A.select_backend("auto", "cpu", torch.float32, 16)
    assert choice.name == "sdpa" and choice.fn is A.sdpa and choice.warnings == []
    assert "sage" in choice.reason and "flash" in choice.reason
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "attention: sdpa" in infos[0].getMessage()
    caplog.clear()
    for name in ("sage", "flash"):
        ch = A.select_backend(name, "cpu", torch.bfloat16, 128)
        assert ch.name == "sdpa" and ch.fn is A.sdpa
        assert len(ch.warnings) == 1 and f"'{name}' cannot run here" in ch.warnings[0] and "using sdpa" in ch.warnings[0]
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2
    assert A.select_backend("math", "cpu").fn is A.math_attention
    with pytest.raises(ValueError, match="auto, sdpa, sage, flash, math"):
        A.select_backend("xformers")


def test_auto_prefers_sage_then_flash(monkeypatch):
    """Selection order on a (simulated) GPU machine: sage if it imports and the arch is supported, then flash."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=None, __version__="2.2.0"))
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=None, __version__="2.8.3"))
    ch = A.select_backend("auto", "cuda", torch.bfloat16, 128)
    assert ch.name == "sage" and "sm90" in ch.reason
    assert A.select_backend("auto", "cuda", torch.bfloat16, 256).name == "flash"  # sage: head_dim > 128
    assert A.select_backend("auto", "cuda", torch.float32, 128).name == "sdpa"  # fp32 weights
    cap["value"] = (10, 0)  # B200: sageattn has no kernel
    assert A.select_backend("auto", "cuda", torch.bfloat16, 128).name == "flash"
    ch = A.select_backend("sage", "cuda", torch.bfloat16, 128)
    assert ch.name == "sdpa" and "sm100" in ch.warnings[0]
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    ch = A.select_backend("flash", "cuda", torch.bfloat16, 128)
    assert ch.name == "sdpa" and "flash_attn" in ch.warnings[0]


def test_guarded_kernel_falls_back_at_call_time(caplog):
    """A selected GPU kernel that gets inputs it cannot take (CPU / fp32 here) computes sdpa, logging once."""
    caplog.set_level(logging.WARNING, logger="sgld.attention")
    A.forget_warnings()
    q, k, v = qkv()
    mask = prefix_mask(2, 24, [24, 9])
    for _ in range(3):
        assert torch.equal(A.sage(q, k, v, mask), A.sdpa(q, k, v, mask))
    assert sum("'sage' cannot take float32" in r.getMessage() for r in caplog.records) == 1


def test_engine_records_fallback_and_math_backend_matches():
    model = random_model(SIZES["tiny"], seed=0)
    eng = Engine(model, EngineConfig(attention="sage"))
    assert eng.attention_backend == "sdpa" and model.attention is A.sdpa
    assert any("'sage' cannot run here" in w for w in eng.warnings)
    assert any(n.startswith("attention: sdpa") for n in eng.notes)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 16, 6, 6, generator=g), torch.tensor([300.0, 300.0])
    text, lens = torch.randn(2, 9, 48, generator=g), torch.tensor([9, 5])
    with torch.no_grad():
        ref = model(x, t, text, lens)
        m2 = random_model(SIZES["tiny"], seed=0)
        eng2 = Engine(m2, EngineConfig(attention="math"))
        assert eng2.warnings == [] and eng2.attention_backend == "math"
        out = m2(x, t, text, lens)
    assert rel(out, ref) < 1e-5


def test_cli_shows_the_fallback_warning(capsys):
    from engine.cli import main

    assert main(["bench", "--size", "tiny", "--steps", "0", "--repeat", "1", "--attention", "flash", "--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out.strip().splitlines()[-1])
    assert res["attention"] == "sdpa"
    assert any("'flash' cannot run here" in w for w in res["warnings"])
    assert "sgld: warning: attention 'flash' cannot run here" in err
    assert "sgld: attention: sdpa (requested flash" in err


# -- the table is the single source -------------------------------------------------------------------------
@pytest.fixture
def counted_backend():
    calls = []

    def counted(q, k, v, key_mask=None):
        calls.append(tuple(q.shape))
        return A.math_attention(q, k, v, key_mask)

    backend = A.register_backend(A.Backend("counted", counted, lambda device, dtype, head_dim: (True, "test kernel"),
                                           auto=3))
    yield backend, calls
    A.unregister_backend("counted")


def test_a_registered_backend_is_listed_chosen_and_run(counted_backend):
    """A backend registered in BACKEND_TABLE is accepted by name, listed as available, ranked by auto (3:
    above sage and flash), described with torch's version (no package) and is what the model calls."""
    backend, calls = counted_backend
    assert "counted" in A.backend_names() and "counted" in A.available_backends("cpu", torch.float32, 64)
    assert EngineConfig(attention="Counted").attention == "counted"  # the option's choices are the table's
    choice = A.select_backend("counted", "cpu", torch.float32, 64, log_choice=False)
    assert (choice.name, choice.reason, choice.warnings) == ("counted", "test kernel", [])
    assert choice.version.startswith("torch ")
    assert A.select_backend("auto", "cpu", torch.float32, 64, log_choice=False).name == "counted"
    m = random_model(SIZES["tiny"], seed=0)
    ref = m(*_tiny_inputs()).float()
    A.apply_attention(m, choice)
    out = m(*_tiny_inputs()).float()
    assert len(calls) == SIZES["tiny"].num_layers and (out - ref).abs().max() < 1e-4
    assert A.remove_attention(m) and m.attention is A.sdpa


def test_unknown_backends_are_named_from_the_table():
    with pytest.raises(ValueError, match=r"attention 'nope' is not supported; choose one of auto, sdpa, sage, flash, math"):
        A.select_backend("nope")
    assert A.check_backend("nope") == (False, "unknown backend 'nope'")
    assert A.BACKENDS == A.backend_names() and tuple(A.FUNCTIONS) == tuple(A.BACKEND_TABLE)


def _tiny_inputs():
    cfg = SIZES["tiny"]
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, cfg.in_channels, 4, 4, generator=g), torch.tensor([500.0]),
            torch.randn(1, 3, cfg.text_in_dim, generator=g), torch.tensor([3]))


def test_a_second_copy_of_the_package_takes_the_first_copys_op(monkeypatch):
    """The tests (and a ComfyUI that loads the pack beside an installed ``engine``) hold two copies of the
    package in one process: the second's ``sgld::sage_attention`` is the first's op, not a silent replacement
    that would route the first copy's calls (and counters) to the second copy's kernel."""
    from engine.features.attention.kernels import attention_op

    seen, calls = [], []
    op = attention_op("sage_attention", lambda q, k, v: seen.append(q.shape) or q)
    assert op is torch.ops.sgld.sage_attention
    monkeypatch.setitem(sys.modules, "sageattention", _fake_sage_1_0_6(calls))
    q, k, v = qkv(s=128, d=64)
    assert rel(op(q, k, v, None), A.sdpa(q, k, v)) < 1e-5
    assert seen == [] and calls == [(128, 128)]  # the first copy's kernel ran (no mask: one call)
