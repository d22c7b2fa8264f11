"""LyCORIS LoKr and LoHa (engine/features/lora/lycoris.py) against a merge computed here the way ComfyUI's
comfy/weight_adapter/lokr.py and loha.py compute it (torch.kron, matmuls, Tucker einsums; scale alpha / rank,
for LoKr only when a factor is decomposed): merged into dense weights, a side path on fp8 and GGUF layers,
removal exact; bad factors refused before anything changes; the SGLDiffusion LoRA Loader node in-process.
All under torch.inference_mode(), as ComfyUI runs nodes."""
import pytest
import torch
import torch.nn.functional as F
from lora_files import CFG, close_to_reference, inputs, shape_of, tiny_engine, weights_hash
from safetensors.torch import load_file, save_file

from engine.features import patching
from engine.features.lora import LoRAError, read_lora, target_modules
from engine.features.lora.lycoris import LOHA_PARTS, LOKR_PARTS
from engine.models.random_weights import random_model

CONV = "x_embedder.proj"
LINEARS = ["layers.0.self_attention.to_q", "layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj",
           "layers.1.mlp.linear_fc2", "adaLN_modulation.1"]
KINDS = ["lokr_full", "lokr_decomposed", "lokr_tucker", "loha", "loha_tucker"]
ALPHA = 3.0


def wshape(m):
    return shape_of(m) + ((1, 1) if m == CONV else ())


def factors(kind, m, g, r=3):
    """LyCORIS tensors (float32) for module m, as LyCORIS lays them out; Tucker forms on the conv only;
    "loha_wide": rank 8, so that r1 * r2 (64) makes the full update the smaller side path."""
    out, inp = shape_of(m)
    r = 8 if kind == "loha_wide" else r
    kh, kw = wshape(m)[2:] or (1, 1)
    tucker = kind.endswith("tucker") and m == CONV

    def rnd(*s):
        return torch.randn(*s, generator=g) * 0.3

    if kind.startswith("lokr"):
        a1, b1 = 4, 4 if inp % 4 == 0 else 1
        a2, b2 = out // a1, inp // b1
        t = {"lokr_w1": rnd(a1, b1)}
        if kind == "lokr_full":
            t["lokr_w2"] = rnd(a2, b2, kh, kw) if m == CONV else rnd(a2, b2)
        elif kind == "lokr_decomposed":
            t = {"lokr_w1_a": rnd(a1, 2), "lokr_w1_b": rnd(2, b1), "lokr_w2_a": rnd(a2, r), "lokr_w2_b": rnd(r, b2 * kh * kw)}
        elif tucker:
            t.update(lokr_t2=rnd(r, r, kh, kw), lokr_w2_a=rnd(r, a2), lokr_w2_b=rnd(r, b2))
        else:
            t.update(lokr_w2_a=rnd(a2, r), lokr_w2_b=rnd(r, b2))
        return t
    if tucker:
        return {f"hada_{p}": v for i in (1, 2) for p, v in ((f"t{i}", rnd(r, r, kh, kw)), (f"w{i}_a", rnd(r, out)),
                                                            (f"w{i}_b", rnd(r, inp)))}
    return {f"hada_w{i}_{ab}": rnd(*s) for i in (1, 2) for ab, s in (("a", (out, r)), ("b", (r, inp * kh * kw)))}


def reference_delta(t, alpha, shape):
    """dW as ComfyUI computes it (float64), in the layer's weight shape."""
    t = {k: v.double() for k, v in t.items()}
    if "hada_w1_a" in t:
        def half(i):
            if f"hada_t{i}" in t:
                return torch.einsum("i j k l, j r, i p -> p r k l", t[f"hada_t{i}"], t[f"hada_w{i}_b"], t[f"hada_w{i}_a"])
            return t[f"hada_w{i}_a"] @ t[f"hada_w{i}_b"]
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return (half(1) * half(2)).reshape(shape) * scale
    dim = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t.get("lokr_w2")
    if w2 is None:
        dim = t["lokr_w2_b"].shape[0]
        w2 = (torch.einsum("i j k l, j r, i p -> p r k l", t["lokr_t2"], t["lokr_w2_b"], t["lokr_w2_a"])
              if "lokr_t2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"])
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2.contiguous()).reshape(shape) * scale  # (an einsum result is not contiguous)


def lycoris_file(path, kind, modules, key=lambda m: "lycoris_" + m.replace(".", "_"), alpha=ALPHA, seed=0, extra=None):
    """A LyCORIS file for ``modules`` (keys ``key(m) + "." + part``); returns {module: (tensors, alpha)}."""
    g = torch.Generator().manual_seed(seed)
    sd, made = {}, {}
    for m in modules:
        t = factors(kind, m, g)
        made[m] = (t, alpha)
        sd.update({f"{key(m)}.{p}": v.contiguous() for p, v in t.items()})
        if alpha is not None:
            sd[f"{key(m)}.alpha"] = torch.tensor(alpha)
    sd.update(extra or {})
    save_file(sd, str(path))
    return str(path), made


