"""The weight-format table (engine/features/quant/registry.py) is the single source: a format registered there
(here a toy symmetric int16, per output channel; the real int8 is
engine/features/quant/int8/, tests/quant/test_int8.py) is parsed, applied, fused and split, counted in bytes, written
by ``sgld quantize``, read back from the file and refused when a file holds an integer weight no format reads,
with no other change to the engine. The option's choices are the table's."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine import CheckpointError, load_model
from engine.cli import main
from engine.config import EngineConfig
from engine.features import quant as Q
from engine.features.fuse import fuse_projections, fused_groups, remove_fused_projections
from engine.features.quant.prequantized import QuantPlan
from engine.io import readers
from engine.io.checkpoint import open_checkpoint
from engine.io.safetensors import SafetensorsFile
from engine.loading import estimate_bytes
from engine.models.ernie_image import FAMILY
from engine.models.random_weights import SIZES, random_model, save_random_checkpoint
from engine.options import declared

CFG = SIZES["tiny"]


class ToyInt16Linear(nn.Module):
    def __init__(self, weight, scale, bias=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantize(self, dtype=torch.float32):
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x):
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def _quantize(w, bias, group):
    scale = (w.float().abs().amax(dim=1) / 32767).clamp(min=1e-12)
    return ToyInt16Linear((w.float() / scale[:, None]).round().clamp(-32767, 32767).to(torch.int16), scale, bias)


def _read_layers(plan, keys):
    layers = {}
    for k in sorted(keys):
        layer = k[: -len(".weight")]
        if k.endswith(".weight") and plan.ckpt.header(k)[0] == torch.int16 and layer + ".weight_scale" in keys:
            layers[layer] = {"scale_key": layer + ".weight_scale", "shape": plan.ckpt.header(k)[1]}
    return layers


TOY = Q.WeightFormat(
    "toy-int16", ToyInt16Linear, parse=lambda t: 0 if t == "toy-int16" else None, choices=("toy-int16",),
    quantize=_quantize, weight_bytes=lambda shape, group, dense: 2 * shape[0] * shape[1] + 4 * shape[0],
    from_stored=lambda p: ToyInt16Linear(p["weight"], p["weight_scale"]),
    dequantize=lambda p: p["weight"].float() * p["weight_scale"].float()[:, None], read_layers=_read_layers,
    concat=lambda parts, bias: ToyInt16Linear(torch.cat([p.weight for p in parts]),
                                              torch.cat([p.weight_scale for p in parts]), bias),
    rows=lambda m, a, b, bias: ToyInt16Linear(m.weight[a:b].clone(), m.weight_scale[a:b].clone(), bias))


@pytest.fixture
def toy():
    Q.register_format(TOY)
    yield TOY
    Q.unregister_format("toy-int16")


def _inputs(b=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, CFG.in_channels, 6, 6, generator=g)
    return x, torch.tensor([400.0] * b), torch.randn(b, 5, CFG.text_in_dim, generator=g), torch.tensor([5, 3])


def test_the_quant_option_offers_the_tables_names():
    assert tuple(declared(EngineConfig)["quant"].choices) == Q.choices() == Q.FORMATS
    names = list(Q.FORMAT_TABLE)
    assert names[:2] == ["fp8", "int4"] and [n for n in names if n.startswith("int8")] == ["int8", "int8-weight",
                                                                                           "int8-tensorwise"]
    assert names[-6:] == ["nvfp4", "mxfp8", "int8-tensorwise", "convrot-w4a4", "asym-w4a8-int8",
                          "awq-w4a16"]  # ComfyUI's layouts (quant/comfy/), after GGUF's
    assert [n for n in names if n.startswith("q")] == ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                                                       "q5_k", "q6_k"]


def test_a_registered_format_is_parsed_applied_fused_and_split(toy):
    assert Q.parse_format("toy-int16") == ("toy-int16", 0) and "toy-int16" in Q.choices()
    assert "toy-int16" in declared(EngineConfig)["quant"].choices and EngineConfig(quant="TOY-INT16").quant == "toy-int16"
    ref = random_model(CFG, seed=0)
    with torch.no_grad():
        y_ref = ref(*_inputs()).float()
    m = random_model(CFG, seed=0)
    patch = Q.apply_quant(m, "toy-int16")
    assert patch.warnings == [] and Q.model_quant_format(m) == "toy-int16" and patch.describe()["format"] == "toy-int16"
    assert isinstance(m.layers[0].mlp.linear_fc2, ToyInt16Linear)
    state = m.state_dict()
    assert fuse_projections(m) == 2 * CFG.num_layers  # the table's concat joins the format's parts
    assert isinstance(m.layers[0].self_attention.qkv, ToyInt16Linear) and fused_groups(m) == (2 * CFG.num_layers,) * 2
    fused_state = m.state_dict()  # the checkpoint's names, split back by rows
    assert fused_state.keys() == state.keys() and all(torch.equal(fused_state[k], state[k]) for k in state)
    with torch.no_grad():
        y = m(*_inputs()).float()
    assert 0 < Q.relative_error(y, y_ref) < 1e-3
    assert remove_fused_projections(m) and isinstance(m.layers[0].self_attention.to_k, ToyInt16Linear)
    assert Q.apply_quant(m, "fp8").warnings[0].endswith("re-quantized from toy-int16 to fp8")
    assert Q.remove_quant(m) and Q.model_quant_format(m) is None


def test_a_registered_format_is_written_and_read_back(toy, tmp_path):
    src, dst = tmp_path / "bf16.safetensors", tmp_path / "toy.safetensors"
    save_random_checkpoint(str(src), CFG, seed=0, dtype=torch.bfloat16)
    at_load = load_model(src, quant="toy-int16")  # quantized while reading
    assert Q.model_quant_format(at_load) == "toy-int16"
    assert estimate_bytes(src, quant="toy-int16") == Q.weight_bytes(at_load)
    Q.quantize_file(str(src), str(dst), "toy-int16")
    stored = load_file(str(dst))
    assert stored["layers.0.mlp.gate_proj.weight"].dtype == torch.int16
    assert stored["layers.0.mlp.gate_proj.weight_scale"].shape == (CFG.ffn_hidden_size,)
    assert json.loads(open_checkpoint(str(dst)).files[0].metadata["sgld_quant"])["format"] == "toy-int16"
    plan = QuantPlan(open_checkpoint(str(dst)))
    assert {v["kind"] for v in plan.layers.values()} == {"toy-int16"} and len(plan.layers) == 7 * CFG.num_layers
    from_file = load_model(dst)  # the table's read_layers / from_stored
    assert Q.model_quant_format(from_file) == "toy-int16"
    a, b = at_load.state_dict(), from_file.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_integer_weight_no_format_reads_is_refused(tmp_path):
    path = tmp_path / "i16.safetensors"
    save_random_checkpoint(str(path), CFG, seed=0)
    sd = load_file(str(path))
    sd["layers.0.mlp.gate_proj.weight"] = sd["layers.0.mlp.gate_proj.weight"].to(torch.int16)
    sd["layers.0.mlp.gate_proj.weight_scale"] = torch.ones(CFG.ffn_hidden_size)
    save_file(sd, str(path))
    formats = re.escape(", ".join(Q.FORMAT_TABLE))  # the table's names, int8 among them (it reads I8 only)
    with pytest.raises(CheckpointError, match=r"i16.safetensors: tensor 'layers.0.mlp.gate_proj.weight': a quantized "
                                              r"weight stored as I16 that no weight format reads \(formats: " + formats):
        load_model(path)


# -- the seams of issue 34 item 5: a reader reports its tensors' kinds, a format says whether tensor parallel splits
# it, ``sgld quantize`` writes through the writer table, and help texts and the docs table come from the tables.
class KindFile(SafetensorsFile):
    """A toy file kind whose int16 tensors are a format's own bytes (as a GGUF file's blocks are): ``kind``."""

    def kind(self, key):
        return "toy-raw" if self.dtype(key) == torch.int16 else None


def _raw_format(split):
    return Q.WeightFormat(
        "toy-raw", ToyInt16Linear, parse=lambda t: 0 if t == "toy-raw" else None, choices=("toy-raw",),
        quantize=lambda w, bias, group: None, weight_bytes=lambda shape, group, dense: 2 * shape[0] * shape[1],
        from_stored=lambda p: ToyInt16Linear(p["weight"], torch.ones(p["weight"].shape[0])),
        dequantize=lambda p: p["weight"].float(),
        read_layers=lambda plan, keys: {k[: -len(".weight")]: {"shape": plan.ckpt.header(k)[1]}
                                        for k in sorted(keys) if plan.ckpt.kind(k) == "toy-raw"},
        concat=lambda parts, bias: None, rows=lambda m, a, b, bias: None, split=split)


def _split(module, index, parts, dim):
    return ToyInt16Linear(module.weight.chunk(parts, dim)[index].clone(), module.weight_scale.chunk(parts)[index].clone()
                          if dim == 0 else module.weight_scale.clone())


@pytest.fixture
def kind_reader():
    r = readers.register_reader(readers.Reader("toykind", (".toykind",), lambda head: False, KindFile))
    yield r
    readers.unregister_reader(r.name)


@pytest.mark.parametrize("split", [_split, None], ids=["splits", "cannot-split"])
def test_a_readers_kinds_are_claimed_by_a_format_and_tensor_parallel_asks_the_format(kind_reader, tmp_path, split):
    """A weight stored as a format's own bytes (no scale, integer) passes the dtype check because its reader says
    what it is, loads as the format's module, and shards under tensor parallel when the format has a ``split``."""
    save_random_checkpoint(str(tmp_path / "m.safetensors"), CFG, seed=0)
    sd = load_file(str(tmp_path / "m.safetensors"))
    for k in list(sd):
        if k.endswith(".weight") and FAMILY.is_block_linear(k[: -len(".weight")]):
            sd[k] = (sd[k].float() * 1000).round().to(torch.int16)
    path = tmp_path / "m.toykind"
    save_file(sd, str(path))
    fmt = Q.register_format(_raw_format(split))
    try:
        model = load_model(path)
        gate = model.layers[0].mlp.gate_proj
        assert isinstance(gate, ToyInt16Linear) and torch.equal(gate.dequantize(), sd["layers.0.mlp.gate_proj.weight"].float())
        if split is None:
            with pytest.raises(CheckpointError, match=r"m.toykind: tensor parallel needs a dense .* this one is pre-quantized"):
                load_model(path, shard=(2, 1))
        else:
            shard = load_model(path, shard=(2, 1))
            rows = CFG.ffn_hidden_size // 2
            assert torch.equal(shard.layers[0].mlp.gate_proj.dequantize(), gate.dequantize()[rows:])  # column parallel
            fc2 = model.layers[0].mlp.linear_fc2.dequantize()
            assert torch.equal(shard.layers[0].mlp.linear_fc2.dequantize(), fc2[:, rows:])  # row parallel
    finally:
        Q.unregister_format(fmt.name)


