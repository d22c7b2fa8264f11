"""Regional torch.compile on CPU: output equals eager, one graph shared by every block, no recompile
when Cache-DiT skips blocks, exactly one extra graph per new resolution (static) or one in all
(dynamic). Graph counts come from torch._dynamo's counters. Kept tiny: an inductor compile of the
block costs 15-60 s on a shared 2-core machine, so only one is made here (inductor: equality and
skipping); the graph-count tests use aot_eager, whose dynamo graphs and guards are the same."""
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import compile as C
from engine.features import patching
from engine.features import quant as Q
from engine.models.family import run_blocks
from engine.models.random_weights import SIZES, random_model

CFG = SIZES["tiny"]
needs_cc = pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="CPU inductor needs a C compiler")


def inputs(h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, CFG.in_channels, h, w, generator=g)
    t = torch.tensor([600.0, 600.0])
    text = torch.randn(2, 7, CFG.text_in_dim, generator=g)
    return x, t, text, torch.tensor([7, 4])  # CFG-like batch: padded text -> a key mask


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def skip_middle(model, h, ctx):
    """A cache-style block runner: the first block only (block 1 skipped, its residual reused)."""
    return model.layers[0](h, ctx)


@pytest.mark.slow
@pytest.mark.subprocess
@needs_cc
def test_inductor_equals_eager_one_graph_no_recompile_when_blocks_are_skipped():
    torch._dynamo.reset()
    eager = random_model(CFG, seed=0)
    model = random_model(CFG, seed=0)
    eng = Engine(model, EngineConfig(compile=True))
    compiled = patching.get(model, "compile").describe()
    assert C.is_compiled(model) and compiled["shapes"] == "static" and eng.warnings == []
    assert compiled["mode"] == "default"  # CPU: plain inductor (GPU: max-autotune-no-cudagraphs)
    C.reset_counters()
    a = inputs(6, 6)
    with torch.no_grad():
        ref_a = eager(*a)
        out = model(*a)
        assert rel(out, ref_a) < 1e-4
        assert C.graph_count() == 1  # both blocks share one graph
        model(*a)
        assert C.graph_count() == 1
        # Cache-DiT skipping blocks: the same compiled block, called fewer times -> no recompile
        model.block_runner = skip_middle
        h, ctx = eager.embed(*a)
        assert rel(model(*a), eager.unembed(skip_middle(eager, h, ctx), ctx)) < 1e-4
        model.block_runner = run_blocks
        assert C.graph_count() == 1
    # the real Cache-DiT runner inside Engine.sample (CFG batch of the same shapes), steps skipped
    from engine.features.cache import CacheConfig

    cond, uncond = [a[2][0]], [a[2][1, :4]]
    lat = torch.zeros(1, CFG.in_channels, 6, 6)
    cache = CacheConfig(steps_mask="1010", fn=1, bn=0, scm_policy="static", warmup=0)
    out = eng.sample(lat, cond, uncond, seed=0, steps=4, cfg=3.0, cache=cache)
    assert eng.last_run.step_mask.count(False) >= 1  # some calls skipped block 1
    assert C.graph_count() == 1, "skipping blocks must not recompile"
    assert C.graph_breaks() == {}
    ref = Engine(eager, EngineConfig()).sample(lat, cond, uncond, seed=0, steps=4, cfg=3.0, cache=cache)
    assert rel(out, ref) < 1e-4


def test_static_one_extra_graph_per_new_resolution():
    """Graph counting is dynamo's, the same for every backend: aot_eager avoids C++ compile time."""
    torch._dynamo.reset()
    model = random_model(CFG, seed=0)
    eager = random_model(CFG, seed=0)
    C.compile_blocks(model, "static", backend="aot_eager")
    C.reset_counters()
    with torch.no_grad():
        for (h, w), graphs in [((6, 6), 1), ((6, 6), 1), ((6, 10), 2), ((6, 6), 2), ((6, 10), 2), ((8, 8), 3)]:
            x = inputs(h, w)
            assert rel(model(*x), eager(*x)) < 1e-5
            assert C.graph_count() == graphs, ((h, w), C.graph_count())
    assert C.graph_breaks() == {}


def test_dynamic_one_extra_graph_for_all_new_resolutions():
    """aot_eager backend: the same dynamo graph logic as inductor, without C++ compile time."""
    torch._dynamo.reset()
    model = random_model(CFG, seed=0)
    eager = random_model(CFG, seed=0)
    C.compile_blocks(model, "dynamic", backend="aot_eager")
    C.reset_counters()
    with torch.no_grad():
        for i, (h, w) in enumerate([(6, 6), (6, 10), (8, 8), (4, 12), (6, 6)]):
            x = inputs(h, w, seed=i)
            assert rel(model(*x), eager(*x)) < 1e-5
            assert C.graph_count() == (1 if i == 0 else 2), (h, w, C.graph_count())
    assert C.graph_breaks() == {}


@pytest.mark.parametrize("fmt", ["fp8", "int4-g64", "fp8-scaled_mm"])
def test_quantized_blocks_trace_without_graph_breaks(fmt):
    torch._dynamo.reset()
    model = random_model(CFG, seed=0, dtype=torch.bfloat16 if fmt == "fp8-scaled_mm" else torch.float32)
    Q.apply_quant(model, fmt.split("-scaled")[0])
    for mod in model.modules():  # the GPU fast path (torch._scaled_mm also runs on CPU)
        if isinstance(mod, Q.FP8Linear):
            mod.use_scaled_mm = fmt == "fp8-scaled_mm"
    eager_out = None
    with torch.no_grad():
        eager_out = model(*inputs(6, 6))
        C.compile_blocks(model, "static", backend="aot_eager", fullgraph=True)
        C.reset_counters()
        out = model(*inputs(6, 6))
    assert rel(out, eager_out) < 1e-5
    assert C.graph_count() == 1 and C.graph_breaks() == {}
    C.uncompile_blocks(model)
    assert not C.is_compiled(model)


def test_compile_option_validation():
    with pytest.raises(ValueError, match="EngineConfig.compile 'fast'.*'static', 'dynamic'"):
        EngineConfig(compile="fast")
    assert EngineConfig(compile="on").compile is True and EngineConfig(compile="off").compile is False
    with pytest.raises(ValueError, match="static or dynamic"):
        C.compile_blocks(random_model(CFG), "sometimes")
    assert C.default_mode("cpu") is None and C.default_mode("cuda") == "max-autotune-no-cudagraphs"


def test_cli_compile_flag_maps_to_the_config():
    from engine.cli import build_parser
    from engine.cli.common import engine_config

    p = build_parser()
    assert engine_config(p.parse_args(["bench", "--compile"])).compile == "static"
    assert engine_config(p.parse_args(["bench", "--compile", "dynamic"])).compile == "dynamic"
    assert engine_config(p.parse_args(["bench"])).compile is False
    cfg = engine_config(p.parse_args(["generate", "--prompt", "x", "--compile", "--quant", "fp8", "--attention", "sage"]))
    assert (cfg.compile, cfg.quant, cfg.attention) == ("static", "fp8", "sage")


def test_no_c_compiler_means_eager_with_a_warning(monkeypatch):
    import shutil as sh

    monkeypatch.setattr(sh, "which", lambda name: None)
    model = random_model(CFG, seed=0)
    eng = Engine(model, EngineConfig(compile=True))
    assert not C.is_compiled(model)
    assert any("no C compiler" in w for w in eng.warnings)
