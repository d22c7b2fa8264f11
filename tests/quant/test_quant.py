"""FP8 / INT4 weight-only quantization: numerics, bytes, model error, `sgld quantize` round trips,
and ComfyUI fp8 checkpoints (legacy scaled_fp8 and the newer comfy_quant), built here the way
ComfyUI stores them."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine import CheckpointError, load_model, open_engine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.features import quant as Q
from engine.features.lora import target_modules
from engine.io.load import build_model
from engine.models.random_weights import SIZES, random_model, random_state_dict

CFG = SIZES["tiny"]


def inputs(seed=1, b=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, CFG.in_channels, 6, 6, generator=g)
    t = torch.tensor([400.0] * b)
    text = torch.randn(b, 9, CFG.text_in_dim, generator=g)
    return x, t, text, torch.tensor([9, 5][:b])


def forward(model, seed=1):
    with torch.no_grad():
        return model(*inputs(seed)).float()


def weight(n=96, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.01, 3.0, n)[:, None]  # rows of very different scale
    w[3, 7] = 40.0  # an outlier
    return w


# -- numerics -----------------------------------------------------------------------------------------------
def test_fp8_per_channel_round_trip():
    w = weight()
    q, s = Q.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (96,) and s.dtype == torch.float32
    assert q.float().abs().amax().item() <= 448.0
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((96,), 448.0))  # each row uses the full range
    deq = Q.dequantize_fp8(q, s)
    # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 relative per element (plus the subnormal floor of each row)
    floor = s * 2.0 ** -9
    assert ((deq - w).abs() <= w.abs() * 2.0 ** -4 + floor[:, None]).all()
    assert Q.relative_error(deq, w) < 0.03
    # per channel keeps small rows that one scale per tensor pushes into e4m3's subnormals
    w2 = w.clone()
    w2[0] *= 1e-3
    q2, s2 = Q.quantize_fp8(w2)
    s_t = w2.abs().amax() / 448
    per_tensor = (w2 / s_t).to(torch.float8_e4m3fn).float() * s_t
    assert Q.relative_error(Q.dequantize_fp8(q2, s2)[0], w2[0]) < 0.03
    assert Q.relative_error(per_tensor[0], w2[0]) > 0.3


@pytest.mark.parametrize("group", [64, 128])
def test_int4_groupwise_round_trip(group):
    w = weight()
    packed, scale, zero = Q.quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 128)
    assert scale.shape == zero.shape == (96, 256 // group) and scale.dtype == torch.bfloat16
    deq = Q.dequantize_int4(packed, scale, zero)
    # every weight is within half a step of its group's grid (steps rounded to bf16)
    step = scale.float().repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    assert Q.relative_error(deq, w) < 0.12
    # the values use the whole 0..15 range in every group (asymmetric min/max)
    q = Q.unpack_int4(packed).reshape(96, -1, group)
    assert (q.amin(-1) <= 1).all() and (q.amax(-1) >= 14).all()


def test_int4_packing_layout():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]  # even input index in the high nibble (torch int4pack order)
    assert torch.equal(Q.unpack_int4(packed), q)
    q[:, 0::32], q[:, 1::32] = 0, 15  # every group spans the full range: scale 0.5, zero 0.25
    w = (q.float() - 8) * 0.5 + 0.25  # on the grid: w = (q - 8) * scale + zero, so the round trip is exact
    p2, s2, z2 = Q.quantize_int4(w, 32)
    assert torch.equal(p2, (q[:, 0::2] << 4) | q[:, 1::2])
    assert torch.all(s2 == 0.5) and torch.all(z2 == 0.25)
    assert torch.equal(Q.dequantize_int4(p2, s2, z2), w)


def test_bad_formats_are_named():
    with pytest.raises(ValueError, match="'int9' is not supported; choose one of fp8, int4, int4-g64, int8, int8-weight"):
        Q.parse_format("int9")
    with pytest.raises(ValueError, match="group size 48"):
        Q.parse_format("int4-g48")
    with pytest.raises(ValueError, match="EngineConfig.quant 'nf4'.*fp8, int4, int4-g64"):
        EngineConfig(quant="nf4")
    assert Q.parse_format("int4") == ("int4", 128) and Q.parse_format("int4-g64") == ("int4", 64)


# -- models ---------------------------------------------------------------------------------------------------
def test_weight_bytes_at_the_8b_shape():
    """Whole-model bytes of the released shape, computed on the meta device (no memory used)."""
    ref = build_model(SIZES["8b"], "meta").to(torch.bfloat16)
    bf16 = Q.weight_bytes(ref)
    assert 15.9e9 < bf16 < 16.2e9
    for fmt, bound in (("fp8", 0.55), ("int4", 0.30), ("int4-g64", 0.30)):
        m = build_model(SIZES["8b"], "meta").to(torch.bfloat16)
        assert Q.apply_quant(m, fmt).warnings == []
        assert Q.model_quant_format(m) == fmt[:4] if fmt != "fp8" else "fp8"
        ratio = Q.weight_bytes(m) / bf16
        assert ratio <= bound, (fmt, ratio)


def test_quantized_tiny_model_bytes_and_error():
    ref = random_model(CFG, seed=0, dtype=torch.bfloat16)
    y_ref = forward(ref)
    lin_bytes = Q.weight_bytes(ref, only_block_linears=True)
    for fmt, bound, err in (("fp8", 0.55, 0.03), ("int4-g64", 0.30, 0.08)):
        m = random_model(CFG, seed=0, dtype=torch.bfloat16)
        eng = Engine(m, EngineConfig(quant=fmt))
        assert eng.warnings == []
        kind = fmt[:4]
        assert Q.model_quant_format(m) == kind
        linears = target_modules(m).values()  # the checkpoint's linears (q/k/v and gate/up are fused parts)
        assert sum(isinstance(getattr(t, "module", t), Q.QUANT_MODULES) for t in linears) == 7 * CFG.num_layers
        assert isinstance(m.final_linear, torch.nn.Linear) and m.dtype == torch.bfloat16  # outside the blocks: dense
        assert Q.weight_bytes(m, only_block_linears=True) / lin_bytes <= bound
        e = Q.relative_error(forward(m), y_ref)
        assert 1e-4 < e < err, (fmt, e)  # changed, but close


def test_int4_group_falls_back_when_128_does_not_divide():
    m = random_model(CFG, seed=0)  # tiny: in_features 64 and 192
    Q.apply_quant(m, "int4")
    groups = {mod.group_size for mod in m.modules() if isinstance(mod, Q.Int4Linear)}
    assert groups == {64}


def test_requantize_and_cpu_has_no_fp8_matmul():
    m = random_model(CFG, seed=0)
    Q.apply_quant(m, "fp8")
    notes = Q.prepare_fast_paths(m)
    assert "dequantize" in notes[0] and "CUDA" in notes[0]
    assert not any(mod.use_scaled_mm for mod in m.modules() if isinstance(mod, Q.FP8Linear))
    ok, why = Q.fp8_scaled_mm_supported("cpu")
    assert not ok and "CUDA" in why
    w = Q.apply_quant(m, "int4-g64").warnings
    assert any("re-quantized from fp8 to int4" in x for x in w)
    assert Q.model_quant_format(m) == "int4"


def test_scaled_mm_path_matches_dequantize():
    """The GPU fast path (activations quantized per row to e4m3, torch._scaled_mm with row-wise scales);
    torch also implements _scaled_mm on CPU, so its numerics and plumbing are checked here."""
    x = torch.randn(3, 5, 256).to(torch.bfloat16)
    w = weight(128, 256)
    q, s = Q.quantize_fp8(w)
    ref = torch.nn.functional.linear(x.float(), Q.dequantize_fp8(q, s))
    assert Q.relative_error(Q.fp8_scaled_mm_linear(x, q, s, None), ref) < 0.05
    s_t = s.max()  # per-tensor scale (ComfyUI files)
    ref_t = torch.nn.functional.linear(x.float(), Q.dequantize_fp8(q, s_t))
    assert Q.relative_error(Q.fp8_scaled_mm_linear(x, q, s_t, None), ref_t) < 0.05
    m = random_model(CFG, seed=0, dtype=torch.bfloat16)
    Q.apply_quant(m, "fp8")
    dequant = forward(m)
    for mod in m.modules():
        if isinstance(mod, Q.FP8Linear):
            mod.use_scaled_mm = True
    assert Q.relative_error(forward(m), dequant) < 0.05


# -- files ----------------------------------------------------------------------------------------------------
# bf16_file: tests/quant/conftest.py
def _quantized_state(model):
    return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fmt", ["fp8", "int4-g64"])
def test_sgld_quantize_round_trip(bf16_file, tmp_path, fmt, capsys):
    from engine.cli import main

    out = tmp_path / f"q-{fmt}.safetensors"
    assert main(["quantize", str(bf16_file), str(out), "--format", fmt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layers"] == 7 * CFG.num_layers
    assert os.path.getsize(out) < os.path.getsize(bf16_file) * (0.75 if fmt == "fp8" else 0.6)
    at_load = load_model(bf16_file, quant=fmt)
    from_file = load_model(out)
    assert Q.model_quant_format(from_file) == fmt[:4]
    a, b = _quantized_state(at_load), _quantized_state(from_file)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(forward(at_load), forward(from_file))
    # the engine and the loader node's path: a pre-quantized file loads quantized with no option set
    eng = open_engine(str(out), EngineConfig())
    assert Q.model_quant_format(eng.model) == fmt[:4]
    assert eng.model.dtype == torch.float32  # the default compute dtype on a CPU without native bf16, not the file's
    # re-quantizing the quantized file to the other format works
    other = "int4-g64" if fmt == "fp8" else "fp8"
    out2 = tmp_path / "q2.safetensors"
    assert main(["quantize", str(out), str(out2), "--format", other]) == 0
    assert Q.model_quant_format(load_model(out2)) == other[:4]


def test_quantize_refuses_same_output_and_bad_input(bf16_file, tmp_path, capsys):
    from engine.cli import main

    assert main(["quantize", str(bf16_file), str(bf16_file), "--format", "fp8"]) == 2
    assert "must differ" in capsys.readouterr().err
    bogus = tmp_path / "other.safetensors"
    save_file({"foo.weight": torch.zeros(2, 2)}, str(bogus))
    assert main(["quantize", str(bogus), str(tmp_path / "o.safetensors"), "--format", "int4"]) == 2
    assert "not an ERNIE-Image" in capsys.readouterr().err


def _comfy_fp8_state(style: str, prefix="model.diffusion_model."):
    """A state dict as ComfyUI stores fp8 models: every linear weight in e4m3 with a per-tensor scale."""
    sd = random_state_dict(CFG, seed=0, dtype=torch.float32)
    out, dense_ref = {}, {}
    for k, v in sd.items():
        layer = k[: -len(".weight")]
        if k.endswith(".weight") and v.dim() == 2:
            scale = v.abs().amax() / 448.0
            q = (v / scale).to(torch.float8_e4m3fn)
            out[prefix + k] = q
            if style == "scaled_fp8":
                out[prefix + layer + ".scale_weight"] = scale.reshape(())
                out[prefix + layer + ".scale_input"] = torch.ones(())  # present in some files; unused (weight-only)
            else:
                out[prefix + layer + ".weight_scale"] = scale.reshape(())
                if style == "comfy_quant":
                    out[prefix + layer + ".comfy_quant"] = torch.tensor(
                        list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
            dense_ref[k] = q.float() * scale
        else:
            out[prefix + k] = v.to(torch.bfloat16)
            dense_ref[k] = v.to(torch.bfloat16).float()
    if style == "scaled_fp8":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)  # the marker; its dtype = storage
    return out, dense_ref


@pytest.mark.parametrize("style", ["scaled_fp8", "comfy_quant", "metadata"])
def test_comfyui_fp8_files_load(tmp_path, style):
    state, dense = _comfy_fp8_state(style)
    meta = {}
    if style == "metadata":  # newer files list their quantized layers in the header instead
        layers = {k[: -len(".weight")]: {"format": "float8_e4m3fn"} for k, v in state.items() if v.dtype == torch.float8_e4m3fn}
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    p = tmp_path / f"ernie_fp8_{style}.safetensors"
    save_file(state, str(p), metadata=meta)
    m = load_model(p)
    assert m.dtype == torch.bfloat16
    blocks = [mod for mod in m.modules() if isinstance(mod, Q.FP8Linear)]
    assert len(blocks) == 7 * CFG.num_layers and all(b.weight_scale.dim() == 0 for b in blocks)
    assert isinstance(m.text_proj, torch.nn.Linear) and m.text_proj.weight.dtype == torch.bfloat16  # dequantized
    # the same weights, dense: ComfyUI's own result (weight * scale_weight)
    ref = random_model(CFG, seed=0)
    ref.load_state_dict({k: v.to(torch.float32) for k, v in dense.items()})
    ref = ref.to(torch.bfloat16)
    assert Q.relative_error(forward(m), forward(ref)) < 0.02
    exact = random_model(CFG, seed=0, dtype=torch.bfloat16)
    assert Q.relative_error(forward(m), forward(exact)) < 0.06
    # quantize to int4 while loading a ComfyUI fp8 file works too
    m4 = load_model(p, quant="int4-g64")
    assert Q.model_quant_format(m4) == "int4"


@pytest.mark.parametrize("fmt", ["svdquant_w4a4", "float8_e4m3fnuz"])  # not in ComfyUI's QUANT_ALGOS either
def test_comfyui_unsupported_format_is_refused(tmp_path, fmt):
    state, _ = _comfy_fp8_state("comfy_quant")
    key = next(k for k in state if k.endswith("layers.0.mlp.gate_proj.comfy_quant"))
    state[key] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    p = tmp_path / f"{fmt}.safetensors"
    save_file(state, str(p))
    with pytest.raises(CheckpointError, match=f"'{fmt}', which SGLDiffusion does not load .supported: float8_e4m3fn, "
                                              "float8_e5m2, nvfp4, mxfp8, int8_tensorwise, convrot_w4a4, asym_w4a8_int8, "
                                              "awq_w4a16"):
        load_model(p)


def test_quantized_file_with_wrong_shapes_is_refused(bf16_file, tmp_path):
    out = tmp_path / "q.safetensors"
    Q.quantize_file(str(bf16_file), str(out), "fp8")
    from safetensors.torch import load_file

    sd = load_file(str(out))
    sd["layers.1.mlp.up_proj.weight"] = sd["layers.1.mlp.up_proj.weight"][:10]
    sd["layers.1.mlp.up_proj.weight_scale"] = sd["layers.1.mlp.up_proj.weight_scale"][:10]
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad), metadata={"sgld_quant": json.dumps({"format": "fp8"})})
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight.*shape"):
        load_model(bad)


def test_cli_bench_quant_flag(capsys):
    from engine.cli import main

    assert main(["bench", "--size", "tiny", "--steps", "0", "--repeat", "1", "--quant", "int4-g64", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["quant"] == "int4-g64" and "warnings" not in res
