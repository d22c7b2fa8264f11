"""LoRA (engine/features/lora): every key format against a merge computed here, stacking and strengths, exact
restore (hash of every weight), unmatched keys reported, other architectures and pickles refused,
FP8/INT4 side path, offload, torch.compile, the ComfyUI handle (one base for two LoRA sets, measured),
the CLI flag, and a LoRA trained on the demo model (tools/demo/train_lora.py) that the demo judge sees."""
import os

import pytest
import torch
import torch.nn.functional as F
from lora_files import (
    BLOCK_LINEARS,
    CFG,
    FORMATS,
    MODULES,
    H,
    check_compiled_side_path,
    close_to_reference,
    inputs,
    make_pairs,
    reference_merge,
    shape_of,
    text_features,
    tiny_engine,
    weights_hash,
    write_lora,
)
from safetensors.torch import save_file

from engine import Engine, open_engine
from engine.features import patching
from engine.features.lora import LoRAError, parse_spec, read_lora, target_modules
from engine.models.random_weights import random_model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_matches_an_independent_merge(tmp_path, fmt):
    eng = tiny_engine(torch.bfloat16)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    pairs = make_pairs(MODULES, rank=4, seed=1)
    alpha = 2.0 if FORMATS[fmt][2] else None
    path = write_lora(tmp_path / f"{fmt}.safetensors", pairs, fmt, alpha=alpha)
    assert eng.set_loras([(path, 0.7)]) == []  # every key used
    scale = (alpha / 4) if alpha else 1.0
    sd = eng.model.state_dict()
    touched = {m + ".weight" for m in MODULES}
    for k, v in sd.items():
        if k in touched:
            m = k[: -len(".weight")]
            close_to_reference(v, reference_merge(base[k], [(pairs[m], 0.7 * scale)]))
            assert not torch.equal(v, base[k])
        else:
            assert torch.equal(v, base[k]), k
    eng.set_loras([])
    assert all(torch.equal(v, base[k]) for k, v in eng.model.state_dict().items())