def test_the_docs_table_and_the_help_are_the_tables():
    """docs/attention_compile_quant.md's format table, its `quant` option row and CLI line are what
    ``python -m tools.format_docs`` writes from the table; the --quant tooltip and --format help say the same."""
    from tools.format_docs import PAGE, render
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    assert text == render(text), "docs/attention_compile_quant.md is stale: run python -m tools.format_docs"
    for name in Q.choices():
        assert f"| `{name}`" in text or f" / `{name}` |" in text, name
    assert Q.describe_formats() in declared(EngineConfig)["quant"].tooltip
    assert "q4_k" in Q.describe_formats() and "int8-weight:" in Q.describe_formats()


def test_a_registered_format_is_in_the_generated_table_and_help(toy, capsys):
    from tools.format_docs import table
    assert "| `toy-int16` |" in table() and "toy-int16" in Q.describe_formats()
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "toy-int16" in capsys.readouterr().out  # the sgld writer takes every format no other writer claims


@pytest.fixture
def toy_writer():
    written = []

    def write(src, dst, fmt, dtype=None):
        with open(dst, "wb") as f:
            f.write(b"toy")
        written.append((src, fmt))
        return {"input": src, "output": dst, "format": fmt, "layers": 0, "output_bytes": 3}

    w = Q.register_writer(Q.FileWriter("toyw", "TOYW", ".toyw", write, formats=lambda: ("toy-w",), help="a toy file"))
    yield written
    Q.unregister_writer(w.name)


