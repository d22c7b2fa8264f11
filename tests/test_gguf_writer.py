"""`sgld quantize --format <GGUF type>` (engine/features/quant/gguf_convert.py): a tiny random ERNIE-Image
checkpoint written as GGUF and read back with the real `gguf` package's reader and numpy dequantizer, against
the layout city96's ComfyUI-GGUF loads (its loader.py / tools/convert.py, see docs/quantization.md)."""
import json
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gq
from safetensors.torch import load_file

from engine.cli import main
from engine.features.quant import gguf_numerics as gn
from engine.features.quant.modules import is_block_linear
from engine.models.random_weights import SIZES, save_random_checkpoint

Q = GGMLQuantizationType
CFG = SIZES["tiny"]
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
    layer = key.rpartition(".")[0]
    if key.endswith(".weight") and is_block_linear(layer):
        return qtype
    return Q.F32 if len(shape) == 1 or int(np.prod(shape)) <= 1024 else Q.BF16  # ComfyUI-GGUF convert.py rules


@pytest.mark.parametrize("fmt", list(gn.NAMES))
def test_sgld_quantize_writes_comfyui_gguf_layout(bf16_file, tmp_path, fmt, capsys):
    out = tmp_path / f"ernie-{fmt}.gguf"
    assert main(["quantize", str(bf16_file), str(out), "--format", fmt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layers"] == 7 * CFG.num_layers and summary["dense_layers"] == []
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
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        stored = tuple(int(v) for v in reversed(t.shape))
        if stored != shape:  # reshaped only when the rows are not whole blocks, into rows of 256
            assert shape[-1] % block and stored == (int(np.prod(shape)) // 256, 256), t.name
        # the file's bytes are our quantizer's output for this tensor ...
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        ours = gn.quantize(ref.reshape(stored), t.tensor_type).numpy().reshape(-1)
        assert np.array_equal(raw, ours), t.name
        if t.tensor_type in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # ... = gguf's own bytes
            theirs = np.ascontiguousarray(gq.quantize(ref.reshape(stored).numpy(), t.tensor_type)).view(np.uint8)
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
    t = next(t for t in reader.tensors if t.name == "layers.1.mlp.linear_fc2.weight")
    ref = load_file(str(bf16_file))[t.name].float().numpy()
    got = gq.dequantize(np.ascontiguousarray(t.data), Q.Q8_0).reshape(ref.shape)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05  # fp8 then q8_0
