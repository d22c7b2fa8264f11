"""GGUF models everywhere a safetensors model goes: LoRA (a side path on the GGUF layers, removal exact),
layer-wise offload (the GGUF bytes are what moves), tensor parallel (row splits of the bytes on block
boundaries; real gloo worker processes), Cache-DiT, regional compile, ``sgld bench`` and ``sgld serve``
(a real process, tests/test_serve.py's Server), all under torch.inference_mode() as ComfyUI runs nodes.
The files are written by the real ``gguf`` package (tests/gguf_files.py)."""
from __future__ import annotations

import json

import pytest
import requests
import torch
import torch.nn.functional as F
from gguf_files import CFG, Q, model_inputs, reference_state, types_for, write_gguf
from safetensors.torch import save_file

from engine import CheckpointError, load_model
from engine.config import EngineConfig
from engine.features import patching
from engine.features.cache import CacheConfig
from engine.features.quant.gguf.linear import GGUFLinear
from engine.models.random_weights import random_state_dict
from engine.router import open_engine

SD = random_state_dict(CFG, 0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    q8 = write_gguf(d / "m-q8_0.gguf", SD, types_for(SD, Q.Q8_0), "unsloth")
    q4k = write_gguf(d / "m-q4_k.gguf", SD, types_for(SD, Q.Q4_K), "comfy")
    ref = d / "m-q8_0-ref.safetensors"
    save_file(reference_state(q8), str(ref))
    return {"q8": q8, "q4k": q4k, "ref": str(ref), "dir": d}


def _cond():
    return [torch.randn(5, CFG.text_in_dim, generator=torch.Generator().manual_seed(3))]


def _sample(eng, **kw):
    return eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), _cond(), None, seed=7, steps=kw.pop("steps", 2), cfg=1.0, **kw)


def _config(**kw):
    return EngineConfig(device="cpu", dtype="fp32", **kw)


