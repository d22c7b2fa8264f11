"""GGUF files (engine/io/gguf.py, engine/features/quant/gguf/linear.py), written by the real ``gguf`` package
(GGUFWriter, tests/gguf_files.py) from a tiny random ERNIE-Image checkpoint in unsloth's layout (diffusers
names, general.architecture "wan") and ComfyUI-GGUF's (prefixed keys, a reshaped tensor with its shape in
the metadata): every listed type loads, keeps its bytes, and samples the latent of the same weights
dequantized by gguf's numpy code and loaded as safetensors.

Tolerance of the latent comparisons: exact (max |difference| == 0) in fp32. Why it can be exact: the GGUF
layers dequantize to float32 values equal bit for bit to gguf's numpy dequantizer (gguf_numerics' contract,
tested by its own module), and the safetensors reference holds those float32 values, so both models run the
same float32 operations on the same numbers. A looser bound would hide a wrong block layout in one row.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf_files import ALL_TYPES, CFG, QUANT_TYPES, mixed_types, model_inputs, reference_state, types_for, write_gguf  # noqa: I001
from gguf_files import Q as GQ
from PIL import Image
from safetensors.torch import save_file

from engine import CheckpointError, load_model
from engine.config import EngineConfig
from engine.features import quant as Q
from engine.features.quant.gguf.linear import GGUFLinear
from engine.io.checkpoint import open_checkpoint
from engine.loading import estimate_bytes
from engine.models.ernie_image import FAMILY
from engine.models.random_weights import random_state_dict
from engine.router import open_engine

SD = random_state_dict(CFG, 0)


def _pair(tmp_path, types, layout, name="m"):
    """A GGUF file and its reference safetensors (gguf's numpy dequantization of the same bytes)."""
    path = write_gguf(tmp_path / f"{name}-{layout}.gguf", SD, types, layout)
    ref = tmp_path / f"{name}-{layout}-ref.safetensors"
    save_file(reference_state(path), str(ref))
    return path, str(ref)


def _latent(source):
    eng = open_engine(source, EngineConfig(device="cpu", dtype="fp32"))
    g = torch.Generator().manual_seed(3)
    cond = [torch.randn(5, CFG.text_in_dim, generator=g)]
    return eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), cond, None, seed=7, steps=2, cfg=1.0)


