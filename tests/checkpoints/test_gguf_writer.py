"""`sgld quantize --format <GGUF type>` (engine/features/quant/gguf/convert.py): a tiny random ERNIE-Image
checkpoint written as GGUF and read back with the real `gguf` package's reader and numpy dequantizer, against
the layout city96's ComfyUI-GGUF loads (its loader.py / tools/convert.py, see docs/quantization.md)."""
import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gq
from gguf_files import model_inputs
from safetensors.torch import load_file

from engine.cli import main
from engine.features.quant.gguf import numerics as gn
from engine.features.quant.gguf.convert import FALLBACK
from engine.models.ernie_image import FAMILY, ErnieImageConfig
from engine.models.random_weights import SIZES, save_random_checkpoint

Q = GGMLQuantizationType
# every block linear has 256-multiple inputs (as the 8B model's 4096 / 12288), so the K types fit them all
CFG = ErnieImageConfig(hidden_size=256, num_layers=1, num_attention_heads=4, ffn_hidden_size=256, in_channels=16,
                       out_channels=16, text_in_dim=64, rope_axes_dim=(16, 24, 24))
TINY = SIZES["tiny"]  # inputs 64 / 192: not whole K blocks
# ComfyUI-GGUF loader.py IMG_ARCH_LIST: the general.architecture values it accepts for a diffusion model
COMFYUI_GGUF_IMG_ARCHS = {"flux", "sd1", "sdxl", "sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan",
                          "lumina2", "qwen_image"}
# rough relative RMS error bounds of a tiny model's block weights per type (the values are gaussian)
ERROR_BOUND = {"f32": 0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.01, "q6_k": 0.03, "q5_1": 0.05, "q5_0": 0.06,
               "q5_k": 0.06, "q4_1": 0.1, "q4_0": 0.11, "q4_k": 0.11, "q3_k": 0.2, "q2_k": 0.4}


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "ernie-bf16.safetensors"
    save_random_checkpoint(str(p), CFG, seed=0, dtype=torch.bfloat16)
    return p


def _field(reader, key):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _torch_shape(reader, tensor):
    """The tensor's torch shape as ComfyUI-GGUF's loader.py get_orig_shape reads it: the ARRAY of INT32 under
    comfy.gguf.orig_shape.<name>, else the GGUF shape reversed."""
    f = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
    if f is None:
        return tuple(int(v) for v in reversed(tensor.shape))
    assert f.types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    return tuple(int(v) for v in f.contents())


def _expected_type(key, shape, qtype):
    if key.endswith(".weight") and FAMILY.is_block_linear(key.rpartition(".")[0]):
        return qtype
    return Q.F32 if len(shape) == 1 or int(np.prod(shape)) <= 1024 else Q.BF16  # ComfyUI-GGUF convert.py rules


