"""The rest of ComfyUI's QUANT_ALGOS: convrot_w4a4, asym_w4a8_int8, awq_w4a16 and int8_tensorwise with ConvRot
rotation, written in ComfyUI's layout by comfy-kitchen's own quantizers (AWQ: round-to-nearest in its layout,
comfy-kitchen has no AWQ quantizer; tests/comfy_quant_files.py), load and compute as the same weights dequantized
by comfy-kitchen; Cache-DiT, a LoRA side path, layer-wise offload and tensor-parallel shards run them; the GPU
path's comfy-kitchen linears (their eager backend here) agree with the dequantized layer; bad tensors or tags
only ever get a CheckpointError naming file, layer and field. (nvfp4, mxfp8, int8_tensorwise: test_comfy_formats.py.)"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from comfy_quant_files import NEW_FORMATS, PREFIX, ROTATION, W4A8_GROUP, tag, write_comfy
from safetensors.torch import load_file, save_file
from test_comfy_formats import CFG, SD, _config, _sample, inputs

from engine import CheckpointError, load_model
from engine.features import patching
from engine.features import quant as Q
from engine.features.cache import CacheConfig
from engine.features.quant.comfy import AWQW4A16Linear, ConvRotW4A4Linear, Int8TensorwiseLinear, W4A8Linear
from engine.router import open_engine

ck = pytest.importorskip("comfy_kitchen")
CLASSES = {"int8_convrot": Int8TensorwiseLinear, "convrot_w4a4": ConvRotW4A4Linear, "asym_w4a8_int8": W4A8Linear,
           "awq_w4a16": AWQW4A16Linear}
ENTRY = {"int8_convrot": "int8-tensorwise", "convrot_w4a4": "convrot-w4a4", "asym_w4a8_int8": "asym-w4a8-int8",
         "awq_w4a16": "awq-w4a16"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("comfyq4")
    out = {}
    for fmt in NEW_FORMATS:
        out[fmt] = d / f"ernie-{fmt}.safetensors"
        dense = write_comfy(out[fmt], SD, fmt, "header" if fmt == "asym_w4a8_int8" else "tensor")
        out[fmt, "dense"] = d / f"ernie-{fmt}-dense.safetensors"
        save_file(dense, str(out[fmt, "dense"]))
    out["w8a8"] = d / "ernie-int8-convrot-w8a8.safetensors"
    write_comfy(out["w8a8"], SD, "int8_convrot", full_precision=False)
    return out


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_each_format_loads_and_computes_as_its_kitchen_dequantized_weights(files, fmt):
    model = load_model(files[fmt], dtype="fp32")
    assert type(model.layers[1].mlp.up_proj) is CLASSES[fmt] and Q.model_quant_format(model) == ENTRY[fmt]
    ref = load_model(files[fmt, "dense"], dtype="fp32")
    with torch.inference_mode():
        assert torch.equal(model(*inputs()), ref(*inputs()))  # the same float32 weights, the same GEMMs
    stored = sum(v.numel() * v.element_size() for k, v in load_file(str(files[fmt])).items()
                 if (".self_attention.to" in k or ".mlp." in k) and not k.endswith(".comfy_quant"))
    dense = sum(v.numel() * 4 for k, v in SD.items() if ".self_attention.to" in k or ".mlp." in k)
    assert Q.weight_bytes(model, only_block_linears=True) == stored < dense / (3 if fmt == "int8_convrot" else 5)


def test_int8_convrot_computes_w8a8_on_rotated_activations_as_comfy_kitchen_does(files):
    layer = load_model(files["w8a8"], dtype="fp32").layers[0].mlp.gate_proj
    assert layer.rotation == ROTATION and not layer.full_precision and layer.weight_scale.shape == (CFG.ffn_hidden_size,)
    x = torch.randn(37, layer.in_features, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = layer(x)
        theirs = ck.int8_linear(x, layer.weight, layer.weight_scale, None, torch.float32, convrot=True,
                                convrot_groupsize=ROTATION)
        exact = F.linear(x, layer.dequantize())
    assert Q.relative_error(ours, theirs) < 2e-3 and Q.relative_error(ours, exact) < 2e-2


@pytest.mark.parametrize("fmt", ["convrot_w4a4", "asym_w4a8_int8"])
def test_the_gpu_path_is_comfy_kitchens_linear_and_cpu_dequantizes(files, fmt):
    """``kitchen_forward`` (ComfyUI's matmul: on CUDA comfy-kitchen's int4 / W4A8 kernels, here its eager backend)
    agrees with the dequantized weight within the probe's bound; on this CPU prepare keeps the dequantized GEMM."""
    model = load_model(files[fmt], dtype="fp32")
    layer = model.layers[0].mlp.gate_proj
    x = torch.randn(33, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        err = Q.relative_error(layer.kitchen_forward(x, None), F.linear(x, layer.dequantize()))
    assert err < layer.PROBE_ERROR / 2, err
    assert f"{fmt} matmul: dequantized per layer by comfy-kitchen, then a dense GEMM (CPU)" in Q.prepare_fast_paths(model)


def test_awq_runs_comfy_kitchens_gemv_in_the_scales_dtype(files):
    """bf16 activations (the scales' dtype): ComfyUI's ``gemv_awq_w4a16``; float32 ones keep the dequantized path."""
    layer = load_model(files["awq_w4a16"], dtype="fp32").layers[0].mlp.gate_proj
    assert layer.full_precision  # the file's tags say full_precision_matrix_mult: always dequantized
    layer.full_precision = False  # as a tag without it
    x = torch.randn(9, layer.in_features, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        theirs = ck.gemv_awq_w4a16(x.bfloat16(), layer.weight, layer.weight_scale, layer.weight_zeros, None, 32)
        assert layer.weight_scale.dtype == torch.bfloat16 and torch.equal(layer(x.bfloat16()), theirs)
        assert torch.equal(layer(x), F.linear(x, layer.dequantize()))


def test_cache_dit_lora_and_offload_run_the_new_formats(files, tmp_path):
    """One of each through the existing mechanisms: Cache-DiT on AWQ, a LoRA side path (exact removal) on ConvRot
    W4A4, layer-wise offload streaming the W4A8 bytes."""
    cache = CacheConfig(enabled=True, preset="fast")
    with torch.inference_mode():
        a = _sample(open_engine(files["awq_w4a16"], _config()), steps=6, cache=cache)
        b = _sample(open_engine(files["awq_w4a16", "dense"], _config()), steps=6, cache=cache)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 192, generator=g) * 0.1, torch.randn(64, 4, generator=g) * 0.1
    lora = tmp_path / "l.safetensors"
    save_file({"transformer.layers.1.mlp.linear_fc2.lora_A.weight": a, "transformer.layers.1.mlp.linear_fc2.lora_B.weight": b},
              str(lora))
    eng = open_engine(files["convrot_w4a4"], _config())
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with torch.inference_mode():
        y0 = eng.model(*inputs())
        eng.set_loras([(str(lora), 0.8)])
        fc2 = eng.model.layers[1].mlp.linear_fc2
        assert isinstance(fc2, ConvRotW4A4Linear) and type(fc2).__name__.endswith("WithLoRA")
        xi = torch.randn(3, 192)
        torch.testing.assert_close(fc2(xi), F.linear(xi, fc2.dequantize()) + 0.8 * F.linear(F.linear(xi, a), b),
                                   rtol=1e-5, atol=1e-5)
        eng.set_loras([])
        assert torch.equal(eng.model(*inputs()), y0) and patching.get(eng.model, "lora") is None
    assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in before.items())
    ref = open_engine(files["asym_w4a8_int8"], _config())
    off = open_engine(files["asym_w4a8_int8"], _config(offload="layerwise", resident_layers=1))
    assert off.offload is not None and torch.int8 in {p.dtype for p in off.model.layers[0].mlp.parameters()}
    with torch.inference_mode():
        assert torch.equal(off.model(*inputs()), ref.model(*inputs()))
    assert off.offload.transfers > 0


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_tensor_parallel_shards_split_the_stored_bytes_on_whole_groups(files, fmt):
    whole = load_model(files[fmt], dtype="fp32").layers[0].mlp
    rows = CFG.ffn_hidden_size // 2
    for i in range(2):
        part = load_model(files[fmt], dtype="fp32", shard=(2, i)).layers[0].mlp
        assert type(part.gate_proj) is CLASSES[fmt]
        assert torch.equal(part.gate_proj.dequantize(), whole.gate_proj.dequantize()[i * rows:(i + 1) * rows])
        torch.testing.assert_close(part.linear_fc2.dequantize(), whole.linear_fc2.dequantize()[:, i * rows:(i + 1) * rows],
                                   rtol=0, atol=1e-6)  # the rotation's GEMM over fewer groups: float32 rounding apart


