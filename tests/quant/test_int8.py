"""INT8 (engine/features/quant/int8/): "int8" = per-output-channel int8 weights with W8A8 compute (per-token
dynamic activation scales, ``torch._int_mm``), "int8-weight" = the same weights dequantized per layer.

Numerics against a float reference with a stated bound, the fallback for shapes ``torch._int_mm`` refuses, the
``sgld quantize`` file round trip, bad companions (CheckpointErrors naming file and key), LoRA side paths,
fused projections, tensor-parallel shards, layer-wise offload, torch.inference_mode (as ComfyUI runs nodes)
and the CLI flags. Speed is measured by bench/speed/formats_bench.py, not here."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

from engine import CheckpointError, Engine, EngineConfig, load_model
from engine.features import patching
from engine.features import quant as Q
from engine.features.fuse import fuse_projections, remove_fused_projections
from engine.features.lora import target_modules
from engine.features.quant.int8 import linear as I8
from engine.features.quant.prequantized import QuantPlan
from engine.io.checkpoint import open_checkpoint
from engine.loading import estimate_bytes
from engine.models.ernie_image import FAMILY
from engine.models.random_weights import SIZES, random_model
from tools.demo import judge

CFG = SIZES["tiny"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}
FORMATS = ("int8", "int8-weight")
CLASSES = {"int8": Q.Int8Linear, "int8-weight": Q.Int8WeightLinear}


def weight(n=96, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.01, 3.0, n)[:, None]  # rows of very different scale
    w[3, 7] = 40.0  # an outlier
    return w


def activations(tokens=40, k=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, tokens, k, generator=g) * torch.linspace(0.1, 10.0, tokens)[:, None]  # tokens of different size
    x[0, 0] = 0.0  # an all-zero token (padding)
    return x


def inputs(b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, CFG.in_channels, 6, 6, generator=g)
    return x, torch.tensor([400.0] * b), torch.randn(b, 5, CFG.text_in_dim, generator=g), torch.tensor([5, 3])


# -- numerics -------------------------------------------------------------------------------------------------
def test_weights_per_output_channel_round_trip():
    w = weight()
    q, s = Q.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (96,) and s.dtype == torch.float32
    assert (q.abs().amax(dim=1) == 127).all()  # every row uses the whole symmetric range; -128 never
    assert int(q.min()) >= -127
    deq = Q.dequantize_int8(q, s)
    assert ((deq - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest: half a step per row
    # per channel: the small rows keep their precision next to the outlier's row
    assert Q.relative_error(deq[:3], w[:3]) < 0.01
    zero = Q.quantize_int8(torch.zeros(2, 8))
    assert torch.equal(zero[0], torch.zeros(2, 8, dtype=torch.int8)) and bool((zero[1] > 0).all())


def test_tokens_are_quantized_per_row():
    x2 = activations().reshape(-1, 256)
    q, s = Q.quantize_tokens(x2)
    assert q.dtype == torch.int8 and s.shape == (x2.shape[0], 1) and s.dtype == torch.float32
    assert (q[1:].abs().amax(dim=1) == 127).all() and torch.equal(q[0], torch.zeros(256, dtype=torch.int8))
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert ((q.float() * s - x2).abs() <= s / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_forward_is_the_integer_product_within_the_stated_bound(dtype):
    """The W8A8 output is exactly the int32 product of the quantized operands, scaled; and since each
    operand is within half a step of its value, |y - x w^T| <= (s_x sum|q_w| s_w + s_w sum|x|) / 2 element
    by element (s_x: the token's scale, s_w: the channel's), plus the output dtype's rounding."""
    w, x = weight(), activations().to(dtype)
    bias = torch.linspace(-1, 1, 96)
    m = Q.Int8Linear.from_dense(w, bias)
    assert Q.int_mm_accepts("cpu", 120, 256, 96)  # this CPU runs the int8 kernel for these shapes
    y = m(x)
    assert y.dtype == dtype and y.shape == (3, 40, 96)
    x2 = x.reshape(-1, 256)
    xq, xs = Q.quantize_tokens(x2)
    product = (xq.double() @ m.weight.double().t()) * xs.double() * m.weight_scale.double()
    exact, size = product + bias.double(), product.abs() + bias.double().abs()
    eps = torch.finfo(dtype).eps  # three float32 roundings (token scale, channel scale, bias), one to dtype
    assert ((y.reshape(-1, 96).double() - exact).abs() <= size * (eps + 4 * torch.finfo(torch.float32).eps)).all()
    ref = F.linear(x2.double(), w.double(), bias.double())
    bound = 0.5 * (xs.double() * (m.weight.double().abs() * m.weight_scale.double()[:, None]).sum(1)
                   + x2.double().abs().sum(1, keepdim=True) * m.weight_scale.double())
    assert ((y.reshape(-1, 96).double() - ref).abs() <= bound + ref.abs() * 2 * eps + 1e-6).all()
    err = Q.relative_error(y.reshape(-1, 96), ref)
    assert 0 < err < 0.02  # these rows and tokens: 1.1% (weight-only: 0.8%)
    weight_only = Q.Int8WeightLinear(m.weight, m.weight_scale, bias)(x)
    assert Q.relative_error(weight_only.reshape(-1, 96), ref) < err


