"""LyCORIS LoKr and LoHa (engine/features/lora/lycoris.py) against a merge computed here (lycoris_files.py):
merged into dense weights, a side path on fp8 and GGUF layers, under layer-wise offload and torch.compile,
removal exact; bad factors refused before anything changes (and a fuzz). All under torch.inference_mode(), as
ComfyUI runs nodes. Trainer layouts, ComfyUI's own adapters and the node: test_lycoris_layouts.py."""
import pytest
import torch
import torch.nn.functional as F
from lora_files import CFG, check_compiled_side_path, close_to_reference, inputs, shape_of, tiny_engine, weights_hash
from lycoris_files import ALPHA, CONV, KINDS, LINEARS, factors, lycoris_file, merged_reference, reference_delta
from safetensors.torch import save_file

from engine.features import patching
from engine.features.lora import LoRAError, read_lora, target_modules
from engine.features.lora.lycoris import LOHA_PARTS, LOKR_PARTS
from engine.models.random_weights import random_model


@pytest.mark.parametrize("kind", KINDS)
def test_merge_on_dense_weights_equals_a_hand_merge_and_removal_is_exact(tmp_path, kind):
    eng = tiny_engine(torch.bfloat16)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    h0 = weights_hash(eng.model)
    path, made = lycoris_file(tmp_path / f"{kind}.safetensors", kind, LINEARS + [CONV])
    with torch.inference_mode():
        assert eng.set_loras([(path, 0.7)]) == []  # every key used
        sd = eng.model.state_dict()
        for k, v in sd.items():
            m = k[: -len(".weight")]
            if m in made:
                close_to_reference(v, merged_reference(base[k], [(made[m], 0.7)]))
                assert not torch.equal(v, base[k]), k
            else:
                assert torch.equal(v, base[k]), k
        eng.set_loras([(path, -0.4)])  # a strength change from the kept originals
        k = LINEARS[3] + ".weight"
        close_to_reference(eng.model.state_dict()[k], merged_reference(base[k], [(made[LINEARS[3]], -0.4)]))
        eng.set_loras([])
    assert weights_hash(eng.model) == h0 and patching.get(eng.model, "lora") is None


def test_comfyui_scale_rules():
    """alpha / rank scales LoKr only when a factor is decomposed (ComfyUI), LoHa always; no alpha: 1."""
    model = random_model(CFG)
    for kind, alpha, want in (("lokr_full", ALPHA, 1.0), ("lokr_decomposed", ALPHA, ALPHA / 3), ("lokr_tucker", ALPHA, ALPHA / 3),
                              ("lokr_w1_decomposed", ALPHA, ALPHA / 2),
                              ("loha", ALPHA, ALPHA / 3), ("loha", None, 1.0), ("lokr_decomposed", None, 1.0)):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path, _ = lycoris_file(f"{d}/l.safetensors", kind, LINEARS[:1], alpha=alpha)
            lf = read_lora(path, model)
        assert lf.entries[LINEARS[0]].scale == pytest.approx(want), (kind, alpha)
        assert lf.formats == (kind[:4] if kind.startswith("lokr") else "loha",)


def _gguf_engine(tmp_path):
    from gguf_files import Q, types_for, write_gguf

    from engine.config import EngineConfig
    from engine.models.random_weights import random_state_dict
    from engine.router import open_engine

    sd = random_state_dict(CFG, 0)
    path = write_gguf(tmp_path / "tiny-q8_0.gguf", sd, types_for(sd, Q.Q8_0), "unsloth")
    return open_engine(path, EngineConfig(device="cpu", dtype="fp32"))