def merged_reference(w0, made_strengths):
    acc = w0.double()
    for (t, alpha), s in made_strengths:
        acc = acc + s * reference_delta(t, alpha, w0.shape)
    return acc.to(w0.dtype)


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
@pytest.mark.parametrize("kind", ["lokr_full", "lokr_decomposed", "loha", "loha_wide"])
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
    ys = {}
    for s in (1.0, 0.5, 1.0):
        eng.set_loras([(path, s)])
        ref.set_loras([(path, s)])
        with torch.no_grad():
            ys[s] = eng.model(*x)
            torch.testing.assert_close(ys[s], ref.model(*x), rtol=1e-4, atol=1e-5)
    assert C.graph_count() == g0 + 1  # one more block graph for the side path; strengths reuse it
    assert not torch.equal(ys[1.0], y0) and not torch.equal(ys[0.5], ys[1.0])
    eng.set_loras([])
    with torch.no_grad():
        assert torch.equal(eng.model(*x), y0)


# -- the layouts trainers with ERNIE-Image support write (docs/lora.md, "Trainers") --------------------------
def _flat(prefix):
    return lambda m: prefix + m.replace(".", "_")


def _lora_pairs(sd, m, a, b, down_key, up_key, alpha_key=None, alpha=None):
    sd[down_key] = a.contiguous()
    sd[up_key] = b.contiguous()
    if alpha_key:
        sd[alpha_key] = torch.tensor(alpha)