@pytest.mark.parametrize("fmt", list(gn.NAMES))
def test_sgld_quantize_writes_comfyui_gguf_layout(bf16_file, tmp_path, fmt, capsys):
    out = tmp_path / f"ernie-{fmt}.gguf"
    assert main(["quantize", str(bf16_file), str(out), "--format", fmt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layers"] == 7 * CFG.num_layers and summary["fallback"] == {}
    assert os.listdir(tmp_path) == [out.name]  # the atomic writer's temporary file is gone
    qtype = gn.NAMES[fmt]
    source = load_file(str(bf16_file))
    reader = GGUFReader(str(out))
    assert _field(reader, "general.architecture") in COMFYUI_GGUF_IMG_ARCHS
    assert _field(reader, "general.quantization_version") == 2
    assert json.loads(_field(reader, "ernie_image_config"))["rope_axes_dim"] == list(CFG.rope_axes_dim)
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(source)  # diffusers' names, no prefix (convert.py writes none either)
    assert all(len(n) <= 127 for n in names)  # ComfyUI-GGUF's MAX_TENSOR_NAME_LENGTH
    errors = []
    for t in reader.tensors:
        ref = source[t.name].float()
        shape = _torch_shape(reader, t)
        assert shape == tuple(ref.shape), t.name
        assert t.tensor_type == _expected_type(t.name, shape, qtype), (t.name, t.tensor_type.name)
        assert reader.get_field(f"comfy.gguf.orig_shape.{t.name}") is None  # nothing stored reshaped
        # the file's bytes are our quantizer's output for this tensor ...
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        ours = gn.quantize(ref, t.tensor_type).numpy().reshape(-1)
        assert np.array_equal(raw, ours), t.name
        if t.tensor_type in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # ... = gguf's own bytes
            theirs = np.ascontiguousarray(gq.quantize(ref.numpy(), t.tensor_type)).view(np.uint8)
            assert np.array_equal(raw, theirs.reshape(-1)), t.name
        # ... and gguf's numpy dequantizer and ours decode them alike, close to the source
        values = gq.dequantize(np.ascontiguousarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        assert np.array_equal(gn.dequantize(torch.from_numpy(raw.copy()), t.tensor_type, shape).numpy(), values)
        if t.tensor_type == qtype:
            errors.append(float(np.linalg.norm(values - ref.numpy()) / np.linalg.norm(ref.numpy())))
        elif t.tensor_type in (Q.F32, Q.BF16):
            assert np.array_equal(values, ref.numpy()), t.name  # bf16 source: exact in F32 / BF16
    assert errors and max(errors) <= ERROR_BOUND[fmt], (fmt, max(errors))
    assert summary["output_bytes"] == os.path.getsize(out)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0"])
def test_rows_of_partial_blocks_get_llama_cpp_fallback(tmp_path, fmt, capsys):
    # the tiny model's linears have 64 / 192 inputs: no whole K block (256) per row
    src = tmp_path / "tiny.safetensors"
    save_random_checkpoint(str(src), TINY, seed=0, dtype=torch.float32)
    out = tmp_path / "t.gguf"
    assert main(["quantize", str(src), str(out), "--format", fmt]) == 0
    qtype = gn.NAMES[fmt]
    want = FALLBACK.get(qtype, qtype)
    said = capsys.readouterr().out
    assert (f"14 as {Q(want).name.lower()} (rows not whole blocks)" in said) == (want != qtype), said  # Q5_0 for Q4_K, Q8_0 for Q6_K; Q8_0 (blocks of 32) fits as it is
    types = {t.name: t.tensor_type for t in GGUFReader(str(out)).tensors}
    blocks = {k: v for k, v in types.items() if FAMILY.is_block_linear(k.rpartition(".")[0]) and k.endswith(".weight")}
    assert len(blocks) == 7 * TINY.num_layers and set(blocks.values()) == {want}
    assert types["text_proj.weight"] == Q.F32  # fp32 source: dense tensors as stored


def test_gguf_sizes_shrink_with_the_type(bf16_file, tmp_path):
    sizes = {}
    for fmt in ("bf16", "q8_0", "q4_k", "q2_k"):
        out = tmp_path / f"m-{fmt}.gguf"
        assert main(["quantize", str(bf16_file), str(out), "--format", fmt]) == 0
        sizes[fmt] = os.path.getsize(out)
    assert sizes["bf16"] > sizes["q8_0"] > sizes["q4_k"] > sizes["q2_k"], sizes


def test_gguf_dense_dtype_option(bf16_file, tmp_path):
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(bf16_file), str(out), "--format", "Q8_0", "--dtype", "fp16"]) == 0
    types = {t.name: t.tensor_type for t in GGUFReader(str(out)).tensors}
    assert types["text_proj.weight"] == Q.F16 and types["layers.0.mlp.up_proj.weight"] == Q.Q8_0
    assert types["final_linear.bias"] == Q.F32


def test_gguf_format_and_output_name_must_agree(bf16_file, tmp_path, capsys):
    assert main(["quantize", str(bf16_file), str(tmp_path / "o.gguf"), "--format", "fp8"]) == 2
    assert "is a GGUF file: --format must be a GGUF type" in capsys.readouterr().err
    assert main(["quantize", str(bf16_file), str(tmp_path / "o.safetensors"), "--format", "q4_k"]) == 2
    assert "writes a GGUF file: the output must end in .gguf" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_gguf_failed_write_keeps_the_old_file(bf16_file, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    calls = []

    def failing(weight, qtype, real=gn.quantize):
        calls.append(qtype)
        if len(calls) == 5:  # stands in for a full disk or Ctrl-C in the middle of the tensors
            raise OSError("no space left on device")
        return real(weight, qtype)

    monkeypatch.setattr(gn, "quantize", failing)
    assert main(["quantize", str(bf16_file), str(out), "--format", "q4_0"]) == 2
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["m.gguf"]


def test_gguf_from_a_prequantized_file(bf16_file, tmp_path):
    fp8 = tmp_path / "m-fp8.safetensors"
    assert main(["quantize", str(bf16_file), str(fp8), "--format", "fp8"]) == 0
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(fp8), str(out), "--format", "q8_0"]) == 0
    reader = GGUFReader(str(out))
    names = {t.name for t in reader.tensors}
    assert names == set(load_file(str(bf16_file)))  # the fp8 scales are folded in, not copied
    t = next(t for t in reader.tensors if t.name == "layers.0.mlp.linear_fc2.weight")
    ref = load_file(str(bf16_file))[t.name].float().numpy()
    got = gq.dequantize(np.ascontiguousarray(t.data), Q.Q8_0).reshape(ref.shape)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05  # fp8 then q8_0


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q2_k"])
def test_written_file_loads_in_our_loader_and_runs_the_dequantized_weights(tmp_path, fmt):
    """sgld quantize --format X -> engine.load_model (engine/io/gguf.py): the blocks stay GGUF layers, and the
    forward equals, exactly, that of the same file dequantized by gguf's numpy code and loaded as
    safetensors (both run float32 on equal values), and stays near the unquantized model's."""
    from safetensors.torch import save_file

    from engine import load_model
    from engine.features import quant as Q
    from engine.features.quant.gguf.linear import GGUFLinear

    src = tmp_path / "m.safetensors"
    save_random_checkpoint(str(src), CFG, seed=0, dtype=torch.float32)
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(src), str(out), "--format", fmt]) == 0
    model = load_model(str(out), dtype="fp32")
    layer = model.layers[0].mlp.linear_fc2
    assert isinstance(layer, GGUFLinear) and layer.QTYPE == gn.NAMES[fmt] and layer.weight.dtype == torch.uint8
    assert Q.model_quant_format(model) == fmt
    reader = GGUFReader(str(out))
    dequantized = {t.name: torch.from_numpy(gq.dequantize(np.ascontiguousarray(t.data), t.tensor_type)
                                            .astype(np.float32).reshape(_torch_shape(reader, t))) for t in reader.tensors}
    ref_path = tmp_path / "dequantized.safetensors"
    save_file(dequantized, str(ref_path), metadata={"ernie_image_config": _field(reader, "ernie_image_config")})
    with torch.inference_mode():
        got = model(*model_inputs(CFG))
        want = load_model(str(ref_path), dtype="fp32")(*model_inputs(CFG))
        dense = load_model(str(src), dtype="fp32")(*model_inputs(CFG))
    assert torch.equal(got, want), f"max |difference| {(got - want).abs().max().item():.3g}"
    err = Q.relative_error(got, dense)
    assert 0 < err < {"q8_0": 0.002, "q4_k": 0.03, "q2_k": 0.1}[fmt], err  # measured: 0.0004, 0.0067, 0.024