def test_a_split_off_the_rotation_groups_is_refused_with_the_reason():
    layer = ConvRotW4A4Linear.from_dense(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)))
    assert layer.rotation == 256
    with pytest.raises(ValueError, match=r"ComfyUI convrot_w4a4 layer \[64, 256\] cannot be split over 2 ranks along its "
                                         r"inputs on whole groups \(ConvRot / scale groups\) of 256; use ulysses_degree"):
        Q.get_format("convrot-w4a4").split(layer, 0, 2, 1)


def test_a_six_bit_w4a8_layer_loads_and_splits(files, tmp_path):
    """comfy-kitchen's W6A8 (``bits=6``: a 3 in / 4 byte row, no codebook) is the same ComfyUI format."""
    sd = load_file(str(files["asym_w4a8_int8"]))
    key = PREFIX + "layers.0.mlp.linear_fc2."
    w = SD["layers.0.mlp.linear_fc2.weight"].float()
    q, s_rel, s_channel, _, codebook = ck.quantize_w4a8_int8_weight(w, W4A8_GROUP, ROTATION, bits=6)
    assert codebook is None and q.shape == (64, 192 * 3 // 4)
    sd.update({key + "weight": q, key + "weight_s_rel": s_rel, key + "weight_s_channel": s_channel})
    del sd[key + "weight_codebook"]
    path = tmp_path / "w6a8.safetensors"
    save_file(sd, str(path), metadata={"_quantization_metadata": load_file_meta(files["asym_w4a8_int8"])})
    layer = load_model(path, dtype="fp32").layers[0].mlp.linear_fc2
    want = ck.dequantize_w4a8_int8_weight(q, s_rel, s_channel, None, None, W4A8_GROUP, ROTATION, torch.float32)
    assert layer.bits == 6 and torch.equal(layer.dequantize(), want)
    half = load_model(path, dtype="fp32", shard=(2, 1)).layers[0].mlp.linear_fc2
    torch.testing.assert_close(half.dequantize(), want[:, 96:], rtol=0, atol=1e-6)


def test_a_mixed_file_with_dense_layers_is_one_architecture(files, tmp_path):
    """Packed I8 rows ([out, in / 2]) next to dense ones: the architecture check counts the values the tag says."""
    sd = load_file(str(files["convrot_w4a4"]))
    kept = "layers.0.mlp.linear_fc2"
    for leaf in ("weight_scale", "comfy_quant"):
        del sd[f"{PREFIX}{kept}.{leaf}"]
    sd[f"{PREFIX}{kept}.weight"] = SD[kept + ".weight"]
    path = tmp_path / "mixed-w4a4.safetensors"
    save_file(sd, str(path))
    model = load_model(path, dtype="fp32")
    assert type(model.layers[0].mlp.linear_fc2) is torch.nn.Linear and type(model.layers[1].mlp.linear_fc2) is ConvRotW4A4Linear


def load_file_meta(path) -> str:
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return f.metadata()["_quantization_metadata"]


def _set(leaf, value):
    return lambda sd, p: sd.__setitem__(p + leaf, value(sd[p + leaf]) if callable(value) else value)


BAD = [  # (format, change of layers.1.mlp.up_proj [192, 64]'s tensors, what the message says)
    ("int8_convrot", _set("comfy_quant", tag({"format": "int8_tensorwise", "convrot": "yes"})), "convrot must be true or false"),
    ("int8_convrot", _set("comfy_quant", tag({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 32})),
     r"convrot_groupsize 32 must be a power of 4"),
    ("int8_convrot", _set("weight_scale", lambda t: t.reshape(1, -1)),
     r"weight_scale of layer \[192, 64\] is F32 \[1, 192\]; allowed: F32 or BF16 or F16 \[\] or \[1\] or \[192\] or \[192, 1\]"),
    ("convrot_w4a4", _set("weight_scale", lambda t: -t), "weight_scale.*values are not finite and > 0"),
    ("convrot_w4a4", _set("weight_scale", lambda t: t[:3]), r"allowed: F32 or BF16 or F16 \[192\] or \[192, 1\]"),
    ("convrot_w4a4", _set("comfy_quant", tag({"format": "convrot_w4a4", "convrot_groupsize": 256})),
     "does not fit its tag: its 64 inputs are not a multiple of its convrot_groupsize 256"),
    ("convrot_w4a4", _set("comfy_quant", tag({"format": "convrot_w4a4", "params": {"convrot_groupsize": 16}, "linear_dtype": "fp4"})),
     "linear_dtype 'fp4' must be 'int4' or 'int8'"),
    ("convrot_w4a4", _set("weight", lambda t: t.view(torch.uint8)), r"a convrot_w4a4 weight is I8 \[rows, columns\], not U8"),
    ("asym_w4a8_int8", lambda sd, p: sd.pop(p + "weight_s_channel"), "asym_w4a8_int8 weight without its '.*up_proj.weight_s_channel'"),
    ("asym_w4a8_int8", _set("weight_s_rel", lambda t: t[:, :3].contiguous()), r"an asym_w4a8_int8 weight of 48 inputs .* not \[192, 32\]"),
    ("asym_w4a8_int8", _set("weight_s_rel", lambda t: t.view(torch.uint8).fill_(0x7F)), "weight_s_rel.*values are not finite"),
    ("asym_w4a8_int8", _set("weight_codebook", lambda t: t[:8]), r"weight_codebook of layer \[192, 64\] is F32 \[8\]; allowed: .*\[16\]"),
    ("asym_w4a8_int8", _set("weight_correction", torch.zeros(4, 192)), "ComfyUI's loader .comfy/ops.py. ignores the correction"),
    ("awq_w4a16", _set("weight_zeros", lambda t: t[:1]), r"weight_zeros of layer \[192, 64\] is BF16 \[1, 192\]; allowed: .*\[2, 192\]"),
    ("awq_w4a16", _set("weight_scale", lambda t: torch.zeros_like(t)), "weight_scale.*values are not finite and > 0"),
    ("awq_w4a16", _set("comfy_quant", tag({"format": "awq_w4a16", "group_size": 48})),
     "its 64 inputs are not a multiple of its group_size 48"),
]


@pytest.mark.parametrize("fmt,change,fragment", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_bad_tensors_and_tags_get_a_checkpoint_error_naming_file_layer_and_field(files, tmp_path, fmt, change, fragment):
    sd = load_file(str(files[fmt]))
    if fmt == "asym_w4a8_int8":  # that file's tags are in the header: this layer's goes into a tensor
        sd[PREFIX + "layers.1.mlp.up_proj.comfy_quant"] = tag({"format": fmt, "group_size": W4A8_GROUP,
                                                              "convrot_groupsize": ROTATION})
    change(sd, PREFIX + "layers.1.mlp.up_proj.")
    path = tmp_path / f"bad-{fmt}.safetensors"
    save_file(sd, str(path), metadata={"_quantization_metadata": load_file_meta(files[fmt])} if fmt == "asym_w4a8_int8" else None)
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    msg = str(info.value)
    assert path.name in msg and "layers.1.mlp.up_proj" in msg and "\n" not in msg, msg
    assert re.search(fragment, msg), msg