TRAINERS = {
    # ostris/ai-toolkit: PEFT names with the ComfyUI prefix (lora_keys_use_comfy_prefix); LoKr keeps .alpha
    "ai-toolkit": ("lokr_decomposed", lambda m: "diffusion_model." + m,
                   lambda m: (f"diffusion_model.{m}.lora_A.weight", f"diffusion_model.{m}.lora_B.weight", None)),
    # ai-toolkit's old LoKr format: lycoris_ flat names
    "ai-toolkit-old-lokr": ("lokr_full", _flat("lycoris_"), None),
    # Nerogar/OneTrainer: legacy (kohya) keys under lora_unet_; LoHa / LoKr keys lose their dot in that conversion
    "onetrainer": ("loha", None, lambda m: (_flat("lora_unet_")(m) + ".lora_down.weight",
                                            _flat("lora_unet_")(m) + ".lora_up.weight", _flat("lora_unet_")(m) + ".alpha")),
    "onetrainer-lokr": ("lokr_decomposed", None, None),
    # kohya-ss/musubi-tuner: lora_unet_ (networks/lora_ernie_image.py), LoKr with a top-level lokr_factor buffer
    "musubi-tuner": ("lokr_decomposed", _flat("lora_unet_"),
                     lambda m: (_flat("lora_unet_")(m) + ".lora_down.weight", _flat("lora_unet_")(m) + ".lora_up.weight",
                                _flat("lora_unet_")(m) + ".alpha")),
    # modelscope/DiffSynth-Studio: PEFT's injected names, bare (its DiT has the diffusers module names)
    "diffsynth": (None, None, lambda m: (f"{m}.lora_A.default.weight", f"{m}.lora_B.default.weight", None)),
    # bghira/SimpleTuner: diffusers PEFT (transformer.), LyCORIS LoKr (its default) as lycoris_ flat names
    "simpletuner": ("lokr_full", _flat("lycoris_"),
                    lambda m: (f"transformer.{m}.lora_A.weight", f"transformer.{m}.lora_B.weight", None)),
}


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_trainer_layouts_load_every_key(tmp_path, trainer):
    kind, lyco_key, lora_keys = TRAINERS[trainer]
    eng = tiny_engine(torch.bfloat16)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    modules = LINEARS[:4]
    with torch.inference_mode():
        if kind is not None:
            extra = {"lokr_factor": torch.tensor(-1)} if trainer == "musubi-tuner" else None
            if trainer.startswith("onetrainer"):  # "lora_unet_layers_0_mlp_gate_proj_hada_w1_a"
                path, made = lycoris_file(tmp_path / "l.safetensors", kind, modules, key=_flat("lora_unet_"))
                sd = {k.replace(".hada_", "_hada_").replace(".lokr_", "_lokr_"): v for k, v in load_file(path).items()}
                assert all(k.count(".") == 0 for k in sd if "_hada_" in k or "_lokr_" in k)
                save_file(sd, path)
            else:
                path, made = lycoris_file(tmp_path / "l.safetensors", kind, modules, key=lyco_key, extra=extra)
            assert eng.set_loras([(path, 1.0)]) == [], trainer
            for m in modules:
                k = m + ".weight"
                close_to_reference(eng.model.state_dict()[k], merged_reference(base[k], [(made[m], 1.0)]))
            eng.set_loras([])
        if lora_keys is not None:
            g = torch.Generator().manual_seed(4)
            sd = {}
            pairs = {}
            for m in modules:
                o, i = shape_of(m)
                a, b = torch.randn(4, i, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1
                pairs[m] = (a, b)
                down, up, alpha = lora_keys(m)
                _lora_pairs(sd, m, a, b, down, up, alpha, 8.0)
            save_file(sd, str(tmp_path / "lora.safetensors"))
            assert eng.set_loras([(str(tmp_path / "lora.safetensors"), 1.0)]) == [], trainer
            for m in modules:
                k = m + ".weight"
                a, b = pairs[m]
                scale = 2.0 if lora_keys(m)[2] else 1.0
                ref = (base[k].double() + scale * b.double() @ a.double()).to(base[k].dtype)
                close_to_reference(eng.model.state_dict()[k], ref)
            eng.set_loras([])
    assert all(torch.equal(v, base[k]) for k, v in eng.model.state_dict().items())


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


def test_lora_loader_node_applies_a_lokr_file(pack):
    path, made = lycoris_file(pack.loras / "lokr.safetensors", "lokr_decomposed", LINEARS[:2])
    node = pack.node.SGLDiffusionLoraLoader()
    base = pack.mc.SGLDModel(pack.path, pack.EngineConfig(), owner="1")
    with torch.inference_mode():
        eng = base.engine()
        w0 = {m: target_modules(eng.model)[m].weight.clone() for m in LINEARS[:2]}
        handle = node.load(base, "lokr.safetensors", 0.5)[0]
        assert handle.engine() is eng
        for m in LINEARS[:2]:
            close_to_reference(target_modules(eng.model)[m].weight, merged_reference(w0[m], [(made[m], 0.5)]))
        base.engine()
        assert all(torch.equal(target_modules(eng.model)[m].weight, w0[m]) for m in LINEARS[:2])


# -- against ComfyUI's own code ---------------------------------------------------------------------------------
COMFY_MERGE = """
import sys
base_file, jobs, sys.argv = sys.argv[1], sys.argv[2:], [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.lora
from safetensors.torch import load_file, save_file
base = load_file(base_file)
to_load = {"lycoris_" + k[: -len(".weight")].replace(".", "_"): k for k in base}
for lora_file, out_file in zip(jobs[::2], jobs[1::2]):
    patches = comfy.lora.load_lora(load_file(lora_file), to_load)
    save_file({k: comfy.lora.calculate_weight([(0.7, patches[k], 1.0, None, None)], base[k].clone(), k) for k in base},
              out_file)
"""


def test_merge_equals_comfyuis_own_weight_adapters(tmp_path):
    """comfy.lora.load_lora + calculate_weight of the vendored ComfyUI (its LoKrAdapter / LoHaAdapter), in one
    subprocess, on the same float32 weights: our merge gives the same weights (float32 rounding apart). Where
    ComfyUI fails (torch.kron on the LoKr Tucker einsum's non-contiguous result: it logs an error and leaves the
    weight), ComfyUI's weight is the base and ours is the hand merge (docs/lora.md)."""
    import os
    import subprocess
    import sys

    import comfy_server as cs

    eng = tiny_engine(torch.float32)
    modules = LINEARS + [CONV]
    base = {m + ".weight": target_modules(eng.model)[m].weight.detach().clone().contiguous() for m in modules}
    save_file(base, str(tmp_path / "base.safetensors"))
    jobs, made = [], {}
    for kind in KINDS:
        path, made[kind] = lycoris_file(tmp_path / f"{kind}.safetensors", kind, modules)
        jobs += [path, str(tmp_path / f"{kind}-comfy.safetensors")]
    comfy_dir = cs.ensure_comfyui()
    subprocess.run([sys.executable, "-c", COMFY_MERGE, str(tmp_path / "base.safetensors")] + jobs, cwd=comfy_dir,
                   check=True, timeout=300, env=dict(os.environ, PYTHONPATH=comfy_dir), capture_output=True)
    with torch.inference_mode():
        for kind in KINDS:
            theirs = load_file(str(tmp_path / f"{kind}-comfy.safetensors"))
            assert eng.set_loras([(str(tmp_path / f"{kind}.safetensors"), 0.7)]) == []
            for m in modules:
                k, ours = m + ".weight", target_modules(eng.model)[m].weight
                if kind == "lokr_tucker" and m == CONV:
                    assert torch.equal(theirs[k], base[k])  # ComfyUI's failure, logged and skipped
                    close_to_reference(ours, merged_reference(base[k], [(made[kind][m], 0.7)]))
                    continue
                assert not torch.equal(theirs[k], base[k]), (kind, m)  # ComfyUI applied it
                torch.testing.assert_close(ours, theirs[k], rtol=1e-5, atol=1e-6)
        eng.set_loras([])