def test_gguf_input_requantized(bf16_file, tmp_path):
    """A GGUF file (read by engine/io/gguf.py) as the input: its blocks are dequantized and written in the new
    type, its dense tensors keep their type and bytes (bf16 stays BF16, not outvoted by the F32 norms)."""
    q8 = tmp_path / "m-q8_0.gguf"
    assert main(["quantize", str(bf16_file), str(q8), "--format", "q8_0"]) == 0
    out = tmp_path / "m-q4_k.gguf"
    assert main(["quantize", str(q8), str(out), "--format", "q4_k"]) == 0
    first = {t.name: t for t in GGUFReader(str(q8)).tensors}
    for t in GGUFReader(str(out)).tensors:
        src = first[t.name]
        if src.tensor_type == Q.Q8_0:
            assert t.tensor_type == Q.Q4_K
            values = torch.from_numpy(gq.dequantize(np.ascontiguousarray(src.data), Q.Q8_0).astype(np.float32))
            want = gn.quantize(values.reshape(_torch_shape(GGUFReader(str(q8)), src)), Q.Q4_K).numpy()
            assert np.array_equal(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1), want.reshape(-1))
        else:
            assert t.tensor_type == src.tensor_type and np.array_equal(t.data, src.data), t.name


def test_gguf_bad_values_name_the_tensor_and_new_folders_are_made(tmp_path, capsys):
    from safetensors.torch import save_file

    from engine.models.random_weights import random_state_dict

    sd = random_state_dict(CFG, seed=0)
    sd["layers.0.mlp.up_proj.weight"][3, 5] = float("inf")
    src = tmp_path / "bad.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "new" / "folder" / "m.gguf"
    assert main(["quantize", str(src), str(out), "--format", "q4_k"]) == 2
    err = capsys.readouterr().err
    assert "bad.safetensors: tensor 'layers.0.mlp.up_proj.weight': cannot quantize to Q4_K" in err
    assert "NaN or infinite" in err and os.listdir(out.parent) == []  # no output, no temporary file
    sd["layers.0.mlp.up_proj.weight"][3, 5] = 0.0
    save_file(sd, str(src))
    assert main(["quantize", str(src), str(out), "--format", "q4_k"]) == 0 and out.is_file()


