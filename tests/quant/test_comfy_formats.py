"""ComfyUI's own quantized checkpoints (nvfp4, mxfp8, int8_tensorwise), written by comfy-kitchen's quantizers in
ComfyUI's layout (tests/comfy_quant_files.py), load and compute as the same weights dequantized by comfy-kitchen;
everywhere a model goes (engine sampling, LoRA side paths with exact removal, layer-wise offload of the stored
bytes, tensor-parallel shards, compile) under torch.inference_mode() as ComfyUI runs nodes; a bad scale or tag
only ever gets a CheckpointError naming file, layer and field; without comfy-kitchen a clear error names it."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from comfy_quant_files import FORMATS, PREFIX, kitchen_tensors, tag, write_comfy
from safetensors.torch import load_file, save_file

from engine import CheckpointError, load_model
from engine.config import EngineConfig
from engine.features import patching
from engine.features import quant as Q
from engine.features.quant.comfy import Int8TensorwiseLinear, MXFP8Linear, NVFP4Linear
from engine.features.quant.comfy import numerics as N
from engine.models.random_weights import SIZES, random_state_dict
from engine.router import open_engine

ck = pytest.importorskip("comfy_kitchen")
CFG = SIZES["tiny"]
SD = random_state_dict(CFG, 0)
CLASSES = {"nvfp4": NVFP4Linear, "mxfp8": MXFP8Linear, "int8_tensorwise": Int8TensorwiseLinear}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("comfyq")
    out = {}
    for fmt in FORMATS:
        for tags in ("tensor", "header"):
            path = d / f"ernie-{fmt}-{tags}.safetensors"
            dense = write_comfy(path, SD, fmt, tags)
            out[fmt, tags] = path
        ref = d / f"ernie-{fmt}-dense.safetensors"
        save_file(dense, str(ref))
        out[fmt, "dense"] = ref
    out["int8_w8a8"] = d / "ernie-int8-w8a8.safetensors"
    write_comfy(out["int8_w8a8"], SD, "int8_tensorwise", full_precision=False)
    out["dir"] = d
    return out


def inputs(b=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, CFG.in_channels, 6, 6, generator=g)
    return x, torch.tensor([400.0] * b), torch.randn(b, 5, CFG.text_in_dim, generator=g), torch.tensor([5, 3])


def _config(**kw):
    return EngineConfig(device="cpu", dtype="fp32", **kw)


def _sample(eng, steps=2, **kw):
    cond = [torch.randn(5, CFG.text_in_dim, generator=torch.Generator().manual_seed(3))]
    return eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), cond, None, seed=7, steps=steps, cfg=1.0, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_loads_and_samples_as_its_kitchen_dequantized_weights(files, fmt):
    for tags in ("tensor", "header"):
        model = load_model(files[fmt, tags], dtype="fp32")
        fc2 = model.layers[1].mlp.linear_fc2
        assert type(fc2) is CLASSES[fmt] and Q.model_quant_format(model) == fmt.replace("_", "-")
        ref = load_model(files[fmt, "dense"], dtype="fp32")
        with torch.inference_mode():
            assert torch.equal(model(*inputs()), ref(*inputs())), tags  # the same float32 weights, the same GEMMs
    if fmt != "mxfp8":  # the engine's sampling loop (mxfp8: test_compile_and_cache_dit_on_a_comfy_model)
        with torch.inference_mode():
            a = _sample(open_engine(files[fmt, "tensor"], _config()))
            b = _sample(open_engine(files[fmt, "dense"], _config()))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stored = sum(v.numel() * v.element_size() for k, v in load_file(str(files[fmt, "tensor"])).items()
                 if (".self_attention.to" in k or ".mlp." in k) and not k.endswith(".comfy_quant"))
    dense = sum(v.numel() * 4 for k, v in SD.items() if ".self_attention.to" in k or ".mlp." in k)
    # the model holds the file's bytes (weights and scales), a quarter or less of float32
    assert Q.weight_bytes(load_model(files[fmt, "tensor"], dtype="fp32"), only_block_linears=True) == stored < dense / 3


def test_int8_tensorwise_computes_w8a8_as_comfy_kitchen_does(files):
    """Without full_precision_matrix_mult ComfyUI multiplies in int8 (activations quantized per token):
    our torch._int_mm path agrees with comfy-kitchen's own int8_linear."""
    model = load_model(files["int8_w8a8"], dtype="fp32")
    layer = model.layers[0].mlp.gate_proj
    assert isinstance(layer, Int8TensorwiseLinear) and not layer.full_precision
    x = torch.randn(37, layer.in_features, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = layer(x)
        theirs = ck.int8_linear(x, layer.weight, layer.weight_scale, None, torch.float32)
        exact = F.linear(x, layer.dequantize())
    assert Q.relative_error(ours, theirs) < 2e-3 and Q.relative_error(ours, exact) < 2e-2


def test_lora_on_a_comfy_nvfp4_model_is_a_side_path_and_removal_is_exact(files, tmp_path):
    g = torch.Generator().manual_seed(5)
    names = {"layers.0.self_attention.to_q": (64, 64), "layers.1.mlp.linear_fc2": (64, 192)}
    pairs = {m: (torch.randn(4, i, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1) for m, (o, i) in names.items()}
    lora = tmp_path / "l.safetensors"
    save_file({f"transformer.{m}.lora_{ab}.weight": t for m, (a, b) in pairs.items() for ab, t in (("A", a), ("B", b))},
              str(lora))
    eng = open_engine(files["nvfp4", "tensor"], _config())
    model = eng.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        y0 = model(*inputs())
        eng.set_loras([(str(lora), 0.8)])
        fc2 = model.layers[1].mlp.linear_fc2
        assert isinstance(fc2, NVFP4Linear) and type(fc2).__name__.endswith("WithLoRA")
        a, b = pairs["layers.1.mlp.linear_fc2"]
        xi = torch.randn(3, 192)
        torch.testing.assert_close(fc2(xi), F.linear(xi, fc2.dequantize()) + 0.8 * F.linear(F.linear(xi, a), b),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.equal(model(*inputs()), y0)
        eng.set_loras([])
        assert torch.equal(model(*inputs()), y0) and patching.get(model, "lora") is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_tensorwise"])
def test_offload_streams_the_stored_bytes(files, fmt):
    ref = open_engine(files[fmt, "tensor"], _config())
    eng = open_engine(files[fmt, "tensor"], _config(offload="layerwise", resident_layers=1))
    off = eng.offload
    assert off is not None
    storage = torch.uint8 if fmt == "nvfp4" else torch.int8
    assert storage in {p.dtype for p in eng.model.layers[0].mlp.parameters()}
    dense_block = 4 * sum(v.numel() for k, v in SD.items() if k.startswith("layers.0."))
    assert off.slot_bytes < dense_block / 2
    with torch.inference_mode():
        assert torch.equal(eng.model(*inputs()), ref.model(*inputs()))
    assert off.transfers > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_parallel_shards_split_the_stored_bytes(files, fmt):
    """Each rank's share of a column-parallel (gate_proj: rows) and a row-parallel (linear_fc2: inputs) layer
    equals the matching slice of the whole layer's kitchen-dequantized weight."""
    whole = load_model(files[fmt, "tensor"], dtype="fp32").layers[0].mlp
    rows = CFG.ffn_hidden_size // 2
    for i in range(2):
        part = load_model(files[fmt, "tensor"], dtype="fp32", shard=(2, i)).layers[0].mlp
        assert type(part.gate_proj) is CLASSES[fmt]
        assert torch.equal(part.gate_proj.dequantize(), whole.gate_proj.dequantize()[i * rows:(i + 1) * rows])
        assert torch.equal(part.linear_fc2.dequantize(), whole.linear_fc2.dequantize()[:, i * rows:(i + 1) * rows])
    if fmt == "mxfp8":  # 192 rows over 4 ranks: 48 a rank, not whole blocks of 32
        with pytest.raises(CheckpointError, match=r"gate_proj.weight': ComfyUI mxfp8 layer \[192, 64\] cannot be split "
                                                  r"over 4 ranks along its outputs on whole blocks of 32"):
            load_model(files[fmt, "tensor"], shard=(4, 0))


def test_compile_and_cache_dit_on_a_comfy_model(files):
    from engine.features import compile as C
    from engine.features.cache import CacheConfig
    cache = CacheConfig(enabled=True, preset="fast")
    with torch.inference_mode():
        a = _sample(open_engine(files["mxfp8", "tensor"], _config()), steps=8, cache=cache)
        b = _sample(open_engine(files["mxfp8", "dense"], _config()), steps=8, cache=cache)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    model = load_model(files["nvfp4", "tensor"], dtype="fp32")
    want = load_model(files["nvfp4", "tensor"], dtype="fp32")
    C.compile_blocks(model, "static", mode=None, backend="aot_eager")  # cheap on CPU (inductor: minutes)
    C.reset_counters()
    with torch.inference_mode():
        torch.testing.assert_close(model(*inputs()), want(*inputs()), rtol=1e-5, atol=1e-6)
    assert C.graph_count() == 1 and C.graph_breaks() == {}  # comfy-kitchen's ops are torch.library ops: traced
    C.uncompile_blocks(model)


def test_without_comfy_kitchen_a_comfy_file_names_the_package(files, monkeypatch):
    """comfy-kitchen cannot be uninstalled here: its import is made to fail (sys.modules entry None), the
    one stub of this file."""
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)
    monkeypatch.setattr(N, "_kitchen", None)
    with pytest.raises(CheckpointError, match=r"ernie-nvfp4-tensor.safetensors: tensor '.*layers.0.mlp.gate_proj.weight': "
                                              r".*package 'comfy-kitchen'.*python -m pip install comfy-kitchen"):
        load_model(files["nvfp4", "tensor"])
    load_model(files["nvfp4", "dense"])  # files without ComfyUI's layers need nothing


def _damaged(files, tmp_path, fmt, change):
    sd = load_file(str(files[fmt, "tensor"]))
    change(sd, PREFIX + "layers.1.mlp.up_proj.")
    path = tmp_path / f"bad-{fmt}.safetensors"
    save_file(sd, str(path))
    return path


BAD = [  # (format, change of the layer's tensors, what the message says)
    ("nvfp4", lambda sd, p: sd.pop(p + "weight_scale_2"), "nvfp4 weight without its '.*up_proj.weight_scale_2'"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "weight_scale", sd[p + "weight_scale"][:64]),
     r"weight_scale of layer \[192, 64\] is F8_E4M3 \[64, 4\]; allowed: F8_E4M3 or U8 \[256, 4\]"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "weight_scale_2", sd[p + "weight_scale_2"].reshape(1, 1)),
     r"weight_scale_2 of layer \[192, 64\] is F32 \[1, 1\]; allowed: F32 or BF16 or F16 \[\] or \[1\]"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "weight_scale_2", sd[p + "weight_scale_2"].to(torch.int32)),
     r"weight_scale_2 of layer \[192, 64\] is I32 \[\]; allowed: F32 or BF16 or F16 \[\] or \[1\]"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "weight_scale_2", -sd[p + "weight_scale_2"]), "not finite and > 0"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "weight_scale", sd[p + "weight_scale"].view(torch.uint8).fill_(0x7F)),
     "up_proj.weight_scale.*values are not finite and >= 0 .e.g. nan"),
    ("mxfp8", lambda sd, p: sd.__setitem__(p + "weight_scale", sd[p + "weight_scale"].view(torch.uint8).fill_(0xFF)),
     "up_proj.weight_scale.*values are not finite"),
    ("mxfp8", lambda sd, p: sd.__setitem__(p + "weight_scale", sd[p + "weight_scale"].float()),
     r"weight_scale of layer \[192, 64\] is F32 \[256, 4\]; allowed: F8_E8M0 or U8 \[256, 4\]"),
    ("mxfp8", lambda sd, p: sd.__setitem__(p + "comfy_quant", tag({"format": "mxfp8", "group_size": 16})),
     "layer 'layers.1.mlp.up_proj' .mxfp8.: group_size 16; ComfyUI's mxfp8 has groups of 32"),
    ("int8_tensorwise", lambda sd, p: sd.__setitem__(p + "weight_scale", torch.ones(3)),
     r"weight_scale of layer \[192, 64\] is F32 \[3\]; allowed: F32 or BF16 or F16 \[\] or \[1\] or \[192\] or \[192, 1\]"),
    ("int8_tensorwise", lambda sd, p: sd.__setitem__(p + "weight_scale", torch.tensor(0.0)), "not finite and > 0"),
    ("int8_tensorwise", lambda sd, p: sd.__setitem__(p + "comfy_quant", tag({"format": "int8_tensorwise", "convrot": True})),
     "does not fit its tag: its 64 inputs are not a multiple of its convrot_groupsize 256"),  # ComfyUI's default group
    ("int8_tensorwise", lambda sd, p: sd.__setitem__(p + "weight", sd[p + "weight"].float()),
     r"a int8_tensorwise weight is I8 \[rows, columns\], not F32"),
    ("nvfp4", lambda sd, p: sd.__setitem__(p + "comfy_quant", tag({"format": "nvfp4", "orig_shape": [190, "x"]})),
     r"orig_shape \[190, 'x'\] must be \[out, in\]"),
]