@pytest.mark.parametrize("base_kind", ["fp8", "gguf"])
@pytest.mark.parametrize("kind", ["lokr_full", "lokr_decomposed", "lokr_tucker_all", "loha", "loha_wide", "loha_tucker_all"])
def test_side_path_on_quantized_layers_equals_the_hand_update(tmp_path, kind, base_kind):
    from engine.features.quant import QUANT_MODULES

    eng = tiny_engine(torch.float32, quant="fp8") if base_kind == "fp8" else _gguf_engine(tmp_path)
    model = eng.model
    h0 = weights_hash(model)
    path, made = lycoris_file(tmp_path / "q.safetensors", kind, LINEARS)
    x = inputs()
    with torch.inference_mode():
        y0 = model(*x)
        eng.set_loras([(path, 0.8)])
        st = patching.get(model, "lora")
        targets = target_modules(model)
        quantized = [m for m in LINEARS if isinstance(getattr(targets[m], "module", targets[m]), QUANT_MODULES)]
        assert sorted(st.side_paths) == sorted(quantized) and len(quantized) == 4  # the block linears
        for m in quantized:
            mod = getattr(targets[m], "module", targets[m])
            rows = slice(getattr(targets[m], "start", 0), getattr(targets[m], "stop", None))
            xin = torch.randn(3, shape_of(m)[1])
            delta = reference_delta(*made[m], shape_of(m)).float()
            ref = F.linear(xin, mod.dequantize()[rows]) + 0.8 * F.linear(xin, delta)
            torch.testing.assert_close(mod(xin)[:, rows], ref, rtol=1e-5, atol=1e-5)
        assert (model(*x) - y0).abs().max() > 1e-3
        eng.set_loras([])
        assert torch.equal(model(*x), y0)
    assert weights_hash(model) == h0 and not st.side_paths and patching.get(model, "lora") is None


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_layerwise_offload_streams_the_lycoris_update(tmp_path, quant):
    """Under layer-wise offload the LoKr / LoHa update goes into the CPU masters (or the side path) and the
    streamed blocks compute what a resident model computes; removal gives the base back."""
    ref = tiny_engine(torch.bfloat16, quant=quant)
    off = tiny_engine(torch.bfloat16, quant=quant, offload="layerwise", resident_layers=2)
    lokr, _ = lycoris_file(tmp_path / "k.safetensors", "lokr_decomposed", LINEARS + [CONV], seed=1)
    loha, _ = lycoris_file(tmp_path / "h.safetensors", "loha", LINEARS[1:], seed=2)
    x = inputs()
    with torch.inference_mode():
        y0 = off.model(*x)
        h0 = weights_hash(off.model)
        for e in (ref, off):
            e.set_loras([(lokr, 0.6), (loha, -0.3)])
        y_ref, y_off = ref.model(*x), off.model(*x)
        assert torch.equal(y_ref, y_off) and not torch.equal(y_off, y0)
        off.set_loras([])
        assert weights_hash(off.model) == h0 and torch.equal(off.model(*x), y0)


def test_compiled_quantized_blocks_see_the_lokr_side_path_and_strengths_reuse_the_graph(tmp_path):
    from engine.features import compile as C

    eng = tiny_engine(torch.float32, quant="fp8")
    ref = tiny_engine(torch.float32, quant="fp8")
    C.compile_blocks(eng.model, "static", backend="aot_eager")
    x = inputs()
    C.reset_counters()
    with torch.no_grad():
        y0 = eng.model(*x)
    g0 = C.graph_count()
    blocks = [f"layers.{i}.{n}" for i in range(CFG.num_layers) for n in ("self_attention.to_q", "mlp.linear_fc2")]
    path, _ = lycoris_file(tmp_path / "k.safetensors", "lokr_decomposed", blocks, seed=3)
    check_compiled_side_path(eng, ref, path, x, y0, C, g0)


# -- bad files --------------------------------------------------------------------------------------------------
def _bad(tmp_path, sd):
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return str(path)


Q = "lycoris_layers_0_self_attention_to_q"