def test_lora_is_a_side_path_on_gguf_layers_and_removal_is_exact(files, tmp_path):
    g = torch.Generator().manual_seed(5)
    names = {"layers.0.self_attention.to_q": (256, 256), "layers.1.mlp.linear_fc2": (256, 512)}
    pairs = {m: (torch.randn(4, i, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1) for m, (o, i) in names.items()}
    lora = tmp_path / "l.safetensors"
    save_file({f"transformer.{m}.lora_{ab}.weight": t for m, (a, b) in pairs.items() for ab, t in (("A", a), ("B", b))},
              str(lora))
    eng = open_engine(files["q8"], _config())
    model = eng.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        y0 = model(*model_inputs())
        eng.set_loras([(str(lora), 0.8)])
        fc2 = model.layers[1].mlp.linear_fc2
        assert isinstance(fc2, GGUFLinear) and type(fc2).__name__.endswith("WithLoRA")
        a, b = pairs["layers.1.mlp.linear_fc2"]
        xi = torch.randn(3, 512)
        torch.testing.assert_close(fc2(xi), F.linear(xi, fc2.dequantize()) + 0.8 * F.linear(F.linear(xi, a), b),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.equal(model(*model_inputs()), y0)
        eng.set_loras([])
        assert torch.equal(model(*model_inputs()), y0) and patching.get(model, "lora") is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_offload_streams_the_gguf_bytes(files):
    ref = open_engine(files["q8"], _config())
    eng = open_engine(files["q8"], _config(offload="layerwise", resident_layers=1))
    off = eng.offload
    assert off is not None
    assert {p.dtype for p in eng.model.layers[0].mlp.parameters()} == {torch.uint8}
    dense_block = 4 * sum(v.numel() for k, v in SD.items() if k.startswith("layers.0."))
    assert off.slot_bytes < dense_block / 3  # Q8_0: 34 bytes per 32 weights, not 4 bytes each
    with torch.inference_mode():
        assert torch.equal(eng.model(*model_inputs()), ref.model(*model_inputs()))
    assert off.transfers > 0


def test_cache_dit_and_compile_on_a_gguf_model(files):
    cache = CacheConfig(enabled=True, preset="fast")
    with torch.inference_mode():
        a = _sample(open_engine(files["q8"], _config()), steps=8, cache=cache)
        b = _sample(open_engine(files["ref"], _config()), steps=8, cache=cache)
    assert torch.equal(a, b)
    from engine.features import compile as C

    torch._dynamo.reset()
    model = load_model(files["q4k"], dtype="fp32")
    want = load_model(files["q4k"], dtype="fp32")
    C.compile_blocks(model, "static", mode=None, backend="aot_eager")  # cheap on CPU (inductor: minutes)
    C.reset_counters()
    with torch.inference_mode():
        assert torch.equal(model(*model_inputs()), want(*model_inputs()))
    assert C.graph_count() == 1 and C.graph_breaks() == {}  # the torch dequantizer traces into the block graph
    C.uncompile_blocks(model)


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel_ranks_run_gguf_row_splits(files):
    with torch.inference_mode():
        one = _sample(open_engine(files["q8"], _config()))
    eng = open_engine(files["q8"], _config(tp=2))
    try:
        two = _sample(eng)
    finally:
        eng.release()
    # row-parallel layers sum their halves across the ranks (all-reduce): float32 rounding apart
    assert float((two - one).abs().max()) <= 1e-5 * float(one.abs().max())
    with pytest.raises(CheckpointError, match=r"m-q4_k.gguf: tensor 'model.diffusion_model.layers.0.mlp.linear_fc2.weight': "
                                              r"Q4_K layer with 512 inputs cannot be split over 4 ranks"):
        load_model(files["q4k"], shard=(4, 0))


@pytest.mark.server
def test_sgld_bench_and_serve_take_a_gguf_model(files, capsys):
    from engine.cli import main

    assert main(["bench", "--model", files["q8"], "--steps", "1", "--repeat", "1", "--width", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"].endswith("m-q8_0.gguf") or "m-q8_0.gguf" in json.dumps(out)
    pytest.importorskip("transformers")
    from test_external_files import write_text_encoder, write_vae
    from test_serve import Server
    te = write_text_encoder(files["dir"] / "text_encoder", CFG.text_in_dim)
    vae = write_vae(files["dir"] / "vae", CFG.in_channels)
    server = Server(files["dir"] / "serve.log", "--model", files["q8"], "--text-encoder", str(te), "--vae", str(vae))
    try:
        server.wait_ready()
        assert requests.get(server.base + "/models", timeout=10).json()["data"][0]["id"] == "m-q8_0"
        r = requests.post(server.base + "/images/generations", json={"prompt": "a red cat", "size": "32x32", "seed": 1,
                                                                     "num_inference_steps": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["model_calls"] == 2, r.text
    finally:
        server.proc.terminate()
        assert server.proc.wait(60) == 0, server.log()


def test_tensor_parallel_with_another_format_asked_for_splits_before_quantizing(files):
    from engine.features.quant import FP8Linear
    q8 = load_model(files["q8"]).layers[0].mlp.linear_fc2.dequantize()  # [256, 512], row parallel: inputs split
    half = load_model(files["q8"], quant="fp8", shard=(2, 1)).layers[0].mlp.linear_fc2
    assert isinstance(half, FP8Linear) and half.in_features == 256
    assert torch.equal(half.dequantize(), FP8Linear.from_dense(q8[:, 256:]).dequantize())


def test_the_stored_compute_dtype_leaves_out_the_f32_norms(tmp_path):
    sd = {k: (v if v.dim() == 1 else v.to(torch.bfloat16)) for k, v in SD.items()}
    types = {k: (Q.F32 if v.dim() == 1 else Q.BF16) for k, v in sd.items()}
    types["layers.0.mlp.gate_proj.weight"] = Q.Q8_0
    path = write_gguf(tmp_path / "bf16.gguf", sd, types, "unsloth")
    assert load_model(path).dtype == torch.bfloat16  # most tensors are F32 (norms, biases), most weights BF16