def test_shapes_the_kernel_refuses_take_the_dequantized_path(monkeypatch):
    """This CPU's ``torch._int_mm`` takes every shape; cuBLAS refuses some (e.g. 16 rows or fewer). The refusal is
    stubbed here (the one thing this machine cannot give); the probe records it and the layer falls back."""
    monkeypatch.setattr(I8, "_int_mm_probes", {})
    calls = []

    def refuse(a, b):
        calls.append(a.shape)
        raise RuntimeError("self.size(0) needs to be greater than 16, but got 8")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    m = Q.Int8Linear.from_dense(weight(), torch.ones(96))
    x = activations(tokens=4)[:2]  # 8 tokens
    y = m(x)
    assert torch.equal(y, m.dequantized_forward(x)) and len(calls) == 1  # probed once, then remembered
    m(x)
    assert len(calls) == 1 and list(I8._int_mm_probes.values()) == [False]
    assert Q.relative_error(y, F.linear(x, weight(), torch.ones(96))) < 0.01


def test_tiny_model_error_against_fp32(bf16_file):
    ref = load_model(bf16_file, dtype="fp32")
    with torch.no_grad():
        y_ref = ref(*inputs()).float()
    errors = {}
    for fmt in FORMATS:
        m = load_model(bf16_file, dtype="fp32", quant=fmt)
        assert Q.model_quant_format(m) == fmt and isinstance(m.layers[1].mlp.linear_fc2, CLASSES[fmt])
        with torch.no_grad():
            errors[fmt] = Q.relative_error(m(*inputs()).float(), y_ref)
    assert 0 < errors["int8-weight"] < errors["int8"] < 0.01, errors


