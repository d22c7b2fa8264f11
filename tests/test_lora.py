"""LoRA (engine/lora.py): every key format against a merge computed here, stacking and strengths, exact
restore (hash of every weight), unmatched keys reported, other architectures and pickles refused,
FP8/INT4 side path, offload, torch.compile, the ComfyUI handle (one base for two LoRA sets, measured),
the CLI flag, and a LoRA trained here on the demo model that the demo judge sees."""
import hashlib
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine import Engine, EngineConfig
from engine.lora import LoRAError, parse_spec, read_lora
from engine.random_weights import SIZES, random_model

CFG = SIZES["tiny"]
H, FFN = CFG.hidden_size, CFG.ffn_hidden_size


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shape_of(name):
    if name.endswith("linear_fc2"):
        return (H, FFN)
    if name.endswith(("gate_proj", "up_proj")):
        return (FFN, H)
    if name == "x_embedder.proj":
        return (H, CFG.in_channels)
    if name == "adaLN_modulation.1":
        return (6 * H, H)
    if name == "text_proj":
        return (H, CFG.text_in_dim)
    return (H, H)


def make_pairs(modules, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        o, i = shape_of(m)
        out[m] = (torch.randn(rank, i, generator=g) * 0.1, torch.randn(o, rank, generator=g) * 0.1)  # (A, B)
    return out


MODULES = ["layers.0.self_attention.to_q", "layers.1.self_attention.to_out.0", "layers.0.mlp.gate_proj",
           "layers.1.mlp.linear_fc2", "adaLN_modulation.1", "text_proj", "x_embedder.proj"]


def kohya_name(m):
    return "lora_unet_" + m.replace(".", "_")


# format -> (key of A, key of B, key of alpha or None) for module m
FORMATS = {
    "diffusers": (lambda m: f"transformer.{m}.lora_A.weight", lambda m: f"transformer.{m}.lora_B.weight", None),
    "peft_base_model": (lambda m: f"base_model.model.{m}.lora_A.weight", lambda m: f"base_model.model.{m}.lora_B.weight", None),
    "ai_toolkit": (lambda m: f"diffusion_model.{m}.lora_A.weight", lambda m: f"diffusion_model.{m}.lora_B.weight", None),
    "kohya": (lambda m: kohya_name(m) + ".lora_down.weight", lambda m: kohya_name(m) + ".lora_up.weight",
              lambda m: kohya_name(m) + ".alpha"),
    "comfy_generic": (lambda m: f"diffusion_model.{m}.lora_down.weight", lambda m: f"diffusion_model.{m}.lora_up.weight",
                      lambda m: f"diffusion_model.{m}.alpha"),
    "peft_default": (lambda m: f"transformer.{m}.lora_A.default.weight", lambda m: f"transformer.{m}.lora_B.default.weight", None),
    "diffusers_v3": (lambda m: f"{m}.lora.down.weight", lambda m: f"{m}.lora.up.weight", None),
    "diffusers_old": (lambda m: f"{m}_lora.down.weight", lambda m: f"{m}_lora.up.weight", None),
    "mochi": (lambda m: f"diffusion_model.{m}.lora_A", lambda m: f"diffusion_model.{m}.lora_B", None),
    "onetrainer": (lambda m: "lora_transformer_" + m.replace(".", "_") + ".lora_down.weight",
                   lambda m: "lora_transformer_" + m.replace(".", "_") + ".lora_up.weight", None),
}


def write_lora(path, pairs, fmt, alpha=None, dtype=torch.bfloat16, extra=None):
    ka, kb, kalpha = FORMATS[fmt]
    sd = {}
    for m, (a, b) in pairs.items():
        if m == "x_embedder.proj":  # a conv: kohya/ComfyUI store 4-d conv LoRA weights
            a, b = a[:, :, None, None], b[:, :, None, None]
        sd[ka(m)] = a.to(dtype).contiguous()
        sd[kb(m)] = b.to(dtype).contiguous()
        if kalpha and alpha is not None:
            sd[kalpha(m)] = torch.tensor(float(alpha))
    sd.update(extra or {})
    save_file(sd, str(path))
    return str(path)


def reference_merge(w0, pairs_strengths):
    """W0 + sum s * scale * B @ A in float64, rounded once to W0's dtype (computed without engine.lora)."""
    acc = w0.double().reshape(w0.shape[0], -1)
    for (a, b), s in pairs_strengths:
        acc = acc + s * (b.to(torch.bfloat16).double() @ a.to(torch.bfloat16).double())
    return acc.reshape(w0.shape).to(w0.dtype)


def tiny_engine(dtype=torch.float32, **cfg):
    return Engine(random_model(CFG, seed=0, dtype=dtype), EngineConfig(**cfg))


def close_to_reference(got, ref):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:  # one rounding to bf16 from float32 vs float64: at most one ulp apart, almost always equal
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
        assert (got == ref).float().mean() > 0.99


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


def test_stacked_strengths_switch_and_exact_restore(tmp_path):
    eng = tiny_engine(torch.bfloat16)
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
    st = eng.model.__dict__["_sgld_lora"]
    assert not st.backups and st.backup_bytes == 0  # nothing kept once the base is back
    fresh = tiny_engine(torch.bfloat16)
    fresh.set_loras([(a, 0.3)])
    assert weights_hash(fresh.model) == h_a03  # a switch gives what a fresh application gives
    eng.set_loras([(a, 1.0), (b, -0.5)])
    assert weights_hash(eng.model) == h_ab
    eng.set_loras([(a, 0.0)])  # strength 0 = off
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
    big = {"diffusion_model.layers.0.self_attention.to_q.lora_A.weight": torch.zeros(4, 2 * H),
           "diffusion_model.layers.0.self_attention.to_q.lora_B.weight": torch.zeros(2 * H, 4)}
    save_file(big, str(tmp_path / "big.safetensors"))
    with pytest.raises(LoRAError, match="another size"):
        eng.set_loras([(str(tmp_path / "big.safetensors"), 1.0)])
    assert eng.model.__dict__.get("_sgld_lora") is None or not eng.model.__dict__["_sgld_lora"].backups


def inputs(seed=1, b=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, CFG.in_channels, 4, 4, generator=g)
    text = torch.randn(b, 5, CFG.text_in_dim, generator=g)
    return x, torch.tensor([500.0] * b), text, torch.tensor([5] * b)


@pytest.mark.parametrize("quant", ["fp8", "int4-g64"])
def test_quantized_layers_get_an_unmerged_side_path(tmp_path, quant):
    from engine.quant import QUANT_MODULES

    eng = tiny_engine(torch.float32, quant=quant)
    h0 = weights_hash(eng.model)
    x = inputs()
    with torch.no_grad():
        y0 = eng.model(*x)
    pairs = make_pairs(MODULES, seed=5)
    path = write_lora(tmp_path / "q.safetensors", pairs, "diffusers")
    eng.set_loras([(path, 0.8)])
    st = eng.model.__dict__["_sgld_lora"]
    q = [m for m in MODULES if isinstance(eng.model.get_submodule(m), QUANT_MODULES)]
    assert sorted(st.hooks) == sorted(q) and len(q) == 4  # block linears: side path; the rest merged
    assert sorted(st.backups) == sorted(set(MODULES) - set(q))
    # each quantized layer computes dequantized W x + 0.8 B A x
    xin = torch.randn(3, shape_of(q[0])[1])
    mod = eng.model.get_submodule(q[0])
    a, b = pairs[q[0]]
    ref = F.linear(xin, mod.dequantize()) + 0.8 * F.linear(F.linear(xin, a.bfloat16().float()), b.bfloat16().float())
    torch.testing.assert_close(mod(xin), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        y1 = eng.model(*x)
    assert (y1 - y0).abs().max() > 1e-3
    eng.set_loras([])
    assert weights_hash(eng.model) == h0 and not st.hooks
    with torch.no_grad():
        assert torch.equal(eng.model(*x), y0)


def test_offload_streams_the_merged_weights(tmp_path):
    ref = tiny_engine(torch.bfloat16)
    off = tiny_engine(torch.bfloat16, offload="layerwise", resident_layers=2)
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
    from engine import compile as C

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


def test_parse_spec_and_cli_flag(tmp_path, monkeypatch):
    assert parse_spec("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert parse_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert parse_spec(r"C:\loras\a.safetensors") == (r"C:\loras\a.safetensors", 1.0)
    assert parse_spec("dir/x:y.safetensors:-1") == ("dir/x:y.safetensors", -1.0)
    from engine import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "p", "--lora", "a.safetensors:0.5", "--lora", "b.safetensors"])
    assert cli.lora_specs(args) == [("a.safetensors", 0.5), ("b.safetensors", 1.0)]