@pytest.mark.parametrize("layout", ["unsloth", "comfy"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: GQ(t).name)
def test_every_type_samples_the_latent_of_its_dequantized_weights(tmp_path, qtype, layout):
    path, ref = _pair(tmp_path, types_for(SD, qtype), layout)
    model = load_model(path, dtype="fp32")
    if qtype in QUANT_TYPES:  # the blocks' linears keep their bytes: a uint8 parameter of the file's size
        layer = model.layers[0].mlp.linear_fc2
        assert isinstance(layer, GGUFLinear) and layer.QTYPE == qtype and layer.weight.dtype == torch.uint8
        assert Q.model_quant_format(model) == GQ(qtype).name.lower()
        assert layer.weight.numel() == open_checkpoint(path).files[0].stored_bytes(
            ("model.diffusion_model." if layout == "comfy" else "") + "layers.0.mlp.linear_fc2.weight")
    else:
        assert Q.model_quant_format(model) is None
    a, b = _latent(path), _latent(ref)
    assert torch.isfinite(b).all() and b.abs().max() > 0
    assert torch.equal(a, b), f"max |difference| {(a - b).abs().max().item():.3g}"


def test_the_architecture_comes_from_the_tensor_names_not_the_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", SD, types_for(SD, GQ.Q8_0), "unsloth", arch="wan")
    f = open_checkpoint(path).files[0]
    assert f.architecture == "wan" and f.metadata["general.architecture"] == "wan"
    assert load_model(path).config.hidden_size == CFG.hidden_size
    other = {k.replace("layers.", "blocks."): v for k, v in SD.items()}  # not ERNIE-Image's names
    bad = write_gguf(tmp_path / "flux.gguf", other, types_for(other, GQ.Q8_0), "unsloth", arch="flux")
    with pytest.raises(CheckpointError, match=r"flux.gguf: not an ERNIE-Image diffusion model: key 'layers.0.*"
                                              r"general.architecture 'flux'\)"):
        load_model(bad)


def test_comfy_orig_shape_metadata_restores_the_torch_shape(tmp_path):
    path = write_gguf(tmp_path / "c.gguf", SD, types_for(SD, GQ.Q4_0), "comfy")
    f = open_checkpoint(path).files[0]
    key = "model.diffusion_model.x_embedder.proj.weight"
    assert f.stored_shape(key) == (CFG.hidden_size, CFG.in_channels) and f.shape(key) == tuple(SD["x_embedder.proj.weight"].shape)
    assert torch.equal(load_model(path).x_embedder.proj.weight, SD["x_embedder.proj.weight"])


def test_bytes_at_rest_are_the_files_bytes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", SD, types_for(SD, GQ.Q4_K), "unsloth")
    model = load_model(path, dtype="fp32")
    assert estimate_bytes(path, dtype="fp32") == Q.weight_bytes(model)
    block_bytes = Q.weight_bytes(model, only_block_linears=True)
    dense = sum(SD[f"{n}.weight"].numel() * 4 for n in [f"layers.{i}.{p}" for i in range(CFG.num_layers) for p in FAMILY.block_linears[:7]])
    assert block_bytes * 7 < dense  # Q4_K: 4.5 bits a weight against 32


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_1", "q4_k"])
def test_quant_option_quantizes_a_safetensors_model_at_load(tmp_path, fmt):
    src = tmp_path / "m.safetensors"
    save_file(SD, str(src))
    model = load_model(src, quant=fmt)
    layer = model.layers[1].self_attention.to_q
    assert isinstance(layer, GGUFLinear) and Q.model_quant_format(model) == fmt
    err = Q.relative_error(layer.dequantize(), SD["layers.1.self_attention.to_q.weight"])
    assert 0 < err < {"q8_0": 0.01, "q4_0": 0.15, "q5_1": 0.06, "q4_k": 0.1}[fmt]
    assert estimate_bytes(src, quant=fmt) == Q.weight_bytes(model)


def test_runs_under_inference_mode_and_fuses(tmp_path):
    path, ref = _pair(tmp_path, mixed_types(SD), "unsloth")
    from engine.features.fuse import fuse_projections
    a, b = load_model(path, dtype="fp32"), load_model(ref)
    with torch.inference_mode():
        want = b(*model_inputs())
        assert torch.equal(a(*model_inputs()), want)
        fuse_projections(a)  # same-type parts join (the table's concat); mixed parts stay apart
        assert torch.equal(a(*model_inputs()), want)


def test_tensor_parallel_splits_rows_and_refuses_blocks_it_cannot_split(tmp_path):
    from engine.features.quant.gguf.linear import split_rows
    path = write_gguf(tmp_path / "m.gguf", SD, types_for(SD, GQ.Q8_0), "unsloth")
    layer = load_model(path).layers[0].mlp.linear_fc2  # [256, 512] in blocks of 32
    dense = layer.dequantize()
    assert torch.equal(split_rows(layer, 1, 2, 0).dequantize(), dense[128:])
    assert torch.equal(split_rows(layer, 1, 4, 1).dequantize(), dense[:, 128:256])
    with pytest.raises(ValueError, match="512 inputs cannot be split over 32 ranks on its block boundaries"):
        split_rows(layer, 0, 32, 1)


def test_cli_generate_serves_every_type_in_both_layouts(tmp_path, sgld_in_process):
    """``sgld generate --model x.gguf`` (every listed type in one file, as Q4_K_M-style files mix types) draws
    the picture that the dequantized safetensors draws, pixel for pixel (exact: see the module docstring)."""
    pytest.importorskip("transformers")
    from test_external_files import write_text_encoder, write_vae
    te = write_text_encoder(tmp_path / "text_encoder", CFG.text_in_dim)
    vae = write_vae(tmp_path / "vae", CFG.in_channels)
    types = mixed_types(SD)
    assert set(types.values()) == set(ALL_TYPES)
    pictures = {}
    unsloth, ref = _pair(tmp_path, types, "unsloth")
    comfy = write_gguf(tmp_path / "m-comfy.gguf", SD, types, "comfy")  # the same bytes (same seed and order)
    assert reference_state(comfy).keys() == reference_state(unsloth).keys()
    for name, model in (("ref", ref), ("unsloth", unsloth), ("comfy", comfy)):
        out = tmp_path / f"{name}.png"
        code, stdout, stderr = sgld_in_process(
            "generate", "--model", model, "--text-encoder", te, "--vae", vae, "--prompt", "a red cat", "--width", "64",
            "--height", "64", "--steps", "2", "--dtype", "fp32", "--out", out, "--json")
        assert code == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["model"] == os.path.basename(model)
        pictures[name] = np.asarray(Image.open(out))
    assert pictures["ref"].std() > 0
    assert np.array_equal(pictures["unsloth"], pictures["ref"]) and np.array_equal(pictures["comfy"], pictures["ref"])


def test_reshaped_tensors_dequantize_to_their_shape_and_reshaped_block_linears_are_refused(tmp_path):
    types = types_for(SD, GQ.Q8_0)
    ok = write_gguf(tmp_path / "ok.gguf", SD, types, "unsloth", reshape={"final_norm.linear.weight": (256, 512)})
    assert torch.equal(load_model(ok, dtype="fp32").final_norm.linear.weight,
                       reference_state(ok)["final_norm.linear.weight"])  # [512, 256] again
    bad = write_gguf(tmp_path / "bad.gguf", SD, types, "unsloth", reshape={"layers.0.mlp.gate_proj.weight": (256, 512)})
    with pytest.raises(CheckpointError, match=r"bad.gguf: tensor 'layers.0.mlp.gate_proj.weight': a Q8_0 block linear "
                                              r"stored reshaped as \[256, 512\] \(its shape is \[512, 256\]\)"):
        load_model(bad)


def test_the_engine_names_a_q4_k_m_files_weights(tmp_path):
    """Issue 49 item 2: a Q4_K_M-style file (most layers q4_k, the rest q6_k) is described by its formats' names, most
    layers first ("gguf q4_k + q6_k"), where the quant patch says "mixed"; the run panel shows this name."""
    types = types_for(SD, GQ.Q4_K)
    for k in [k for k in sorted(types) if types[k] == GQ.Q4_K and ".mlp." in k][:2]:
        types[k] = GQ.Q6_K
    path = write_gguf(tmp_path / "q4_k_m.gguf", SD, types, "comfy")
    described = open_engine(path, EngineConfig(device="cpu", dtype="fp32")).describe()
    assert described["weights"] == "gguf q4_k + q6_k" and described["quant"] == "mixed", described
    assert open_engine(_pair(tmp_path, types_for(SD, GQ.F16), "comfy")[0],
                       EngineConfig(device="cpu", dtype="fp32")).describe()["weights"] is None  # dense: the dtype says it