# -- files ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_sgld_quantize_file_round_trip(bf16_file, tmp_path, fmt):
    dst = tmp_path / f"{fmt}.safetensors"
    with torch.inference_mode():  # as the loader node runs it
        at_load = load_model(bf16_file, quant=fmt)
    assert estimate_bytes(bf16_file, quant=fmt) == Q.weight_bytes(at_load)
    summary = Q.quantize_file(str(bf16_file), str(dst), fmt)
    assert summary["layers"] == 7 * CFG.num_layers
    stored = load_file(str(dst))
    assert stored["layers.0.mlp.gate_proj.weight"].dtype == torch.int8
    assert stored["layers.0.mlp.gate_proj.weight_scale"].dtype == torch.float32
    assert stored["layers.0.mlp.gate_proj.weight_scale"].shape == (CFG.ffn_hidden_size,)
    assert stored["x_embedder.proj.weight"].dtype == torch.bfloat16  # outside the blocks: as stored
    assert json.loads(open_checkpoint(str(dst)).files[0].metadata["sgld_quant"])["format"] == fmt
    plan = QuantPlan(open_checkpoint(str(dst)))
    assert {v["kind"] for v in plan.layers.values()} == {fmt} and len(plan.layers) == 7 * CFG.num_layers
    with torch.inference_mode():
        from_file = load_model(dst)
        a, b = at_load.state_dict(), from_file.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert type(from_file.layers[0].self_attention.to_q) is CLASSES[fmt]
        y = from_file(*inputs())
        assert torch.equal(y, at_load(*inputs()))
        other = "int8" if fmt == "int8-weight" else "int8-weight"
        switched = load_model(dst, quant=other)  # the same storage, the other compute
        assert type(switched.layers[0].mlp.up_proj) is CLASSES[other]
        sa = switched.state_dict()
        assert all(torch.equal(sa[k], b[k]) for k in b)  # re-quantizing int8 weights gives them back exactly


def _bad_file(bf16_file, tmp_path, change):
    good = tmp_path / "int8.safetensors"
    Q.quantize_file(str(bf16_file), str(good), "int8")
    sd = load_file(str(good))
    change(sd)
    bad = tmp_path / "bad-int8.safetensors"
    save_file(sd, str(bad), metadata=open_checkpoint(str(good)).files[0].metadata)
    return bad