@pytest.mark.parametrize("sd,match", [
    ({f"{Q}.lokr_w1": torch.ones(4, 4), f"{Q}.lokr_w2": torch.ones(16, 8)}, r"lokr_w1.*kron of \[4 x 16, 4 x 8\].*needs \[64, 64\]"),
    ({f"{Q}.lokr_w1": torch.ones(4, 4)}, r"has no matching 'lokr_w2_a': the LoRA file is incomplete"),
    ({f"{Q}.lokr_w1": torch.ones(4, 4), f"{Q}.lokr_w2_a": torch.ones(16, 3), f"{Q}.lokr_w2_b": torch.ones(2, 16)},
     r"'lycoris_layers_0_self_attention_to_q.lokr_w2_a' \(16, 3\) and .*lokr_w2_b' \(2, 16\) are not a low-rank pair"),
    ({f"{Q}.lokr_w1": torch.ones(4, 4, 1), f"{Q}.lokr_w2": torch.ones(16, 16)}, r"lokr_w1' has shape \(4, 4, 1\), not a 2-d factor"),
    ({f"{Q}.lokr_w1": torch.ones(4, 4), f"{Q}.lokr_w1_a": torch.ones(4, 2), f"{Q}.lokr_w2": torch.ones(16, 16)},
     "both a full and a decomposed form"),
    ({f"{Q}.hada_w1_a": torch.ones(64, 2), f"{Q}.hada_w1_b": torch.ones(2, 64), f"{Q}.hada_w2_a": torch.ones(64, 2),
      f"{Q}.hada_w2_b": torch.ones(2, 32)}, r"hada_w2_a. / .*hada_w2_b. make a \[64, 32\] update.*needs \[64, 64\]"),
    ({f"{Q}.hada_w1_a": torch.ones(64, 2), f"{Q}.hada_w1_b": torch.ones(2, 64), f"{Q}.hada_w2_a": torch.ones(64, 2),
      f"{Q}.hada_w2_b": torch.ones(2, 64), f"{Q}.hada_t1": torch.ones(2, 2, 1, 1)}, "hada_t1 and hada_t2 .* come together"),
    ({f"{Q}.hada_w1_a": torch.ones(64, 2), f"{Q}.hada_w1_b": torch.ones(2, 64), f"{Q}.lora_up.weight": torch.ones(64, 2),
      f"{Q}.lora_down.weight": torch.ones(2, 64)}, "several adapter kinds"),
    ({f"{Q}.lokr_w1": torch.ones(4, 4), f"{Q}.lokr_w2": torch.full((16, 16), float("nan"))}, "NaN or infinite"),
])
def test_bad_factors_are_refused_before_anything_changes(tmp_path, sd, match):
    eng = tiny_engine(torch.bfloat16)
    h0 = weights_hash(eng.model)
    with torch.inference_mode(), pytest.raises(LoRAError, match=match) as err:
        eng.set_loras([(_bad(tmp_path, sd), 1.0)])
    assert "bad.safetensors" in str(err.value)
    assert weights_hash(eng.model) == h0 and patching.get(eng.model, "lora") is None


def test_fuzzed_factor_shapes_get_a_lora_error_or_apply_and_remove_exactly(tmp_path):
    """Random subsets of the LyCORIS parts with random shapes (0 to 4 dims, sizes around the layer's factors,
    zero-size dims): every file is either applied (and removed exactly) or refused with a LoRAError naming it,
    the model left as it was; never another exception."""
    import random

    rnd = random.Random(0)
    eng = tiny_engine(torch.bfloat16)
    h0 = weights_hash(eng.model)
    sizes = (0, 1, 2, 3, 4, 8, 16, 64, 192)
    outcomes = {"applied": 0, "refused": 0}
    with torch.inference_mode():
        for i in range(300):
            if i % 2:  # random parts, random shapes
                kind = rnd.choice((LOKR_PARTS, LOHA_PARTS))
                parts = rnd.sample(kind, rnd.randint(1, len(kind)))
                sd = {f"{Q}.{p}": torch.randn([rnd.choice(sizes) for _ in range(rnd.choice((0, 1, 2, 2, 2, 4)))]) for p in parts}
            else:  # a valid set with one part dropped, or one dim of one part changed, or as it is
                t = factors(rnd.choice(KINDS), LINEARS[0], torch.Generator().manual_seed(i))
                p = rnd.choice(sorted(t))
                change = rnd.choice(("drop", "dim", "none"))
                if change == "drop":
                    del t[p]
                elif change == "dim":
                    shape = list(t[p].shape)
                    shape[rnd.randrange(len(shape))] += rnd.choice((-1, 1))
                    t[p] = torch.randn(shape)
                sd = {f"{Q}.{k}": v for k, v in t.items()}
            if rnd.random() < 0.5:
                sd[f"{Q}.alpha"] = torch.tensor(rnd.choice((0.5, 4.0)))
            path = tmp_path / f"f{i}.safetensors"
            save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
            try:
                eng.set_loras([(str(path), 1.0)])
            except LoRAError as e:
                assert f"f{i}.safetensors" in str(e)
                outcomes["refused"] += 1
            else:
                outcomes["applied"] += 1
                eng.set_loras([])
            assert weights_hash(eng.model) == h0, sd.keys()
    assert outcomes["refused"] > 150 and outcomes["applied"] > 30, outcomes


def test_a_pickled_lycoris_file_is_refused(tmp_path):
    path = tmp_path / "lokr.safetensors"
    torch.save({f"{Q}.lokr_w1": torch.ones(4, 4), f"{Q}.lokr_w2": torch.ones(16, 16)}, str(path))
    with pytest.raises(LoRAError, match="lokr.safetensors"):
        read_lora(str(path), random_model(CFG))
