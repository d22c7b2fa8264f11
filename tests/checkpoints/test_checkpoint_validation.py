"""Bad checkpoints are refused up front with one CheckpointError line naming the file and the tensor or field
(issue 17, items 5, 7, 8 and the .bin part of 14): small files that would ask for a huge model, pre-quantized
files with missing or wrong companions, safetensors the format forbids, malformed metadata / config.json /
index files, and a fuzz run over byte flips of a tiny checkpoint's header."""
import importlib.util
import json
import os
import pickle
import random
import struct
import subprocess
import sys

import pytest
import torch
from comfy_quant_files import write_comfy
from safetensors.torch import load_file, save_file

import engine
from engine import CheckpointError, load_model
from engine.features import quant as Q
from engine.models.ernie_image import MAX_LAYERS, ErnieImageConfig
from engine.models.random_weights import SIZES, random_state_dict, save_random_checkpoint

CFG = SIZES["tiny"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Very small models: NANO for the many-layer file, MICRO (int4 groups of 32 fit) for the many loads of the fuzz test.
NANO = ErnieImageConfig(hidden_size=8, num_layers=1, num_attention_heads=2, ffn_hidden_size=8, in_channels=4,
                        out_channels=4, text_in_dim=8, rope_axes_dim=(0, 2, 2))
MICRO = ErnieImageConfig(hidden_size=32, num_layers=2, num_attention_heads=2, ffn_hidden_size=32, in_channels=4,
                         out_channels=4, text_in_dim=8, rope_axes_dim=(4, 6, 6))


def refused(path, *fragments, **kwargs) -> str:
    """Load ``path``; it must raise CheckpointError (nothing else), one line holding every fragment."""
    with pytest.raises(CheckpointError) as info:
        load_model(path, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in: {msg}"
    return msg


def write_raw(path, header, data=b"", raw_header=None):
    """A safetensors file from a header dict (or raw header bytes) and data bytes, as crafted as needed."""
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


# -- item 5: the key set is checked before anything is built ----------------------------------------------------
@pytest.mark.subprocess
def test_stray_layer_key_and_num_layers_metadata_are_refused_before_any_build(tmp_path):
    """One stray key `layers.20000.x`, or metadata num_layers=20000, used to build a 20001-layer model
    (about 1 GB and a minute) before the refusal. Measured in a fresh process: peak RSS must not grow."""
    sd = random_state_dict(CFG, 0)
    stray = tmp_path / "stray.safetensors"
    save_file({**sd, "layers.20000.x": torch.zeros(1)}, str(stray))
    meta = tmp_path / "layers20000.safetensors"
    save_file(sd, str(meta), metadata={"ernie_image_config": json.dumps({"num_layers": 20000})})
    probe = (
        "import json, os, resource, sys\n"
        "from engine import CheckpointError, load_model\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "out = []\n"
        "for p in sys.argv[1:]:\n"
        "    base = max(rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
        "    try:\n"
        "        load_model(p); msg = 'loaded'\n"
        "    except CheckpointError as e:\n"
        "        msg = str(e)\n"
        "    out.append([msg, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base])\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", probe, str(stray), str(meta)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    (stray_msg, stray_growth), (meta_msg, meta_growth) = json.loads(res.stdout.strip().splitlines()[-1])
    assert "stray.safetensors" in stray_msg and "'layers.20000.x'" in stray_msg and f"limit of {MAX_LAYERS - 1}" in stray_msg
    assert "layers20000.safetensors" in meta_msg and "metadata 'ernie_image_config': field 'num_layers' = 20000" in meta_msg
    assert "disagrees with the tensors, which give 2" in meta_msg
    assert stray_growth < 50 * 2 ** 20 and meta_growth < 50 * 2 ** 20, (stray_growth, meta_growth)


def test_layer_numbers_must_be_contiguous_from_zero(tmp_path):
    sd = random_state_dict(CFG, 0)
    sd.update({k.replace("layers.1.", "layers.3."): v.clone() for k, v in sd.items() if k.startswith("layers.1.")})
    save_file(sd, str(tmp_path / "gap.safetensors"))
    refused(tmp_path / "gap.safetensors", "gap.safetensors", "layer 2 is missing but tensor 'layers.3.")
    sd = random_state_dict(CFG, 0)
    sd["layers.01.mlp.up_proj.weight"] = sd["layers.1.mlp.up_proj.weight"].clone()
    save_file(sd, str(tmp_path / "zero.safetensors"))
    refused(tmp_path / "zero.safetensors", "zero.safetensors", "'layers.01.mlp.up_proj.weight'", "layer number")


def test_every_layer_needs_the_tensors_of_layer_zero(tmp_path):
    sd = random_state_dict(CFG, 0)
    del sd["layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "incomplete.safetensors"))
    refused(tmp_path / "incomplete.safetensors", "incomplete.safetensors", "layer 1 is incomplete",
            "'layers.1.mlp.up_proj.weight' is missing")
    sd = random_state_dict(CFG, 0)
    sd["layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "extra.safetensors"))
    refused(tmp_path / "extra.safetensors", "extra.safetensors", "'layers.1.mlp.extra.weight' has no counterpart in layer 0")


def test_layer_count_is_capped(tmp_path):
    """MAX_LAYERS + 1 complete layers of a nano model (a 2 MB file): refused by the documented cap."""
    one = random_state_dict(NANO, 0)
    sd = {k: v for k, v in one.items() if not k.startswith("layers.")}
    for i in range(MAX_LAYERS + 1):
        sd.update({k.replace("layers.0.", f"layers.{i}."): v.clone() for k, v in one.items() if k.startswith("layers.0.")})
    save_file(sd, str(tmp_path / "deep.safetensors"))
    refused(tmp_path / "deep.safetensors", "deep.safetensors", f"'layers.{MAX_LAYERS}.", f"at most {MAX_LAYERS} layers")


@pytest.mark.parametrize("override,field", [
    ({"hidden_size": 128}, "hidden_size"), ({"num_layers": "2"}, "num_layers"), ({"num_layers": True}, "num_layers"),
    ({"num_attention_heads": 8}, "num_attention_heads"), ({"text_in_dim": 64}, "text_in_dim"),
    ({"rope_axes_dim": [4, 6]}, "rope_axes_dim"), ({"rope_axes_dim": [4, 6, 8]}, "rope_axes_dim"),
    ({"rope_axes_dim": [5, 5, 6]}, "rope_axes_dim"), ({"rope_axes_dim": "4,6,6"}, "rope_axes_dim"),
    ({"rope_theta": -1}, "rope_theta"), ({"rope_theta": "big"}, "rope_theta"), ({"eps": 0}, "eps"),
    ({"eps": None}, "eps"), ({"qk_layernorm": False}, "qk_layernorm"),
])
def test_config_in_metadata_must_agree_with_the_shapes(tmp_path, override, field):
    p = tmp_path / "cfg.safetensors"
    save_file(random_state_dict(CFG, 0), str(p), metadata={"ernie_image_config": json.dumps(override)})
    refused(p, "cfg.safetensors", f"metadata 'ernie_image_config': field '{field}'")


def test_config_that_restates_the_shapes_is_accepted(tmp_path):
    p = tmp_path / "full-config.safetensors"
    cfg = {**CFG.to_dict(), "_class_name": "ErnieImageTransformer2DModel", "qk_layernorm": True, "lora_rank": 4}
    save_file(random_state_dict(CFG, 0), str(p), metadata={"ernie_image_config": json.dumps(cfg)})
    assert load_model(p).config == CFG


# -- item 7: quantized files -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sgld_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    dense = d / "dense.safetensors"
    save_random_checkpoint(str(dense), CFG, seed=0, dtype=torch.bfloat16)
    out = {}
    for fmt in ("fp8", "int4-g64"):
        out[fmt] = d / f"{fmt}.safetensors"
        Q.quantize_file(str(dense), str(out[fmt]), fmt)
    return out


def rewrite(src, dst, change):
    """Copy a safetensors file with ``change(state_dict)`` applied, keeping its metadata."""
    from engine.io.safetensors import SafetensorsFile

    sd = load_file(str(src))
    change(sd)
    save_file(sd, str(dst), metadata=SafetensorsFile(str(src)).metadata)
    return dst


UP = "layers.1.mlp.up_proj"  # [192, 64]


def _set(key, value):
    def change(sd):
        sd[key] = value(sd[key]) if callable(value) else value
    return change


def _drop(key):
    return lambda sd: sd.pop(key)


FP8_CASES = [
    ("no-scale", _drop(UP + ".weight_scale"), f"'{UP}.weight': fp8 weight without its scale '{UP}.weight_scale'"),
    ("scale-short", _set(UP + ".weight_scale", lambda s: s[:10]), f"'{UP}.weight_scale'"),
    ("scale-2d", _set(UP + ".weight_scale", lambda s: s[None]), "allowed: F32 [192]"),
    ("scale-scalar", _set(UP + ".weight_scale", torch.ones(())), "allowed: F32 [192]"),
    ("scale-f16", _set(UP + ".weight_scale", lambda s: s.half()), "is F16 [192]"),
    ("scale-int", _set(UP + ".weight_scale", lambda s: s.int()), "is I32 [192]"),
    ("scale-nan", _set(UP + ".weight_scale", lambda s: s.index_fill(0, torch.tensor([5]), float("nan"))), "not finite and > 0"),
    ("scale-zero", _set(UP + ".weight_scale", lambda s: s.index_fill(0, torch.tensor([5]), 0.0)), "not finite and > 0"),
    ("scale-negative", _set(UP + ".weight_scale", lambda s: -s), "not finite and > 0"),
]
INT4_CASES = [
    ("scale-1xg", _set(UP + ".weight_scale", lambda s: s[:1]), f"'{UP}.weight_scale' is BF16 [1, 1]"),
    ("zero-1xg", _set(UP + ".weight_zero", lambda s: s[:1]), f"'{UP}.weight_zero' is BF16 [1, 1]"),
    ("no-zero", _drop(UP + ".weight_zero"), f"int4 weight without '{UP}.weight_zero'"),
    ("no-scale", _drop(UP + ".weight_scale"), f"int4 weight without '{UP}.weight_scale'"),
    ("group-3", _set(UP + ".weight_scale", torch.ones(192, 3, dtype=torch.bfloat16)), "group size dividing in = 64"),
    ("scale-zero-shapes", lambda sd: sd.update({UP + ".weight_scale": torch.ones(192, 2, dtype=torch.bfloat16),
                                                UP + ".weight_zero": torch.zeros(192, 2, dtype=torch.bfloat16)}),
     None),  # consistent [192, 2]: a valid other group size (32); loads
    ("zero-other-shape", _set(UP + ".weight_zero", torch.zeros(192, 2, dtype=torch.bfloat16)), "they must match"),
    ("scale-int", _set(UP + ".weight_scale", lambda s: s.to(torch.int16)), "is I16"),
    # the architecture check counts a packed 4-bit weight's values (two a byte): stored [192, 16] holds [192, 32]
    ("packed-wrong", _set(UP + ".weight", lambda w: w[:, :16].contiguous()), f"'{UP}.weight' has shape (192, 32)"),
    ("packed-wrong-everywhere", lambda sd: sd.update({k: v[:, :16].contiguous() for k, v in sd.items() if k.endswith("up_proj.weight")}),
     "int4 tensor 'layers.0.mlp.up_proj.weight' has shape (192, 32) (stored packed as [192, 16]), but a model of this configuration needs (192, 64)"),
    ("scale-inf", _set(UP + ".weight_scale", lambda s: s.index_fill(0, torch.tensor([0]), float("inf"))), "not finite and > 0"),
    ("zero-nan", _set(UP + ".weight_zero", lambda s: s.index_fill(0, torch.tensor([0]), float("nan"))), "values are not finite"),
]


@pytest.mark.parametrize("name,change,fragment", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_sgld_fp8_companions_are_checked_at_load(sgld_files, tmp_path, name, change, fragment):
    p = rewrite(sgld_files["fp8"], tmp_path / f"fp8-{name}.safetensors", change)
    refused(p, f"fp8-{name}.safetensors", fragment)


@pytest.mark.parametrize("name,change,fragment", INT4_CASES, ids=[c[0] for c in INT4_CASES])
def test_sgld_int4_companions_are_checked_at_load(sgld_files, tmp_path, name, change, fragment):
    p = rewrite(sgld_files["int4-g64"], tmp_path / f"int4-{name}.safetensors", change)
    if fragment is None:
        assert Q.model_quant_format(load_model(p)) == "int4"
    else:
        refused(p, f"int4-{name}.safetensors", fragment)


def _comfy_state(style):
    """A ComfyUI fp8 state dict (per-tensor scales), as in test_quant."""
    sd = random_state_dict(CFG, seed=0)
    out = {}
    for k, v in sd.items():
        layer = k[: -len(".weight")]
        if k.endswith(".weight") and v.dim() == 2:
            scale = v.abs().amax() / 448.0
            out[k] = (v / scale).to(torch.float8_e4m3fn)
            if style == "scaled_fp8":
                out[layer + ".scale_weight"] = scale.reshape(())
            else:
                out[layer + ".weight_scale"] = scale.reshape(())
                out[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        else:
            out[k] = v.to(torch.bfloat16)
    if style == "scaled_fp8":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


COMFY_CASES = [
    ("scaled_fp8", "missing", _drop(UP + ".scale_weight"), f"without its scale '{UP}.scale_weight'"),
    ("scaled_fp8", "per-channel", _set(UP + ".scale_weight", torch.ones(192)), "allowed: a scalar"),
    ("scaled_fp8", "two-scales", _set(UP + ".weight_scale", torch.ones(())), "two scales"),
    ("comfy_quant", "missing", _drop(UP + ".weight_scale"), f"without its scale '{UP}.weight_scale'"),
    ("comfy_quant", "tag-not-json", _set(UP + ".comfy_quant", torch.tensor(list(b"{fmt"), dtype=torch.uint8)),
     f"tensor '{UP}.comfy_quant' is not valid JSON"),
    ("comfy_quant", "tag-list", _set(UP + ".comfy_quant", torch.tensor(list(b"[1]"), dtype=torch.uint8)),
     f"tensor '{UP}.comfy_quant' must be a JSON object"),
    ("comfy_quant", "tag-f32", _set(UP + ".comfy_quant", torch.zeros(3)), f"tensor '{UP}.comfy_quant' is F32 [3]"),
    ("comfy_quant", "tag-format-int", _set(UP + ".comfy_quant", torch.tensor(list(b'{"format": 8}'), dtype=torch.uint8)),
     "format '8'"),
]


@pytest.mark.parametrize("style,name,change,fragment", COMFY_CASES, ids=[f"{c[0]}-{c[1]}" for c in COMFY_CASES])
def test_comfyui_fp8_companions_are_checked_at_load(tmp_path, style, name, change, fragment):
    sd = _comfy_state(style)
    change(sd)
    p = tmp_path / f"comfy-{name}.safetensors"
    save_file(sd, str(p))
    refused(p, f"comfy-{name}.safetensors", fragment)


def test_fp8_scales_all_or_none(tmp_path):
    """An fp8 cast without any scale loads with scale 1 (as ComfyUI reads it); once some weights are scaled,
    a missing scale is a damaged file."""
    plain = {k: (v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.dim() == 2 else v)
             for k, v in random_state_dict(CFG, seed=0).items()}
    save_file(plain, str(tmp_path / "cast.safetensors"))
    assert Q.model_quant_format(load_model(tmp_path / "cast.safetensors")) == "fp8"
    some = dict(plain)
    some["layers.0.mlp.up_proj.weight_scale"] = torch.ones(())
    save_file(some, str(tmp_path / "some.safetensors"))
    refused(tmp_path / "some.safetensors", "some.safetensors", "tensor 'adaLN_modulation.1.weight': fp8 weight without its scale 'adaLN_modulation.1.weight_scale'",
            "fp8 weights are scaled")


# -- item 8: safetensors the format forbids, and malformed metadata / side files --------------------------------
def _ok_entry(offsets, shape=(1,), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _tiny_with(tmp_path, name, change=None, metadata=None):
    """The tiny model as a file, after ``change(state_dict)``, with ``metadata``."""
    sd = random_state_dict(CFG, 0)
    if change:
        change(sd)
    p = tmp_path / name
    save_file(sd, str(p), metadata=metadata)
    return p


def _sgld_meta(tmp_path, name, value):
    p = _tiny_with(tmp_path, name)
    sd = load_file(str(p))
    sd["layers.0.mlp.up_proj.weight"] = sd["layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, str(p), metadata={"sgld_quant": value})
    return p


def _folder(tmp_path, config=None, index=None, shard_name="m.safetensors"):
    d = tmp_path / "pipe" / "transformer"
    d.mkdir(parents=True)
    save_file(random_state_dict(CFG, 0), str(d / shard_name))
    if config is not None:
        (d / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    if index is not None:
        (d / "diffusion_pytorch_model.safetensors.index.json").write_text(index)
    return tmp_path / "pipe"


def _raw(name, header, data=b"", raw_header=None):
    return lambda tmp_path: write_raw(tmp_path / name, header, data, raw_header)


def _appended(name, extra):
    def make(tmp_path):
        p = tmp_path / name
        save_random_checkpoint(str(p), CFG)
        with open(p, "ab") as f:
            f.write(extra)
        return p
    return make


# (case id, make(tmp_path) -> path, file name in the message, field in the message)
BAD_FILES = [
    ("overlap", _raw("overlap.safetensors", {"a": _ok_entry((0, 4)), "b": _ok_entry((0, 4))}, b"\0" * 4),
     "overlap.safetensors", "overlaps tensor 'a'"),
    ("overlap-part", _raw("part.safetensors", {"a": _ok_entry((0, 8), (2,)), "b": _ok_entry((4, 12), (2,))}, b"\0" * 12),
     "part.safetensors", "tensor 'b'"),
    ("gap", _raw("gap.safetensors", {"a": _ok_entry((0, 4)), "b": _ok_entry((8, 12))}, b"\0" * 12),
     "gap.safetensors", "before tensor 'b'"),
    ("leading-gap", _raw("lead.safetensors", {"a": _ok_entry((4, 8))}, b"\0" * 8), "lead.safetensors", "before tensor 'a'"),
    ("trailing-bytes", _appended("trailing.safetensors", b"\0" * 16), "trailing.safetensors", "16 bytes after the last tensor"),
    ("duplicate-key", _raw("dup.safetensors", None, b"\0" * 8, raw_header=b'{"a": {"dtype": "F32", "shape": [1], '
                           b'"data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'),
     "dup.safetensors", "key 'a' appears twice"),
    ("duplicate-field", _raw("dupfield.safetensors", None, b"\0" * 4, raw_header=b'{"a": {"dtype": "F32", "dtype": "F16", '
                             b'"shape": [1], "data_offsets": [0, 4]}}'), "dupfield.safetensors", "key 'dtype' appears twice"),
    ("negative-dim", _raw("neg.safetensors", {"a": _ok_entry((0, 4), (-1, -4))}, b"\0" * 4), "neg.safetensors", "tensor 'a': shape"),
    ("minus-one-dim", _raw("inferred.safetensors", {"a": _ok_entry((0, 0), (-1,))}), "inferred.safetensors", "non-negative integers"),
    ("float-dim", _raw("floatdim.safetensors", {"a": _ok_entry((0, 4), (1.0,))}, b"\0" * 4), "floatdim.safetensors", "tensor 'a': shape"),
    ("string-dim", _raw("strdim.safetensors", {"a": _ok_entry((0, 4), ("1",))}, b"\0" * 4), "strdim.safetensors", "tensor 'a': shape"),
    ("bool-dim", _raw("booldim.safetensors", {"a": _ok_entry((0, 4), (True,))}, b"\0" * 4), "booldim.safetensors", "tensor 'a': shape"),
    ("unknown-dtype", _raw("dtype.safetensors", {"a": _ok_entry((0, 4), dtype="F33")}, b"\0" * 4), "dtype.safetensors", "dtype 'F33'"),
    ("offsets-reversed", _raw("rev.safetensors", {"a": _ok_entry((4, 0), (0,))}, b"\0" * 4), "rev.safetensors", "data_offsets"),
    ("offsets-one", _raw("one.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"\0" * 4),
     "one.safetensors", "data_offsets"),
    ("entry-not-object", _raw("entry.safetensors", {"a": 5}), "entry.safetensors", "header entry 'a'"),
    ("header-list", _raw("list.safetensors", [1, 2]), "list.safetensors", "must be a JSON object"),
    ("header-not-json", _raw("nojson.safetensors", None, raw_header=b"{'a': 1}"), "nojson.safetensors", "header is not valid JSON"),
    ("header-deep", _raw("deep.safetensors", None, raw_header=b"[" * 100000), "deep.safetensors", "header is not valid JSON"),
    ("metadata-int", _raw("metaint.safetensors", {"__metadata__": {"x": 1}, "a": _ok_entry((0, 4))}, b"\0" * 4),
     "metaint.safetensors", "'__metadata__': the value of 'x' must be a string"),
    ("metadata-list", _raw("metalist.safetensors", {"__metadata__": ["x"], "a": _ok_entry((0, 4))}, b"\0" * 4),
     "metalist.safetensors", "'__metadata__' must be an object"),
    ("ernie-config-not-json", lambda t: _tiny_with(t, "ec1.safetensors", metadata={"ernie_image_config": "{rope"}),
     "ec1.safetensors", "metadata 'ernie_image_config' is not valid JSON"),
    ("ernie-config-list", lambda t: _tiny_with(t, "ec2.safetensors", metadata={"ernie_image_config": "[4, 6, 6]"}),
     "ec2.safetensors", "metadata 'ernie_image_config' must be a JSON object"),
    ("ernie-config-types", lambda t: _tiny_with(t, "ec3.safetensors", metadata={"ernie_image_config": '{"rope_axes_dim": [4.0, 6, 6]}'}),
     "ec3.safetensors", "field 'rope_axes_dim'"),
    ("ernie-config-dup", lambda t: _tiny_with(t, "ec4.safetensors", metadata={"ernie_image_config": '{"eps": 1e-6, "eps": 1}'}),
     "ec4.safetensors", "key 'eps' appears twice"),
    ("sgld-quant-not-json", lambda t: _sgld_meta(t, "sq1.safetensors", "fp8"), "sq1.safetensors", "metadata 'sgld_quant' is not valid JSON"),
    ("sgld-quant-list", lambda t: _sgld_meta(t, "sq2.safetensors", '["fp8"]'), "sq2.safetensors", "metadata 'sgld_quant' must be a JSON object"),
    ("sgld-quant-format", lambda t: _sgld_meta(t, "sq3.safetensors", '{"format": 8}'), "sq3.safetensors", "field 'format' = 8"),
    ("sgld-quant-no-format", lambda t: _sgld_meta(t, "sq4.safetensors", '{"version": 1}'), "sq4.safetensors", "field 'format' is missing"),
    ("sgld-quant-dtype", lambda t: _sgld_meta(t, "sq5.safetensors", '{"format": "fp8", "compute_dtype": 16}'),
     "sq5.safetensors", "field 'compute_dtype'"),
    ("sgld-quant-version", lambda t: _sgld_meta(t, "sq6.safetensors", '{"format": "fp8", "version": 2}'),
     "sq6.safetensors", "field 'version' = 2"),
    ("comfy-meta-not-json", lambda t: _tiny_with(t, "cm1.safetensors", metadata={"_quantization_metadata": "{"}),
     "cm1.safetensors", "metadata '_quantization_metadata' is not valid JSON"),
    ("comfy-meta-list", lambda t: _tiny_with(t, "cm2.safetensors", metadata={"_quantization_metadata": "[]"}),
     "cm2.safetensors", "metadata '_quantization_metadata' must be a JSON object"),
    ("comfy-meta-layers", lambda t: _tiny_with(t, "cm3.safetensors", metadata={"_quantization_metadata": '{"layers": ["a"]}'}),
     "cm3.safetensors", "field 'layers'"),
    ("comfy-meta-layer-str", lambda t: _tiny_with(t, "cm4.safetensors", metadata={"_quantization_metadata": '{"layers": {"a": "fp8"}}'}),
     "cm4.safetensors", "field 'layers'"),
    ("config-not-json", lambda t: _folder(t, config="{hidden"), "config.json", "is not valid JSON"),
    ("config-list", lambda t: _folder(t, config="[1]"), "config.json", "must be a JSON object"),
    ("config-types", lambda t: _folder(t, config='{"num_layers": "two"}'), "config.json", "field 'num_layers'"),
    ("config-null", lambda t: _folder(t, config='{"rope_theta": null}'), "config.json", "field 'rope_theta'"),
    ("config-binary", lambda t: _folder(t, config=b"\xff\xfe{"), "config.json", "not valid JSON (not UTF-8 text)"),
    ("index-not-json", lambda t: _folder(t, index="{"), "safetensors.index.json", "is not valid JSON"),
    ("index-list", lambda t: _folder(t, index="[]"), "safetensors.index.json", "must be a JSON object"),
    ("index-no-map", lambda t: _folder(t, index="{}"), "safetensors.index.json", "field 'weight_map'"),
    ("index-map-list", lambda t: _folder(t, index='{"weight_map": ["m.safetensors"]}'), "safetensors.index.json", "field 'weight_map'"),
    ("index-shard-int", lambda t: _folder(t, index='{"weight_map": {"a": 5}}'), "safetensors.index.json", "shard 5 of tensor 'a'"),
    ("index-dotdot", lambda t: _folder(t, index='{"weight_map": {"a": "../m.safetensors"}}'), "safetensors.index.json",
     "shard '../m.safetensors'"),
    ("index-subfolder", lambda t: _folder(t, index='{"weight_map": {"a": "sub/m.safetensors"}}'), "safetensors.index.json",
     "no path separators"),
    ("index-absolute", lambda t: _folder(t, index='{"weight_map": {"a": "/etc/m.safetensors"}}'), "safetensors.index.json",
     "shard '/etc/m.safetensors'"),
    ("index-dotdot-name", lambda t: _folder(t, index='{"weight_map": {"a": ".."}}'), "safetensors.index.json", "shard '..'"),
    ("index-nul", lambda t: _folder(t, index='{"weight_map": {"a": "m\\u0000.safetensors"}}'), "safetensors.index.json",
     "of tensor 'a'"),
    ("index-pickle-shard", lambda t: _folder(t, index='{"weight_map": {"a": "m.bin"}}'), "safetensors.index.json", "shard 'm.bin'"),
    ("int-weight", lambda t: _tiny_with(t, "intw.safetensors", _set("final_linear.weight", lambda w: (w * 100).int())),
     "intw.safetensors", "tensor 'final_linear.weight' is stored as I32"),
    ("u8-weight", lambda t: _tiny_with(t, "u8w.safetensors", _set("layers.0.mlp.up_proj.weight", lambda w: w.to(torch.uint8))),
     "u8w.safetensors", "tensor 'layers.0.mlp.up_proj.weight' is stored as U8"),
    ("bool-bias", lambda t: _tiny_with(t, "boolb.safetensors", _set("final_linear.bias", lambda b: b > 0)),
     "boolb.safetensors", "tensor 'final_linear.bias' is stored as BOOL"),
    ("int-norm-each-layer", lambda t: _tiny_with(t, "intn.safetensors", lambda sd: [sd.__setitem__(k, sd[k].long()) for k in list(sd) if k.endswith("norm_k.weight")]),
     "intn.safetensors", "is stored as I64"),
    ("zero-patch", lambda t: _tiny_with(t, "zp.safetensors", _set("x_embedder.proj.weight", torch.zeros(64, 16, 0, 0))),
     "zp.safetensors", "tensor 'x_embedder.proj.weight' has shape (64, 16, 0, 0)"),
    ("zero-head", lambda t: _tiny_with(t, "zh.safetensors", lambda sd: [sd.__setitem__(k, torch.zeros(0)) for k in list(sd) if "norm_q" in k]),
     "zh.safetensors", "tensor 'layers.0.self_attention.norm_q.weight' has shape (0,)"),
    ("odd-head", lambda t: _tiny_with(t, "oh.safetensors", lambda sd: [sd.__setitem__(k, torch.ones(7)) for k in list(sd) if "norm_" in k]),
     "oh.safetensors", "norm_q.weight"),
    ("patch-3d", lambda t: _tiny_with(t, "p3.safetensors", _set("x_embedder.proj.weight", torch.zeros(64, 16, 1))),
     "p3.safetensors", "tensor 'x_embedder.proj.weight'"),
    ("text-proj-1d", lambda t: _tiny_with(t, "tp.safetensors", _set("text_proj.weight", torch.zeros(64))),
     "tp.safetensors", "tensor 'text_proj.weight'"),
    ("final-not-patch-multiple", lambda t: _tiny_with(t, "fl.safetensors", lambda sd: sd.update({
        "x_embedder.proj.weight": torch.zeros(64, 16, 2, 2), "final_linear.weight": torch.zeros(18, 64)})),
     "fl.safetensors", "tensor 'final_linear.weight'"),
    ("layer-name", lambda t: _tiny_with(t, "ln.safetensors", _set("layers.x.weight", torch.zeros(1))), "ln.safetensors", "'layers.x.weight'"),
]


@pytest.mark.parametrize("case,make,file_name,field", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_files_get_a_checkpoint_error_naming_file_and_field(tmp_path, case, make, file_name, field):
    refused(make(tmp_path), file_name, field)


def test_reference_reader_refuses_the_same_layouts(tmp_path):
    """For comparison: the safetensors package refuses the overlap, gap and trailing-byte layouts too."""
    from safetensors import SafetensorError, safe_open

    for case in ("overlap", "gap", "trailing-bytes", "negative-dim", "metadata-int"):
        make = next(c[1] for c in BAD_FILES if c[0] == case)
        with pytest.raises(SafetensorError):
            with safe_open(str(make(tmp_path)), "pt"):
                pass


def test_valid_edge_layouts_still_load(tmp_path):
    """Header padding with spaces (as writers align to 8 bytes), zero-size tensors and a shard index work."""
    sd = random_state_dict(CFG, 0)
    from engine.io.safetensors import write_safetensors_streaming

    p = tmp_path / "padded.safetensors"
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()] + [("extra_empty", torch.float32, (0, 5))]
    write_safetensors_streaming(str(p), specs, lambda k: sd.get(k, torch.zeros(0, 5)), {})
    from engine.io.safetensors import SafetensorsFile

    assert SafetensorsFile(str(p)).shape("extra_empty") == (0, 5)
    save_file(sd, str(tmp_path / "plain.safetensors"))
    assert load_model(tmp_path / "plain.safetensors").config == CFG


def test_tensor_in_two_shards_is_refused(tmp_path):
    d = tmp_path / "pipe"
    d.mkdir()
    sd = random_state_dict(CFG, 0)
    save_file(sd, str(d / "a.safetensors"))
    save_file({"final_linear.bias": sd["final_linear.bias"]}, str(d / "b.safetensors"))
    refused(d, "tensor 'final_linear.bias' is in two shards, a.safetensors and b.safetensors")


# -- item 14 (one part): .bin / .pt files are judged by their content -------------------------------------------
def test_random_bin_is_not_called_a_pickle(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(random.Random(0).randbytes(4096))
    msg = refused(p, "model.bin: not a safetensors file", "not a pickle either", "pickle checkpoints")
    assert "arbitrary code" not in msg
    (tmp_path / "notes.pt").write_text("just some text")
    refused(tmp_path / "notes.pt", "notes.pt: not a safetensors file")


def test_safetensors_under_a_pickle_name_is_told_to_rename(tmp_path):
    p = tmp_path / "model.bin"
    save_random_checkpoint(str(p), CFG)
    refused(p, "model.bin", "holds safetensors data", "rename it to .safetensors")


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/sgld-pickle-was-executed-ckpt",))


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_real_pickles_under_pickle_names_get_the_pickle_refusal(tmp_path, protocol):
    p = tmp_path / "model.pt"
    p.write_bytes(pickle.dumps({"w": Boom()}, protocol=protocol))
    refused(p, "model.pt", "pickle-based checkpoints", "arbitrary code")
    zp = tmp_path / "zip.pth"
    torch.save({"w": torch.zeros(2)}, str(zp))
    refused(zp, "zip.pth", "pickle-based checkpoints")
    assert not os.path.exists("/tmp/sgld-pickle-was-executed-ckpt")


# -- fuzz: damaged headers give a CheckpointError or a model, never anything else --------------------------------
def _fuzz_bases(tmp_path):
    plain = tmp_path / "base.safetensors"
    sd = random_state_dict(MICRO, 0)
    save_file(sd, str(plain), metadata={"ernie_image_config": json.dumps(MICRO.to_dict())})
    q = tmp_path / "base-fp8.safetensors"
    Q.quantize_file(str(plain), str(q), "fp8")
    q4 = tmp_path / "base-int4.safetensors"
    Q.quantize_file(str(plain), str(q4), "int4")  # in = 8: no group divides it, so the linears stay dense
    comfy = tmp_path / "base-comfy.safetensors"
    csd = {k: ((v / (v.abs().amax() / 448)).to(torch.float8_e4m3fn) if k.endswith(".weight") and v.dim() == 2 else v)
           for k, v in sd.items()}
    csd.update({k[: -len("weight")] + "scale_weight": sd[k].abs().amax().reshape(()) / 448
                for k in sd if k.endswith(".weight") and sd[k].dim() == 2})
    csd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(csd, str(comfy))
    # ComfyUI's block formats as comfy-kitchen writes them: fp8 / U8 block scales, tags in tensors or the header
    kitchen = [] if importlib.util.find_spec("comfy_kitchen") is None else [
        (fmt, tags) for fmt, tags in (("nvfp4", "tensor"), ("mxfp8", "header"), ("int8_tensorwise", "tensor"),
                                      ("int8_convrot", "header"), ("asym_w4a8_int8", "tensor"), ("awq_w4a16", "tensor"))]
    # (convrot_w4a4: comfy-kitchen's quantizer needs inputs in multiples of 64, MICRO's are 32)
    for fmt, tags in kitchen:
        write_comfy(tmp_path / f"base-{fmt}.safetensors", sd, fmt, tags)
    return [plain, q, q4, comfy] + [tmp_path / f"base-{fmt}.safetensors" for fmt, _ in kitchen]


def load_or_refuse(path, data: bytes, outcomes: dict, case: str) -> None:
    """Write ``data`` to ``path`` and load it: it loads, or a one-line CheckpointError names the file; any
    other exception fails the test."""
    path.write_bytes(data)
    try:
        load_model(path)
        outcomes["loaded"] += 1
    except CheckpointError as e:
        assert path.name in str(e) and "\n" not in str(e), str(e)
        outcomes["refused"] += 1
    except Exception as e:  # pragma: no cover - the failure being tested for
        pytest.fail(f"{case}: {type(e).__name__}: {e}")
    os.remove(path)


def test_fuzzed_headers_only_ever_give_checkpoint_errors(tmp_path):
    rng = random.Random(1234)
    bases = _fuzz_bases(tmp_path)
    for base in bases:
        load_model(base)  # each base is valid
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(400):
        base = bases[case % len(bases)]
        data = bytearray(base.read_bytes())
        header_end = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
        how = rng.random()
        if how < 0.6:  # flip 1-3 bytes of the header (JSON text and length prefix)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(header_end)
                data[i] = rng.randrange(256) if rng.random() < 0.5 else data[i] ^ (1 << rng.randrange(8))
        elif how < 0.75:  # replace one header byte by a JSON-significant character
            data[rng.randrange(8, header_end)] = ord(rng.choice('{}[]",:0123456789-.e '))
        elif how < 0.9:  # truncate anywhere
            del data[rng.randrange(len(data)):]
        else:  # insert or delete a header byte (the length prefix no longer fits)
            i = rng.randrange(8, header_end)
            if rng.random() < 0.5:
                del data[i]
            else:
                data.insert(i, rng.randrange(32, 127))
        load_or_refuse(tmp_path / f"fuzz-{case}.safetensors", bytes(data), outcomes, f"case {case} ({base.name})")
    assert outcomes["refused"] > 200, outcomes


FUZZ_VALUES = [0, 1, -1, 2, 7, 8, 16, 32, 2 ** 63, 1.5, float("nan"), "", "x", "F32", "U8", "BF16", "I64", "F8_E4M3",
               "F8_E8M0", "I8", [32, 16], [128, 4], "nvfp4", "mxfp8", "int8_tensorwise", '{"format": "mxfp8"}',
               None, True, [], [0], [1, 2], {}, {"a": 1}, "fp8", "[1]", '{"format": "nvfp4"}', '{"num_layers": 3}',
               4, 64, 256, "int4", "asym_w4a8_int8", "awq_w4a16", "convrot_w4a4", {"convrot_groupsize": 8}]


def _mutate_json(obj, rng):
    """Change one value somewhere in a JSON tree (or drop / copy a key), keeping it valid JSON."""
    while True:
        if isinstance(obj, dict) and obj:
            key = rng.choice(sorted(obj))
            r = rng.random()
            if r < 0.1:
                del obj[key]
                return
            if r < 0.2:
                obj[key + rng.choice(["_scale", "_zero", ".weight", "x"])] = obj[key]
                return
            if isinstance(obj[key], (dict, list)) and r < 0.8:
                obj = obj[key]
                continue
            obj[key] = rng.choice(FUZZ_VALUES)
            return
        if isinstance(obj, list) and obj:
            i = rng.randrange(len(obj))
            if isinstance(obj[i], (dict, list)) and rng.random() < 0.7:
                obj = obj[i]
                continue
            obj[i] = rng.choice(FUZZ_VALUES + ([obj[i] + 1, obj[i] * 2] if type(obj[i]) is int else []))
        return


def test_fuzzed_header_values_only_ever_give_checkpoint_errors(tmp_path):
    """Valid JSON with wrong values: tensor entries, shapes, offsets and the JSON inside the metadata."""
    rng = random.Random(99)
    bases = _fuzz_bases(tmp_path)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(300):
        base = bases[case % len(bases)].read_bytes()
        n = struct.unpack("<Q", base[:8])[0]
        header, body = json.loads(base[8:8 + n]), base[8 + n:]
        meta = header.get("__metadata__", {})
        if meta and rng.random() < 0.4:  # a value inside one metadata JSON string
            key = rng.choice(sorted(meta))
            inner = json.loads(meta[key])
            _mutate_json(inner, rng)
            meta[key] = json.dumps(inner)
        else:
            _mutate_json(header, rng)
        raw = json.dumps(header).encode()
        load_or_refuse(tmp_path / f"fuzzv-{case}.safetensors", struct.pack("<Q", len(raw)) + raw + body, outcomes,
                       f"case {case}")
    assert outcomes["refused"] > 150, outcomes


def test_checkpoint_error_is_exported():
    assert engine.CheckpointError is CheckpointError and issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("header_len", [640, 896, 1152, 1408])
def test_safetensors_whose_header_length_looks_like_pickle_magic_loads(tmp_path, header_len):
    """A header of 640 / 896 / 1152 / 1408 bytes makes a file start with 80 02 .. 80 05, the pickle protocol
    magic: such a safetensors file (a small LoRA often is one) is still read, not refused as a pickle."""
    from engine.io.safetensors import SafetensorsFile

    path = str(tmp_path / "small.safetensors")
    t = {"a.weight": torch.ones(2, 2)}
    for pad in range(header_len):
        save_file(t, path, metadata={"pad": "x" * pad})
        with open(path, "rb") as f:
            if struct.unpack("<Q", f.read(8))[0] == header_len:
                break
    with open(path, "rb") as f:
        head = f.read(2)
    assert head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    assert list(SafetensorsFile(path).keys()) == ["a.weight"]