_COMFYUI_GGUF_CHECK = r"""
import json, sys
sys.argv = ["check", "--cpu"]  # ComfyUI's model_management must not look for a GPU
import comfy.options
comfy.options.enable_args_parsing()
import numpy as np, torch
from gguf import GGUFReader, quants
from comfyui_gguf.loader import gguf_sd_loader
from comfyui_gguf.dequant import dequantize_tensor, is_quantized
out = {}
for path in sys.argv_files:
    sd, arch = gguf_sd_loader(path, return_arch=True)
    raw = {t.name: t for t in GGUFReader(path).tensors}
    equal = 0
    for k, v in sd.items():
        theirs = dequantize_tensor(v, dtype=torch.float32, dequant_dtype=torch.float32)
        t = raw[k]
        ref = quants.dequantize(np.ascontiguousarray(t.data), t.tensor_type).astype(np.float32).reshape(tuple(v.shape))
        equal += bool(np.array_equal(theirs.numpy(), ref))
    out[path] = {"arch": arch, "shapes": {k: list(v.shape) for k, v in sd.items()}, "equal": equal,
                 "quantized": sum(bool(is_quantized(v)) for v in sd.values())}
print(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not os.path.isfile(os.path.join(os.environ.get("SGLD_COMFYUI_GGUF_DIR", "-"), "loader.py")),
                    reason="set SGLD_COMFYUI_GGUF_DIR to a checkout of city96/ComfyUI-GGUF (not a dependency)")
def test_comfyui_gguf_loader_reads_our_files(bf16_file, tmp_path):
    """city96's ComfyUI-GGUF itself (its loader.py gguf_sd_loader and dequant.py, in a subprocess with ComfyUI
    on the path) loads every type we write: the architecture accepted, diffusers' names, torch shapes, and its
    float32 dequantization equal to gguf's numpy code for every tensor."""
    import subprocess
    import sys

    from comfy_server import COMFY_DIR

    if not os.path.isdir(os.path.join(COMFY_DIR, "comfy")):
        pytest.skip(f"no ComfyUI at {COMFY_DIR}")
    pkgs = tmp_path / "pkgs"
    pkgs.mkdir()
    os.symlink(os.path.abspath(os.environ["SGLD_COMFYUI_GGUF_DIR"]), pkgs / "comfyui_gguf")
    files = []
    for fmt in gn.NAMES:
        files.append(str(tmp_path / f"m-{fmt}.gguf"))
        assert main(["quantize", str(bf16_file), files[-1], "--format", fmt]) == 0
    script = _COMFYUI_GGUF_CHECK.replace("sys.argv_files", repr(files))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkgs), COMFY_DIR])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    source = load_file(str(bf16_file))
    for path in files:
        got = result[path]
        assert got["arch"] == "wan" and got["equal"] == len(source), (path, got["equal"])
        assert got["shapes"] == {k: list(v.shape) for k, v in source.items()}
        assert got["quantized"] >= 7 * CFG.num_layers or path.endswith(("f16.gguf", "f32.gguf"))