@pytest.mark.parametrize("fmt,change,fragment", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_bad_scales_and_tags_get_a_checkpoint_error_naming_file_layer_and_field(files, tmp_path, fmt, change, fragment):
    path = _damaged(files, tmp_path, fmt, change)
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    msg = str(info.value)
    assert path.name in msg and "layers.1.mlp.up_proj" in msg and "\n" not in msg, msg
    import re
    assert re.search(fragment, msg), msg


def test_a_padded_layer_reads_its_real_shape_from_orig_shape(tmp_path):
    """ComfyUI pads nvfp4 to tiles of 16: a [60, 40] weight is stored [64, 48 / 2]; the tag's orig_shape says so."""
    w = torch.randn(60, 40, generator=torch.Generator().manual_seed(4))
    scale = w.abs().amax() / (448 * 6)
    q, block = ck.quantize_nvfp4(w, scale, pad_16x=True)
    from engine.features.quant.comfy.linear import _nvfp4_from_stored
    layer = _nvfp4_from_stored({"weight": q, "weight_scale": block, "weight_scale_2": scale, "shape": (60, 40)})
    want = ck.dequantize_nvfp4(q, scale, block, torch.float32)[:60, :40]
    assert torch.equal(layer.dequantize(), want) and layer(torch.ones(2, 40)).shape == (2, 60)
    stored, _ = kitchen_tensors("nvfp4", torch.randn(64, 48))
    assert stored["weight"].shape == (64, 24) and json.loads(bytes(tag({"a": 1}).tolist())) == {"a": 1}


def test_int8_tensorwise_with_a_scale_per_row_loads(files, tmp_path):
    """Files from trainers that quantize per row (OneTrainer's layout): ``weight_scale`` F32 [out, 1]."""
    sd = load_file(str(files["int8_tensorwise", "tensor"]))
    key = PREFIX + "layers.0.mlp.gate_proj."
    q, scale = ck.quantize_int8_rowwise(SD["layers.0.mlp.gate_proj.weight"].float())
    sd[key + "weight"], sd[key + "weight_scale"] = q, scale
    path = tmp_path / "rowwise.safetensors"
    save_file(sd, str(path))
    layer = load_model(path, dtype="fp32").layers[0].mlp.gate_proj
    assert scale.shape == (CFG.ffn_hidden_size, 1) and torch.equal(layer.dequantize(), ck.dequantize_int8_simple(q, scale))
    x = torch.randn(33, CFG.hidden_size, generator=torch.Generator().manual_seed(6))
    ours, exact = layer(x), F.linear(x, layer.dequantize())
    assert Q.relative_error(ours, ck.int8_linear(x, q, scale, None, torch.float32)) < 1e-2  # activations rounded apart
    assert Q.relative_error(ours, exact) < 2e-2


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel_ranks_run_comfy_nvfp4_shards(files):
    """Two real gloo worker processes, each holding its share of the nvfp4 bytes: the sample matches one
    process's (row-parallel layers sum their halves: float32 rounding apart)."""
    with torch.inference_mode():
        one = _sample(open_engine(files["nvfp4", "tensor"], _config()))
    eng = open_engine(files["nvfp4", "tensor"], _config(tp=2))
    try:
        two = _sample(eng)
    finally:
        eng.release()
    assert float((two - one).abs().max()) <= 1e-5 * float(one.abs().max())


def test_prepare_says_which_matmul_each_format_runs_here(files, tmp_path):
    """On this CPU: nvfp4 / mxfp8 dequantized (Blackwell's GEMMs need sm100), int8_tensorwise the torch._int_mm
    W8A8; a layer tagged full_precision_matrix_mult keeps the dequantized path whatever the device has."""
    for fmt, note in (("nvfp4", "nvfp4 matmul: dequantized per layer by comfy-kitchen, then a dense GEMM (CPU)"),
                      ("mxfp8", "mxfp8 matmul: dequantized per layer by comfy-kitchen, then a dense GEMM (CPU)")):
        model = load_model(files[fmt, "tensor"])
        assert Q.prepare_fast_paths(model) == [note]
        assert all(m.full_precision and not m.use_kitchen for m in model.modules() if isinstance(m, CLASSES[fmt]))
    assert Q.prepare_fast_paths(load_model(files["int8_w8a8"])) == ["int8_tensorwise matmul: torch._int_mm W8A8 (CPU)"]
    plain = tmp_path / "nvfp4-untagged-precision.safetensors"
    write_comfy(plain, SD, "nvfp4", full_precision=False)
    assert not any(getattr(m, "full_precision", True) for m in load_model(plain).modules() if isinstance(m, NVFP4Linear))


def test_a_mixed_file_of_nvfp4_fp8_and_kept_layers_loads_each_as_stored(files, tmp_path):
    """ComfyUI's "Mixed NVFP4" files: most layers nvfp4, some float8_e4m3fn (a scale per tensor), some kept."""
    sd = load_file(str(files["nvfp4", "tensor"]))
    ref = load_file(str(files["nvfp4", "dense"]))
    fp8, kept = "layers.1.mlp.linear_fc2", "layers.0.self_attention.to_out.0"
    w = SD[fp8 + ".weight"].float()
    scale = w.abs().amax() / 448
    sd[PREFIX + fp8 + ".weight"] = (w / scale).to(torch.float8_e4m3fn)
    sd[PREFIX + fp8 + ".weight_scale"] = scale
    del sd[PREFIX + fp8 + ".weight_scale_2"]
    sd[PREFIX + fp8 + ".comfy_quant"] = tag({"format": "float8_e4m3fn"})
    ref[fp8 + ".weight"] = sd[PREFIX + fp8 + ".weight"].float() * scale
    for leaf in ("weight_scale", "weight_scale_2", "comfy_quant"):
        del sd[f"{PREFIX}{kept}.{leaf}"]
    sd[f"{PREFIX}{kept}.weight"] = ref[kept + ".weight"] = SD[kept + ".weight"]
    path, dense = tmp_path / "mixed.safetensors", tmp_path / "mixed-ref.safetensors"
    save_file(sd, str(path))
    save_file(ref, str(dense))
    model = load_model(path, dtype="fp32")
    assert type(model.get_submodule(fp8)) is Q.FP8Linear and type(model.get_submodule(kept)) is torch.nn.Linear
    assert Q.model_quant_format(model) == "mixed" and type(model.layers[0].mlp.gate_proj) is NVFP4Linear
    with torch.inference_mode():
        torch.testing.assert_close(model(*inputs()), load_model(dense, dtype="fp32")(*inputs()), rtol=1e-5, atol=1e-6)
