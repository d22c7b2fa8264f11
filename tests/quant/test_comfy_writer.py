"""``sgld quantize --format nvfp4|mxfp8|int8-tensorwise|float8-e4m3fn|convrot-w4a4|asym-w4a8-int8`` writes ComfyUI's
own layout with comfy-kitchen's quantizers
(engine/features/quant/comfy/convert.py). ComfyUI 0.3.75, the server the tests run, has no ``comfy/quant_ops.py``
and reads none of these formats, so the check against ComfyUI's loader is at source level: each layer is
rebuilt as the newest ``comfy/ops.py`` ``_load_quantized_module`` does it (pop the weight and the format's scales,
view the block scales as the format's fp8 type, ``Params(**scales, orig_dtype, orig_shape)``, a
``QuantizedTensor`` of comfy-kitchen's layout class, which ComfyUI's ``QUANT_ALGOS`` names), and its weight and
its ``F.linear`` are what this engine computes. The demo's picture through each format passes the judge,
through ``sgld generate --model``."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import load_model
from engine.cli import main
from engine.engine import Engine
from engine.features import quant as Q

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
# ComfyUI's QUANT_ALGOS (comfy/quant_ops.py): format -> storage type, layout class, the scales _load_quantized_module
# pops (Params field -> (tensor leaf, dtype it is viewed as)), the layout parameters it reads from the tag
QUANT_ALGOS = {
    "nvfp4": (torch.uint8, "TensorCoreNVFP4Layout", {"scale": ("weight_scale_2", None),
                                                     "block_scale": ("weight_scale", torch.float8_e4m3fn)}, {}),
    "mxfp8": (torch.float8_e4m3fn, "TensorCoreMXFP8Layout", {"scale": ("weight_scale", torch.float8_e8m0fnu)}, {}),
    "int8_tensorwise": (torch.int8, "TensorWiseINT8Layout", {"scale": ("weight_scale", None)}, {}),
    "float8_e4m3fn": (torch.float8_e4m3fn, "TensorCoreFP8Layout", {"scale": ("weight_scale", None)}, {}),
    "convrot_w4a4": (torch.int8, "TensorCoreConvRotW4A4Layout", {"scale": ("weight_scale", None)},
                     {"convrot_groupsize": 256, "linear_dtype": "int4"}),
    "asym_w4a8_int8": (torch.int8, "AsymW4A8Int8Layout", {"scale": ("weight_s_rel", torch.float8_e4m3fn),
                                                          "s_channel": ("weight_s_channel", None),
                                                          "codebook": ("weight_codebook", None)},
                       {"group_size": 16, "convrot_groupsize": 256}),
}
FORMATS = {"nvfp4": "nvfp4", "mxfp8": "mxfp8", "int8-tensorwise": "int8_tensorwise", "float8-e4m3fn": "float8_e4m3fn",
           "convrot-w4a4": "convrot_w4a4", "asym-w4a8-int8": "asym_w4a8_int8"}
ENTRY = {"float8-e4m3fn": "fp8"}  # the format entry that reads a --format's layers, where its name differs
EXACT_LINEAR = ("nvfp4", "mxfp8")  # ComfyUI's F.linear dequantizes these on this machine, as the engine does


def comfy_load(sd: dict, layer: str, shape, dtype=torch.bfloat16):
    """One linear's weight as ComfyUI's ``_load_quantized_module`` builds it, from the file's tensors."""
    conf = json.loads(sd.pop(f"{layer}.comfy_quant").numpy().tobytes())
    storage, layout, scales, layout_params = QUANT_ALGOS[conf["format"]]
    params = {name: conf.get(name, default) for name, default in layout_params.items()}
    for name, (leaf, view) in scales.items():
        v = sd.pop(f"{layer}.{leaf}", None)
        params[name] = v if view is None or v is None else v.view(view)
    if conf["format"] == "convrot_w4a4":
        params["quant_group_size"] = 64
    cls = ck_tensor.get_layout_class(layout)
    weight = sd.pop(f"{layer}.weight").to(storage)
    return conf, ck_tensor.QuantizedTensor(weight, layout, cls.Params(**params, orig_dtype=dtype, orig_shape=tuple(shape)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sgld_quantize_writes_comfyuis_layout_that_its_loader_reads(bf16_file, tmp_path, fmt):
    out = tmp_path / f"ernie-{fmt}.safetensors"
    assert main(["quantize", str(bf16_file), str(out), "--format", fmt]) == 0
    sd = load_file(str(out))
    model = load_model(out)
    assert Q.model_quant_format(model) == ENTRY.get(fmt, fmt) and model.dtype == torch.bfloat16
    layers = sorted(k[: -len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant"))
    assert len(layers) == 7 * model.config.num_layers  # the blocks' attention and MLP; modulation and norms kept
    assert not any(k.startswith(("adaLN", "final", "time", "x_embedder")) and sd[k].dtype != torch.bfloat16 for k in sd)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for layer in layers:
        ours = model.get_submodule(layer)
        exact = fmt in EXACT_LINEAR or fmt == "int8-tensorwise"  # else comfy-kitchen rounds in the output dtype
        conf, weight = comfy_load(sd, layer, (ours.out_features, ours.in_features), torch.bfloat16 if exact else torch.float32)
        params = {"convrot-w4a4": {"convrot_groupsize": 64}, "asym-w4a8-int8": {"group_size": 16, "convrot_groupsize": 64}}
        assert conf == {"format": FORMATS[fmt], **params.get(fmt, {})}  # the tiny model's 64 / 192 inputs: groups of 64
        if exact:  # as ComfyUI dequantizes it in the model's dtype
            assert torch.equal(weight.dequantize(), ours.dequantize(torch.bfloat16)), layer
        else:  # (fp8's product, the rotation back): the float32 weights compared
            assert torch.equal(weight.dequantize(), ours.dequantize()), layer
        if ours.in_features == x.shape[1] and fmt in EXACT_LINEAR:
            with torch.inference_mode():
                assert torch.equal(F.linear(x, weight), ours(x)), layer
    assert not [k for k in sd if k.startswith(tuple(layers))]  # every tensor of a quantized layer is one it pops


def test_sgld_generate_and_bench_take_a_comfy_file(tmp_path, capsys):
    out = str(tmp_path / "demo-nvfp4.safetensors")
    assert main(["quantize", "demo", out, "--format", "nvfp4"]) == 0
    png = tmp_path / "nvfp4.png"
    assert main(["generate", "--prompt", "a red circle", "--model", out, "--steps", "2", "--out", str(png), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["model"] == "demo-nvfp4.safetensors" and png.is_file()
    assert "nvfp4 layers (comfy_quant)" in captured.err  # the loader says what it read
    assert main(["bench", "--model", out, "--steps", "0", "--repeat", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quant"] == "comfy nvfp4"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", *(pytest.param(f, marks=pytest.mark.slow) for f in (  # W8A8: 9 s
    "int8-tensorwise", "float8-e4m3fn", "convrot-w4a4", "asym-w4a8-int8"))])
def test_the_demo_picture_through_each_comfy_format_passes_the_judge(tmp_path, fmt):
    """The demo DiT written by `sgld quantize --format <fmt>` in ComfyUI's layout and loaded from that file:
    the judge accepts the picture, close to the fp16 model's (PSNR above 25 dB)."""
    from test_demo_model import assert_the_judge_passes_close_to_fp16
    out = str(tmp_path / f"demo-{fmt}.safetensors")
    assert main(["quantize", "demo", out, "--format", fmt]) == 0

    def make_engine():
        engine = Engine(load_model(out))
        assert Q.model_quant_format(engine.model) == ENTRY.get(fmt, fmt)
        return engine

    psnr = assert_the_judge_passes_close_to_fp16(make_engine)
    print(f"{fmt}: PSNR {psnr:.1f} dB against the fp16 demo")