KEY = "layers.1.mlp.gate_proj"
BAD = {
    "missing scale": (lambda sd: sd.pop(KEY + ".weight_scale"),
                      rf"bad-int8.safetensors: tensor '{KEY}.weight': int8 weight without its scale '{KEY}.weight_scale' "
                      rf"\(F32 \[192\], one per output channel\)"),
    "bf16 scale": (lambda sd: sd.update({KEY + ".weight_scale": sd[KEY + ".weight_scale"].bfloat16()}),
                   rf"bad-int8.safetensors: tensor '{KEY}.weight_scale': scale of int8 weight '{KEY}.weight' \[192, 64\] "
                   rf"is BF16 \[192\]; allowed: F32 \[192\] \(one per output channel\)"),
    "short scale": (lambda sd: sd.update({KEY + ".weight_scale": sd[KEY + ".weight_scale"][:64].clone()}),
                    rf"tensor '{KEY}.weight_scale': scale of int8 weight '{KEY}.weight' \[192, 64\] is F32 \[64\]"),
    "per-tensor scale": (lambda sd: sd.update({KEY + ".weight_scale": torch.tensor(0.01)}),
                         rf"tensor '{KEY}.weight_scale': scale of int8 weight '{KEY}.weight' \[192, 64\] is F32 \[\]"),
    "1-d weight": (lambda sd: sd.update({KEY + ".weight": sd[KEY + ".weight"].reshape(-1)}),
                   rf"tensor '{KEY}.weight': int8 weight has shape \[12288\]; allowed: I8 \[out, in\]"),
    "transposed": (lambda sd: sd.update({KEY + ".weight": sd[KEY + ".weight"].t().contiguous()}),
                   rf"scale of int8 weight '{KEY}.weight' \[64, 192\] is F32 \[192\]; allowed: F32 \[64\]"),
    "zero scale": (lambda sd: sd[KEY + ".weight_scale"].__setitem__(5, 0.0),
                   rf"tensor '{KEY}.weight_scale': 1 values are not finite and > 0 \(e.g. 0.0\)"),
    "nan scale": (lambda sd: sd[KEY + ".weight_scale"].__setitem__(0, float("nan")),
                  rf"tensor '{KEY}.weight_scale': 1 values are not finite and > 0 \(e.g. nan\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_int8_companions_are_checkpoint_errors_naming_file_and_key(bf16_file, tmp_path, case):
    change, message = BAD[case]
    bad = _bad_file(bf16_file, tmp_path, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


# -- features -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_projections_compute_the_same_and_split_back(fmt):
    """W8A8 is per token and per output channel, so q/k/v (gate/up) as one int8 GEMM give the same numbers."""
    model = random_model(CFG, seed=0)
    Q.apply_quant(model, fmt)
    x = inputs()
    with torch.inference_mode():
        y = model(*x)
        state = model.state_dict()
        assert fuse_projections(model) == 2 * CFG.num_layers
        qkv = model.layers[0].self_attention.qkv
        assert type(qkv) is CLASSES[fmt] and qkv.out_features == 3 * CFG.hidden_size
        torch.testing.assert_close(model(*x), y, rtol=1e-6, atol=1e-6)
        fused_state = model.state_dict()  # the checkpoint's names: rows of the fused tensors
        assert fused_state.keys() == state.keys() and all(torch.equal(fused_state[k], state[k]) for k in state)
        assert remove_fused_projections(model)
        assert type(model.layers[0].self_attention.to_v) is CLASSES[fmt]
        assert torch.equal(model(*x), y)


def test_lora_on_int8_layers_is_a_side_path_removed_exactly(tmp_path):
    eng = Engine(random_model(CFG, seed=0), EngineConfig(quant="int8"))  # fused projections, as an Engine runs
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    x = inputs()
    with torch.inference_mode():
        y0 = eng.model(*x)
    g = torch.Generator().manual_seed(5)
    names = ["layers.0.self_attention.to_k", "layers.1.mlp.linear_fc2"]
    shapes = {names[0]: (CFG.hidden_size, CFG.hidden_size), names[1]: (CFG.hidden_size, CFG.ffn_hidden_size)}
    pairs = {n: (torch.randn(4, i, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1) for n, (o, i) in shapes.items()}
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = a.bfloat16(), b.bfloat16()
    save_file(sd, str(tmp_path / "l.safetensors"))
    with torch.inference_mode():  # as the LoRA node runs it
        eng.set_loras([(str(tmp_path / "l.safetensors"), 0.8)])
        targets = target_modules(eng.model)
        for n, (a, b) in pairs.items():
            t = targets[n]
            mod = getattr(t, "module", t)
            assert isinstance(mod, Q.Int8Linear) and type(mod).__name__ == "Int8LinearWithLoRA"
            rows = slice(getattr(t, "start", 0), getattr(t, "stop", None))
            xin = torch.randn(20, shapes[n][1], generator=g)
            side = 0.8 * F.linear(F.linear(xin, a.bfloat16().float()), b.bfloat16().float())
            torch.testing.assert_close(mod(xin)[:, rows], Q.Int8Linear.forward(mod, xin)[:, rows] + side,
                                       rtol=1e-5, atol=1e-5)
        assert (eng.model(*x) - y0).abs().max() > 1e-3
        eng.set_loras([])
        assert patching.get(eng.model, "lora") is None
        after = eng.model.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert torch.equal(eng.model(*x), y0)


def test_layerwise_offload_streams_int8_bytes():
    x = inputs()
    ref = Engine(random_model(CFG, seed=0), EngineConfig(quant="int8"))
    eng = Engine(random_model(CFG, seed=0), EngineConfig(quant="int8", offload="layerwise", resident_layers=1))
    off = eng.offload
    assert off is not None
    dense_block = 4 * sum(p.numel() for p in random_model(CFG).layers[0].parameters())  # fp32
    assert off.slot_bytes < dense_block / 3  # the transfer is int8 weights and their scales
    assert torch.int8 in {p.dtype for p in eng.model.layers[0].parameters()}
    with torch.inference_mode():
        assert torch.equal(eng.model(*x), ref.model(*x))


def test_tensor_parallel_shards_quantize_their_slices(tiny_checkpoint):
    """Column-parallel layers (split by output rows) get exactly the full model's int8 rows and scales;
    row-parallel ones (split along the input) quantize their own slice, and the shards' outputs add up."""
    full_dense = load_model(tiny_checkpoint)
    full = load_model(tiny_checkpoint, quant="int8")
    shards = [load_model(tiny_checkpoint, shard=(2, i), quant="int8") for i in range(2)]
    for name, dim in FAMILY.shard_dims.items():
        layer = f"layers.1.{name}"
        whole = full.get_submodule(layer)
        parts = [s.get_submodule(layer) for s in shards]
        assert all(type(p) is Q.Int8Linear for p in parts)
        if dim == 0:
            assert torch.equal(torch.cat([p.weight for p in parts]), whole.weight)
            assert torch.equal(torch.cat([p.weight_scale for p in parts]), whole.weight_scale)
        else:
            dense = full_dense.get_submodule(layer).weight
            for p, chunk in zip(parts, dense.chunk(2, dim=1)):
                q, s = Q.quantize_int8(chunk)
                assert torch.equal(p.weight, q) and torch.equal(p.weight_scale, s)
            xin = torch.randn(24, whole.in_features)
            with torch.inference_mode():
                summed = sum(p(c) for p, c in zip(parts, xin.chunk(2, dim=1)))
                assert Q.relative_error(summed, F.linear(xin, dense)) < 0.02


# -- the CLI --------------------------------------------------------------------------------------------------
def test_cli_quantize_bench_and_generate_with_int8(tiny_checkpoint, tmp_path, sgld_in_process, monkeypatch):
    from engine.features.quant.int8 import linear

    monkeypatch.setattr(linear, "_int_mm_probes", {})  # as a fresh process: the matmul probe runs, and says so

    def sgld(*args):
        code, out, err = sgld_in_process(*args)
        assert code == 0, err[-2000:]
        return out, err

    out = tmp_path / "tiny-int8.safetensors"
    printed, _ = sgld("quantize", str(tiny_checkpoint), str(out), "--format", "int8", "--json")
    assert json.loads(printed.splitlines()[-1])["layers"] == 7 * CFG.num_layers
    bench = json.loads(sgld("bench", "--model", str(out), "--quant", "int8-weight", "--repeat", "1", "--json")[0]
                       .splitlines()[-1])  # the file's int8 weights, computed weight-only
    assert bench["quant"] == "int8-weight" and bench["forward_ms_median"] > 0
    pic = tmp_path / "int8.png"
    prompt = "a large red circle on the left, on a blue background"
    _, err = sgld("generate", "--prompt", prompt, "--seed", "0", "--steps", "12", "--quant", "int8", "--out", str(pic))
    assert "int8 matmul on cpu" in err and "torch._int_mm" in err  # the W8A8 path ran
    with Image.open(pic) as im:
        assert judge.judge(np.asarray(im.convert("RGB")), prompt)["pass"]
    with pytest.raises(ValueError, match="int9.*int8, int8-weight"):
        EngineConfig(quant="int9")  # the flag's check (the table's names)


def test_compiled_blocks_run_the_int8_layers():
    """Regional torch.compile (aot_eager: dynamo's graph of the block without Inductor's C++ build, which would
    take most of a test's time here) traces Int8Linear's forward, _int_mm included, and agrees with eager."""
    from engine.features.compile import compile_blocks

    model = random_model(CFG, seed=0)
    Q.apply_quant(model, "int8")
    x = inputs()
    with torch.inference_mode():
        eager = model(*x)
    compile_blocks(model, "static", mode=None, backend="aot_eager")
    assert patching.get(model, "compile").describe()["blocks"] == CFG.num_layers
    with torch.inference_mode():
        compiled = model(*x)
    assert Q.relative_error(compiled, eager) < 1e-5


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_activation_rows_quantized_in_chunks_are_the_same_bits(monkeypatch, fmt):
    """Per-token activation quantization runs over chunks of rows (its float32 copies bounded: the fp8 / int8 peak
    at 2048², docs/memory.md); row-wise, so every chunking gives the bits of one call, and only chunks that size."""
    from engine.features.quant import numerics as N
    from engine.features.quant.fp8 import numerics as F8

    quantize, dtype = ((I8._quantize_tokens, torch.int8) if fmt == "int8"
                       else (F8._quantize_activation_rows, F8.FP8_DTYPE))
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    want_q, want_s = quantize(x)
    sizes = []
    monkeypatch.setattr(N, "ROW_CHUNK_ELEMENTS", 10 * 64)  # 10 rows a chunk

    def counted(rows):
        sizes.append(rows.shape[0])
        return quantize(rows)

    got_q, got_s = N.quantize_rows(x, counted, dtype)
    assert sizes == [10, 10, 10, 7]
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
    assert got_q.dtype == dtype and got_s.shape == (37, 1)


@pytest.mark.parametrize("layer", ["int8", "int8_tensorwise", "int8_convrot"])
@pytest.mark.parametrize("rows,chunks", [(168, [64, 64, 40]), (150, [64, 86]), (90, [90])])
def test_w8a8_products_in_chunks_of_rows_are_the_same_bits(monkeypatch, layer, rows, chunks):
    """The W8A8 GEMM's int32 sums and float32 rescale run over chunks of rows (their temporaries bounded: the
    int8 peak at 2048², docs/memory.md): the bits of one call, a short tail joined to the chunk before (cuBLAS's
    int8 GEMM refuses 16 rows or fewer), under inference_mode as ComfyUI runs it."""
    from engine.features.quant import numerics as N
    from engine.features.quant.comfy import Int8TensorwiseLinear
    from engine.features.quant.comfy import numerics as CN

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) / 16
    bias = torch.randn(64, generator=g)
    if layer == "int8":
        mod = Q.Int8Linear.from_dense(w, bias)
    else:  # ComfyUI's int8_tensorwise, plain or with its inputs rotated per group of 64 (ConvRot)
        mod = Int8TensorwiseLinear(*CN.quantize_int8_tensorwise(w), bias, rotation=64 if layer == "int8_convrot" else 0)
    x = (torch.randn(rows, 256, generator=g) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        whole = mod(x)
        sizes = []
        real = torch._int_mm
        monkeypatch.setattr(torch, "_int_mm", lambda a, b: sizes.append(a.shape[0]) or real(a, b))
        monkeypatch.setattr(N, "GEMM_CHUNK_ELEMENTS", 64 * 64)
        monkeypatch.setattr(N, "GEMM_CHUNK_ALIGN", 32)
        chunked = mod(x)
    assert sizes == chunks
    assert chunked.dtype == torch.bfloat16 and torch.equal(chunked.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("native", ["1", "0"])
def test_w8a8_on_a_cpu_takes_int8_products_only_where_they_pay(monkeypatch, native):
    """Issue 50: without VNNI / AMX, torch._int_mm runs ~20x slower than the float GEMM on a CPU (355 s against 16 s a
    step at 505M here): W8A8 layers take the dequantized matmul there, with int8 products where the CPU has them
    (SGLD_CPU_INT8 says which, as /proc/cpuinfo would)."""
    monkeypatch.setenv("SGLD_CPU_INT8", native)
    monkeypatch.setattr(I8, "_int_mm_probes", {})
    g = torch.Generator().manual_seed(0)
    layer = I8.Int8Linear.from_dense(torch.randn(64, 96, generator=g))
    x = torch.randn(40, 96, generator=g)
    with torch.inference_mode():
        got = layer(x)
        w8a8 = I8.w8a8(x, layer.weight, layer.weight_scale, x.dtype)
        dense = layer.dequantized_forward(x)
    assert not torch.equal(w8a8, dense)  # the two paths differ: the test tells which ran
    assert torch.equal(got, w8a8 if native == "1" else dense)