def test_sgld_quantize_writes_through_the_writer_table(toy_writer, bf16_src, tmp_path, capsys):
    assert main(["quantize", str(bf16_src), str(tmp_path / "o.toyw"), "--format", "toy-w"]) == 0
    assert toy_writer == [(str(bf16_src), "toy-w")] and (tmp_path / "o.toyw").read_bytes() == b"toy"
    assert main(["quantize", str(bf16_src), str(tmp_path / "o.safetensors"), "--format", "toy-w"]) == 2
    assert "--format toy-w writes a TOYW file: the output must end in .toyw" in capsys.readouterr().err
    assert main(["quantize", str(bf16_src), str(tmp_path / "x.toyw"), "--format", "fp8"]) == 2
    assert "output '" in (err := capsys.readouterr().err) and "is a TOYW file: --format must be a TOYW type (toy-w)" in err
    assert sorted(os.listdir(tmp_path)) == ["bf16.safetensors", "o.toyw"]


@pytest.fixture
def bf16_src(tmp_path):
    path = tmp_path / "bf16.safetensors"
    save_random_checkpoint(str(path), CFG, seed=0, dtype=torch.bfloat16)
    return path


def test_a_comfyui_tagged_layer_is_read_by_the_format_that_names_its_tag(tmp_path):
    """ComfyUI's per-layer tag (``X.comfy_quant``) names a format; the entry whose ``comfy_formats`` holds it reads
    the layer (the next ComfyUI layouts are one package each); a tag no entry names is refused, listing them."""
    path = tmp_path / "tagged.safetensors"
    save_random_checkpoint(str(path), CFG, seed=0)
    sd = load_file(str(path))
    layer = _quantize(sd["layers.0.mlp.gate_proj.weight"], None, 0)
    sd["layers.0.mlp.gate_proj.weight"], sd["layers.0.mlp.gate_proj.weight_scale"] = layer.weight.data, layer.weight_scale.data
    sd["layers.0.mlp.gate_proj.comfy_quant"] = torch.tensor(list(b'{"format": "toy_i16"}'), dtype=torch.uint8)
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match=r"layer 'layers.0.mlp.gate_proj' uses ComfyUI quantization format "
                                              r"'toy_i16', which SGLDiffusion does not load \(supported: float8_e4m3fn"):
        load_model(path)
    fmt = Q.register_format(dataclasses.replace(TOY, comfy_formats=("toy_i16",)))
    try:
        gate = load_model(path).layers[0].mlp.gate_proj
        assert isinstance(gate, ToyInt16Linear) and torch.equal(gate.dequantize(), layer.dequantize())
    finally:
        Q.unregister_format(fmt.name)