def test_peft_alpha_from_diffusers_metadata_and_adapter_config(tmp_path):
    import json

    pairs = make_pairs(MODULES[:4], seed=15)
    sd = {f"transformer.{m}.lora_A.weight": a.contiguous() for m, (a, b) in pairs.items()}
    sd.update({f"transformer.{m}.lora_B.weight": b.contiguous() for m, (a, b) in pairs.items()})
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 8,
                                                 "transformer.alpha_pattern": {"self_attention.to_q": 2}})}
    save_file(sd, str(tmp_path / "diffusers_meta.safetensors"), metadata=meta)
    model = random_model(CFG)
    lf = read_lora(str(tmp_path / "diffusers_meta.safetensors"), model)
    assert {m: e.scale for m, e in lf.entries.items()} == {MODULES[0]: 0.5, MODULES[1]: 2.0, MODULES[2]: 2.0, MODULES[3]: 2.0}
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    save_file({k.replace("transformer.", "base_model.model.", 1): v for k, v in sd.items()}, str(peft_dir / "adapter_model.safetensors"))
    (peft_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16, "use_rslora": True}))
    lf = read_lora(str(peft_dir / "adapter_model.safetensors"), model)
    assert all(e.scale == 16 / 2 for e in lf.entries.values())  # rsLoRA: alpha / sqrt(rank)
    eng = tiny_engine()
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.set_loras([(str(tmp_path / "diffusers_meta.safetensors"), 1.0)])
    k = MODULES[1] + ".weight"
    a, b = pairs[MODULES[1]]
    torch.testing.assert_close(eng.model.state_dict()[k], base[k] + 2.0 * b @ a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,restore", [(torch.bfloat16, "compact"), (torch.float16, "compact"), (torch.bfloat16, "copy")])
def test_stacked_strengths_switch_and_exact_restore(tmp_path, dtype, restore, monkeypatch):
    monkeypatch.setenv("SGLD_LORA_RESTORE", restore)
    eng = tiny_engine(dtype)
    with torch.no_grad():  # elements a LoRA flips in sign or changes by 2x or more: the sparse exceptions
        target_modules(eng.model)["layers.0.self_attention.to_q"].weight[:4] = torch.tensor([0.0, -0.0, 1e-4, -3e-3]).to(dtype)[:, None]
    h0 = weights_hash(eng.model)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    pa = make_pairs(MODULES[:4], seed=2)
    pb = make_pairs(MODULES[2:], seed=3, rank=8)
    a = write_lora(tmp_path / "a.safetensors", pa, "kohya", alpha=8.0)  # scale 2
    b = write_lora(tmp_path / "b.safetensors", pb, "diffusers")
    eng.set_loras([(a, 1.0), (b, -0.5)])
    for m in MODULES:
        k = m + ".weight"
        parts = ([(pa[m], 2.0)] if m in pa else []) + ([(pb[m], -0.5)] if m in pb else [])
        close_to_reference(eng.model.state_dict()[k], reference_merge(base[k], parts))
    h_ab = weights_hash(eng.model)
    eng.set_loras([(a, 1.0), (b, -0.5)])  # same set: nothing to do
    assert weights_hash(eng.model) == h_ab
    eng.set_loras([(a, 0.3)])  # strength change + removal of b, from the kept originals
    h_a03 = weights_hash(eng.model)
    eng.set_loras([])
    assert weights_hash(eng.model) == h0  # bit-exact base
    assert patching.get(eng.model, "lora") is None  # nothing kept once the base is back
    fresh = tiny_engine(dtype)
    with torch.no_grad():
        target_modules(fresh.model)["layers.0.self_attention.to_q"].weight.copy_(base["layers.0.self_attention.to_q.weight"])
    fresh.set_loras([(a, 0.3)])
    assert weights_hash(fresh.model) == h_a03  # a switch gives what a fresh application gives
    eng.set_loras([(a, 1.0), (b, -0.5)])
    assert weights_hash(eng.model) == h_ab
    monkeypatch.setenv("SGLD_LORA_RESTORE", "copy" if restore == "compact" else "compact")
    eng.set_loras([(a, 1.0), (b, 0.5)])  # the other kind of record, switched between calls
    monkeypatch.setenv("SGLD_LORA_RESTORE", restore)
    eng.set_loras([(a, 1.0), (b, -0.5)])
    assert weights_hash(eng.model) == h_ab
    if restore == "compact":
        assert sum(r.exceptions() for r in patching.get(eng.model, "lora").backups.values()) > 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # the restore is integer arithmetic: no GEMM involved
    try:
        eng.set_loras([(a, 0.0)])  # strength 0 = off
    finally:
        torch.set_num_threads(threads)
    assert weights_hash(eng.model) == h0


def test_unmatched_keys_are_reported_not_dropped(tmp_path, caplog):
    eng = tiny_engine()
    pairs = make_pairs(MODULES[:2], seed=4)
    extra = {f"diffusion_model.layers.{i}.self_attention.to_qkv.lora_A.weight": torch.zeros(4, H) for i in range(5)}
    extra["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    extra["diffusion_model.layers.0.self_attention.to_q.dora_scale"] = torch.ones(1, H)
    path = write_lora(tmp_path / "partial.safetensors", pairs, "ai_toolkit", extra=extra)
    with caplog.at_level("WARNING", logger="sgld.lora"):
        report = eng.set_loras([(path, 1.0)])
    assert len(report) == 2
    assert "6 of its keys match no layer" in report[0] and "to_qkv" in report[0] and "1 of them are text-encoder keys" in report[0]
    assert "DoRA" in report[1]
    assert "6 of its keys match no layer" in caplog.text
    assert eng.lora_report == report and eng.loras == [(path, 1.0)]


def test_other_architectures_pickles_and_wrong_shapes_are_refused(tmp_path):
    eng = tiny_engine()
    g = torch.Generator().manual_seed(0)
    flux = {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": torch.randn(4, 64, generator=g) for i in range(3)}
    flux.update({f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_up.weight": torch.randn(192, 4, generator=g) for i in range(3)})
    save_file(flux, str(tmp_path / "flux.safetensors"))
    with pytest.raises(LoRAError, match=r"not a LoRA for ERNIE-Image: none of its 6 keys.*Flux"):
        eng.set_loras([(str(tmp_path / "flux.safetensors"), 1.0)])
    sdxl = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8),
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 4)}
    save_file(sdxl, str(tmp_path / "sdxl.safetensors"))
    with pytest.raises(LoRAError, match="Stable Diffusion"):
        eng.set_loras([(str(tmp_path / "sdxl.safetensors"), 1.0)])
    torch.save({"x": torch.zeros(1)}, str(tmp_path / "evil.safetensors"))  # a pickle in disguise
    with pytest.raises(LoRAError, match="pickle"):
        eng.set_loras([(str(tmp_path / "evil.safetensors"), 1.0)])
    (tmp_path / "lora.pt").write_bytes(b"\x80\x04junk")
    with pytest.raises(LoRAError, match="pickle"):
        eng.set_loras([(str(tmp_path / "lora.pt"), 1.0)])
    oft = {"lora_unet_layers_0_self_attention_to_q.oft_blocks": torch.zeros(4, 16, 16)}
    save_file(oft, str(tmp_path / "oft.safetensors"))
    with pytest.raises(LoRAError, match="adapter for ERNIE-Image uses OFT, which this engine does not apply"):
        eng.set_loras([(str(tmp_path / "oft.safetensors"), 1.0)])
    loha = {f"lora_unet_layers_0_self_attention_to_q.hada_w{i}_{ab}": torch.zeros(4, H) for i in (1, 2) for ab in "ab"}
    save_file(loha, str(tmp_path / "loha.safetensors"))  # LoHa is applied (tests/lora/test_lycoris.py); these shapes are not one
    with pytest.raises(LoRAError, match=r"loha.safetensors: layer 'layers.0.self_attention.to_q'.*are not a low-rank pair"):
        eng.set_loras([(str(tmp_path / "loha.safetensors"), 1.0)])
    big = {"diffusion_model.layers.0.self_attention.to_q.lora_A.weight": torch.zeros(4, 2 * H),
           "diffusion_model.layers.0.self_attention.to_q.lora_B.weight": torch.zeros(2 * H, 4)}
    save_file(big, str(tmp_path / "big.safetensors"))
    with pytest.raises(LoRAError, match="another size"):
        eng.set_loras([(str(tmp_path / "big.safetensors"), 1.0)])
    assert patching.get(eng.model, "lora") is None




@pytest.mark.parametrize("quant", ["fp8", "int4-g64"])
def test_quantized_layers_get_an_unmerged_side_path(tmp_path, quant):
    from engine.features.quant import QUANT_MODULES

    eng = tiny_engine(torch.float32, quant=quant)
    h0 = weights_hash(eng.model)
    x = inputs()
    with torch.no_grad():
        y0 = eng.model(*x)
    pairs = make_pairs(MODULES, seed=5)
    path = write_lora(tmp_path / "q.safetensors", pairs, "diffusers")
    eng.set_loras([(path, 0.8)])
    st = patching.get(eng.model, "lora")
    targets = target_modules(eng.model)  # checkpoint names; to_q and gate_proj are rows of fused modules
    physical = {m: getattr(targets[m], "module", targets[m]) for m in MODULES}
    q = [m for m in MODULES if isinstance(physical[m], QUANT_MODULES)]
    assert sorted(st.side_paths) == sorted(q) and len(q) == 4  # block linears: side path; the rest merged
    assert all(type(physical[m]).__name__.endswith("WithLoRA") for m in q)
    assert sorted(st.backups) == sorted(set(MODULES) - set(q))
    # each quantized layer computes dequantized W x + 0.8 B A x (in its own rows of a fused module)
    for name in q:
        xin = torch.randn(3, shape_of(name)[1])
        mod, rows = physical[name], slice(getattr(targets[name], "start", 0), getattr(targets[name], "stop", None))
        a, b = pairs[name]
        ref = F.linear(xin, mod.dequantize()[rows]) + 0.8 * F.linear(F.linear(xin, a.bfloat16().float()), b.bfloat16().float())
        torch.testing.assert_close(mod(xin)[:, rows], ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        y1 = eng.model(*x)
    assert (y1 - y0).abs().max() > 1e-3
    eng.set_loras([])
    assert weights_hash(eng.model) == h0 and not st.side_paths and patching.get(eng.model, "lora") is None
    with torch.no_grad():
        assert torch.equal(eng.model(*x), y0)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_offload_streams_the_merged_weights(tmp_path, quant):
    ref = tiny_engine(torch.bfloat16, quant=quant)
    off = tiny_engine(torch.bfloat16, quant=quant, offload="layerwise", resident_layers=2)
    assert off.offload is not None
    path = write_lora(tmp_path / "o.safetensors", make_pairs(MODULES, seed=6), "kohya", alpha=2.0)
    x = inputs()
    with torch.no_grad():
        y0 = off.model(*x)  # fills the device buffers with the base weights
    h0 = weights_hash(off.model)
    for e in (ref, off):
        e.set_loras([(path, 1.0)])
    with torch.no_grad():
        y_ref, y_off = ref.model(*x), off.model(*x)
    assert torch.equal(y_ref, y_off) and not torch.equal(y_off, y0)  # the buffers were refilled
    off.set_loras([])
    assert weights_hash(off.model) == h0
    with torch.no_grad():
        assert torch.equal(off.model(*x), y0)


def test_compiled_blocks_do_not_recompile_for_merged_swaps(tmp_path):
    from engine.features import compile as C

    eng = tiny_engine(torch.float32)
    C.compile_blocks(eng.model, "static", backend="aot_eager")
    x = inputs()
    C.reset_counters()
    with torch.no_grad():
        y0 = eng.model(*x)
    graphs = C.graph_count()
    assert graphs >= 1
    a = write_lora(tmp_path / "a.safetensors", make_pairs(MODULES, seed=7), "diffusers")
    b = write_lora(tmp_path / "b.safetensors", make_pairs(MODULES, seed=8, rank=8), "kohya", alpha=4.0)
    ys = []
    for loras in ([(a, 1.0)], [(a, 0.5), (b, 1.0)], [(b, 2.0)], []):
        eng.set_loras(loras)
        with torch.no_grad():
            ys.append(eng.model(*x))
    assert C.graph_count() == graphs  # weights are graph inputs changed in place: no recompilation
    assert torch.equal(ys[-1], y0) and not torch.equal(ys[0], y0)
    eager = tiny_engine(torch.float32)
    eager.set_loras([(a, 0.5), (b, 1.0)])
    with torch.no_grad():
        torch.testing.assert_close(eager.model(*x), ys[1], rtol=1e-4, atol=1e-5)




def test_compiled_quantized_blocks_see_the_side_path(tmp_path):
    """A forward hook would be ignored by a compiled block (dynamo skips hook guards); the class swap is not."""
    from engine.features import compile as C

    eng = tiny_engine(torch.float32, quant="fp8")
    C.compile_blocks(eng.model, "static", backend="aot_eager")
    x = inputs()
    C.reset_counters()
    with torch.no_grad():
        y0 = eng.model(*x)
    g0 = C.graph_count()
    a = write_lora(tmp_path / "a.safetensors", make_pairs(BLOCK_LINEARS, seed=11), "diffusers")
    ref = tiny_engine(torch.float32, quant="fp8")
    check_compiled_side_path(eng, ref, a, x, y0, C, g0)
    assert C.graph_count() == g0 + 1  # back to the first graph


def test_parse_spec_and_cli_flag(tmp_path, monkeypatch):
    assert parse_spec("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert parse_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert parse_spec(r"C:\loras\a.safetensors") == (r"C:\loras\a.safetensors", 1.0)
    assert parse_spec("dir/x:y.safetensors:-1") == ("dir/x:y.safetensors", -1.0)
    from engine import cli
    from engine.cli.generate import lora_specs

    args = cli.build_parser().parse_args(["generate", "--prompt", "p", "--lora", "a.safetensors:0.5", "--lora", "b.safetensors"])
    assert lora_specs(args) == [("a.safetensors", 0.5), ("b.safetensors", 1.0)]






def test_node_chain_two_graphs_share_one_base(pack, tmp_path):
    mc = pack.mc
    a = write_lora(pack.loras / "style_a.safetensors", make_pairs(MODULES, seed=9), "ai_toolkit")
    b = write_lora(pack.loras / "style_b.safetensors", make_pairs(MODULES[:3], seed=10), "kohya", alpha=2.0)
    node = pack.node.SGLDiffusionLoraLoader()
    assert "style_a.safetensors" in pack.node.SGLDiffusionLoraLoader.INPUT_TYPES()["required"]["lora_name"][0]
    base = mc.SGLDModel(pack.path, pack.EngineConfig(dtype="bf16"), owner="1")  # bf16: compact restore records
    g1 = node.load(node.load(base, "style_a.safetensors", 1.0)[0], "style_b.safetensors", 0.5)[0]  # chained
    g2 = node.load(base, "style_b.safetensors", -1.0)[0]  # another graph, same base
    assert base.loras == () and g1.loras == ((a, 1.0), (b, 0.5)) and g2.loras == ((b, -1.0),)
    x = inputs()

    def run(handle):
        eng = handle.engine()  # what SGLDiffusion KSampler calls
        with torch.no_grad():
            return eng, eng.model(*x), weights_hash(eng.model)

    e0, y0, h0 = run(base)
    e1, y1, h1 = run(g1)
    e2, y2, h2 = run(g2)
    assert e0 is e1 is e2 and len(mc.loaded()) == 1  # one engine, one copy of the base weights
    assert len({h0, h1, h2}) == 3 and not torch.equal(y1, y0) and not torch.equal(y2, y1)
    assert run(g1)[2] == h1 and run(base)[2] == h0 and run(g2)[2] == h2  # switching back and forth is exact
    assert mc.loaded()[0]["loras"] == [["style_b.safetensors", -1.0]]  # what the engine holds now (status route)
    # memory: the weights held are the base once plus the originals of the layers the active set touches
    model = e0.model
    base_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    st = patching.get(model, "lora")
    numel = sum(target_modules(model)[m].weight.numel() for m in MODULES[:3])
    assert numel <= st.backup_bytes < 2 * numel  # bf16: ~1 byte per touched weight restores it, not a 2-byte copy
    stores = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    assert sum(stores.values()) == base_bytes  # no tensor duplicated inside the model (fused parts share a storage)
    print(f"\nmemory: 2 graphs with different LoRAs hold {(base_bytes + st.backup_bytes) / 2**20:.3f} MiB "
          f"(base {base_bytes / 2**20:.3f} MiB once + {st.backup_bytes / 2**20:.3f} MiB to restore the "
          f"{2 * numel / 2**20:.3f} MiB of touched layers) vs {2 * base_bytes / 2**20:.3f} MiB for two copies")
    run(base)
    assert st.backup_bytes == 0 and patching.get(model, "lora") is None


def test_node_reports_wrong_files_on_the_node(pack):
    base = pack.mc.SGLDModel(pack.path, pack.EngineConfig(), owner="1")
    node = pack.node.SGLDiffusionLoraLoader()
    with pytest.raises(ValueError, match="was not found in"):
        node.load(base, "missing.safetensors", 1.0)
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(8, 4)}, str(pack.loras / "flux.safetensors"))
    with pytest.raises(ValueError, match="SGLDiffusion LoRA Loader: .*not a LoRA for ERNIE-Image.*Flux"):
        node.load(base, "flux.safetensors", 1.0)


# -- a LoRA trained on the demo model (tools/demo/train_lora.py): blue backgrounds rendered green ----------------
def test_lora_trained_on_the_demo_model_changes_what_the_judge_sees():
    """A LoRA trained on the demo (tools/demo/train_lora.py's file: blue-background captions drawn green, kohya's
    layout with alpha) read by the engine as any user's file: the judge sees blue without it and green with it, and
    switching it off gives the first pictures back bit-exactly."""
    import numpy as np

    from engine.models.demo import load_demo
    from tools.demo.judge import judge
    from tools.demo.train_lora import OUT, blue_scene

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core machine: one thread is several times faster
    try:
        demo = load_demo(cached=False)
        base_hash = weights_hash(demo.dit)
        demo.engine = Engine(demo.dit)
        path = OUT
        rng = np.random.default_rng(12345)
        captions = [blue_scene(rng).caption for _ in range(4)]
        green = [c.replace("on a blue background", "on a green background") for c in captions]

        def images():
            return demo.generate(captions, seed=7, steps=12)

        eng = demo.engine
        before = images()
        assert eng.set_loras([(path, 1.0)]) == []
        with_lora = images()
        eng.set_loras([])
        after = images()
        base_bg = [judge(im, c)["checks"]["background"] for im, c in zip(before, captions)]
        lora_bg = [judge(im, c)["checks"]["background"] for im, c in zip(with_lora, green)]
        print(f"\ndemo LoRA: judge background blue without it {sum(base_bg)}/4, "
              f"green with it {sum(lora_bg)}/4")
        assert sum(base_bg) >= 3 and sum(lora_bg) >= 3
        assert np.array_equal(after, before)  # removed: the original images, bit-exactly
        assert weights_hash(demo.dit) == base_hash
    finally:
        torch.set_num_threads(threads)


# -- in a real ComfyUI server ---------------------------------------------------------------------------------
@pytest.mark.server
def test_lora_loader_node_in_comfyui(tmp_path):
    """ComfyUI 0.3.75 with the pack: a chained LoRA graph gives what Engine.set_loras gives, a graph without
    the LoRA on the same base gives the plain model's result bit-exactly, and one engine is loaded."""
    import comfy_server as cs

    if not os.path.exists(os.path.join(cs.COMFY_DIR, ".sgld-ready")):
        pytest.skip("ComfyUI is not installed (scripts/comfyui.sh)")
    base = str(tmp_path / "comfy")
    ckpt = cs.base_with_tiny_model(base)
    a = write_lora(os.path.join(base, "models", "loras", "a.safetensors"), make_pairs(BLOCK_LINEARS, seed=12), "ai_toolkit")
    b = write_lora(os.path.join(base, "models", "loras", "b.safetensors"), make_pairs(BLOCK_LINEARS[:5], seed=13), "kohya", alpha=2.0)
    server = cs.start_server(base)
    try:
        info = server.get("/object_info/SGLDiffusionLoraLoader").json()["SGLDiffusionLoraLoader"]
        assert info["display_name"] == "SGLDiffusion LoRA Loader"
        assert info["input"]["required"]["lora_name"][0] == ["a.safetensors", "b.safetensors"]

        def graph(seed, loras=()):
            g = cs.tiny_graph("tiny.safetensors", seed=seed, steps=2, width=64, height=64, prefix=f"lora{seed}{len(loras)}")
            src = ["1", 0]
            for i, (name, s) in enumerate(loras):
                g[str(10 + i)] = {"class_type": "SGLDiffusionLoraLoader", "inputs": {"model": src, "lora_name": name, "strength": s}}
                src = [str(10 + i), 0]
            g["5"]["inputs"]["model"] = src
            return g

        outs = {}
        for key, seed, loras in (("base0", 0, ()), ("lora", 0, (("a.safetensors", 1.0), ("b.safetensors", 0.5))), ("base1", 1, ())):
            entry = server.run(graph(seed, loras))
            assert entry["status"]["status_str"] == "success", cs.error_message(entry)
            outs[key] = cs.saved_latent(server, entry)
        assert len(server.get("/sgldiffusion/models").json()["loaded"]) == 1  # one base for both graphs
    finally:
        server.stop()
    def direct(seed, loras=()):
        eng = open_engine(ckpt)
        eng.set_loras(list(loras))
        return eng.sample(torch.zeros(1, 128, 4, 4), [text_features(1, 7)], [text_features(2, 5)], seed=seed, steps=2, cfg=1.0)

    assert torch.equal(outs["base1"], direct(1))  # sampled after the LoRA graph: the base came back exactly
    assert torch.equal(outs["lora"], direct(0, [(a, 1.0), (b, 0.5)]))
    assert not torch.equal(outs["lora"], outs["base0"])




def test_sgld_generate_lora_flag(tmp_path, capsys):
    """``sgld generate --lora FILE:STRENGTH`` (repeatable) on the demo model: strength 0 is the plain image."""
    import json

    import numpy as np
    from PIL import Image

    from engine import cli
    from engine.models.demo import load_demo

    dit = load_demo().dit
    g = torch.Generator().manual_seed(14)
    sd = {}
    for n, m in target_modules(dit).items():  # checkpoint names, whether or not an engine fused the DiT
        if n.startswith("layers."):
            sd[f"transformer.{n}.lora_A.weight"] = torch.randn(4, m.in_features, generator=g) / m.in_features ** 0.5
            sd[f"transformer.{n}.lora_B.weight"] = torch.randn(m.out_features, 4, generator=g) * 0.3
    path = str(tmp_path / "demo_lora.safetensors")
    save_file(sd, path)
    threads = torch.get_num_threads()
    try:
        pics = {}
        for key, extra in (("plain", []), ("off", ["--lora", f"{path}:0"]), ("on", ["--lora", f"{path}:0.7", "--lora", f"{path}:0.3"])):
            out = str(tmp_path / f"{key}.png")
            assert cli.main(["generate", "--prompt", "a large red circle on the left, on a blue background", "--steps", "4",
                             "--threads", "1", "--out", out, "--json", *extra]) == 0
            json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            pics[key] = np.asarray(Image.open(out))
        assert np.array_equal(pics["plain"], pics["off"]) and not np.array_equal(pics["plain"], pics["on"])
        bad = cli.main(["generate", "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "x.png"), "--lora",
                        str(tmp_path / "missing.safetensors") + ":1"])
        assert bad == 2 and "missing.safetensors" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
