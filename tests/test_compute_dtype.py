"""The default compute dtype, one rule for every entry point (issue 49 item 1, issue 50 item 1; engine/compute_dtype.py):
the family's safe dtypes narrowed to what the device computes natively, whatever the file stores. Per device
capability (a CPU with and without AVX-512 BF16 / AMX, a GPU); never fp16 for ERNIE-Image (it overflows); and every
format the pack writes runs the demo with all defaults, the judge passing the picture, from the CLI, the pipeline and
the server (the ComfyUI nodes: tests/test_comfyui_default_dtype.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine import EngineConfig, open_engine
from engine import compute_dtype as rule
from engine.cli import main as sgld
from engine.features.quant import writable_formats, writer_for
from engine.io.checkpoint import open_checkpoint
from engine.models import demo as demo_model
from engine.models.demo import EXAMPLE_PROMPT
from engine.models.family import Family, family_of
from engine.models.random_weights import SIZES
from tools.demo import judge

ERNIE = family_of(SIZES["tiny"])
SEED = 4  # a seed whose float32 demo picture the judge passes, as every written format's


@pytest.mark.parametrize("flag,want", [("1", "bf16"), ("0", "fp32")])
def test_the_cpu_default_follows_native_bf16(monkeypatch, flag, want):
    monkeypatch.setenv(rule.ENV, flag)
    dtype, why = rule.default_compute_dtype(ERNIE, "cpu")
    assert dtype == want and rule.ENV in why, why


def test_the_cpu_detection_reads_the_flags_when_not_told(monkeypatch):
    monkeypatch.delenv(rule.ENV, raising=False)
    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read().split() for flag in rule.CPU_BF16_FLAGS)
    assert rule.default_compute_dtype(ERNIE, "cpu")[0] == ("bf16" if native else "fp32")
    monkeypatch.setattr(rule, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert rule.default_compute_dtype(ERNIE, "cpu") == ("bf16", "the default for ERNIE-Image on cpu (the CPU has amx_bf16)")
    monkeypatch.setattr(rule, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    dtype, why = rule.default_compute_dtype(ERNIE, "cpu")
    assert dtype == "fp32" and "bf16 not native (no avx512_bf16/amx_bf16 on this CPU)" in why


def test_a_bad_override_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(rule.ENV, "yes")
    with pytest.raises(ValueError, match=f"{rule.ENV}='yes' is not valid: 1 .* or 0"):
        rule.default_compute_dtype(ERNIE, "cpu")


def test_a_gpu_computes_bf16_or_the_next_safe_dtype(monkeypatch):
    assert rule.default_compute_dtype(ERNIE, "cuda")[0] == "bf16"  # no CUDA here: a rehearsal's card
    monkeypatch.setattr(rule.device_rt, "available", lambda: True)  # the device seam answers as a V100's would
    monkeypatch.setattr(rule.device_rt, "capability", lambda device: (7, 0))
    dtype, why = rule.default_compute_dtype(ERNIE, "cuda")
    assert dtype == "fp32" and "compute capability 7.0: bf16 from 8.0" in why  # never fp16: ERNIE-Image overflows
    other = Family(**{**{f: getattr(ERNIE, f) for f in ERNIE.__dataclass_fields__}, "compute_dtypes":
                      (torch.bfloat16, torch.float16, torch.float32)})
    assert rule.default_compute_dtype(other, "cuda")[0] == "fp16"  # a family that allows it
    monkeypatch.setattr(rule.device_rt, "capability", lambda device: (9, 0))
    assert rule.default_compute_dtype(ERNIE, "cuda")[0] == "bf16"


def test_ernie_image_never_computes_in_fp16_by_default():
    assert torch.float16 not in ERNIE.compute_dtypes


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The demo's DiT in every format the pack writes (the demo itself is stored in F16)."""
    folder = tmp_path_factory.mktemp("demo_copies")
    out = {}
    for fmt in writable_formats():
        writer = writer_for(fmt)
        out[fmt] = str(folder / f"demo-{fmt}{writer.suffix}")
        writer.write(demo_model.DEMO_WEIGHTS, out[fmt], fmt)
    return out


def test_quantize_keeps_the_sources_float_types(copies):
    """The fp8 copy's unquantized tensors are the demo's own F16 (the source's type, not another)."""
    src, dst = open_checkpoint(demo_model.DEMO_WEIGHTS), open_checkpoint(copies["fp8"])
    for key in ("final_norm.linear.weight", "x_embedder.proj.weight", "text_proj.weight"):
        if key in src.keys():
            assert dst.header(key)[0] == src.header(key)[0], key


@pytest.mark.parametrize("fmt", writable_formats())
def test_every_written_format_runs_the_demo_with_defaults_from_the_cli(copies, tmp_path, fmt):
    """``sgld generate --model COPY`` with no dtype: float32 on this CPU (as the suite runs: no native bf16; before,
    the stored F16 of an fp8 copy in the node: NaN at step 1), and the judge passes the picture. 8 steps (the demo
    draws its scenes in 8; 30 steps of the forced W8A8 matmul took 27 s a format here)."""
    png = tmp_path / "out.png"
    assert sgld(["generate", "--model", copies[fmt], "--prompt", EXAMPLE_PROMPT, "--seed", str(SEED), "--steps", "8",
                 "--out", str(png), "--json"]) == 0
    image = np.asarray(Image.open(png).convert("RGB"))
    assert judge.passes(image, EXAMPLE_PROMPT), (fmt, judge.judge(image, EXAMPLE_PROMPT))


@pytest.mark.parametrize("fmt", ["fp8", "q4_k", "nvfp4"])
def test_the_engine_and_the_pipeline_take_the_rule_for_a_copy(copies, fmt):
    engine = open_engine(copies[fmt], EngineConfig())
    d = engine.describe()
    assert d["dtype"] == "float32" and "default for ERNIE-Image on cpu" in d["dtype_reason"], d["dtype_reason"]
    from engine import ErnieImagePipeline

    pipe = ErnieImagePipeline.from_pretrained(copies[fmt])  # a copy of the demo's DiT: the demo's own parts
    assert pipe.dtype == torch.float32
    image = np.asarray(pipe(EXAMPLE_PROMPT, seed=SEED).images[0].convert("RGB"))
    assert judge.passes(image, EXAMPLE_PROMPT), judge.judge(image, EXAMPLE_PROMPT)


def test_explicit_dtypes_still_win(copies):
    engine = open_engine(copies["fp8"], EngineConfig(dtype="bf16"))
    assert engine.describe()["dtype"] == "bfloat16" and engine.describe()["dtype_reason"] == "asked for (bf16)"


@pytest.mark.server
def test_the_server_runs_the_fp8_copy_with_defaults(copies, tmp_path):
    from test_serve import Server, client, pixels

    server = Server(tmp_path / "serve.log", "--model", copies["fp8"]).wait_ready()
    try:
        r = client(server).images.generate(model=server_model(server), prompt=EXAMPLE_PROMPT, size="64x64",
                                           response_format="b64_json", extra_body={"seed": SEED})
        image = pixels(r.data[0].b64_json)
        assert judge.passes(image, EXAMPLE_PROMPT), judge.judge(image, EXAMPLE_PROMPT)
    finally:
        assert server.stop() == 0, server.log()


def server_model(server) -> str:
    import requests

    return requests.get(server.base + "/models", timeout=10).json()["data"][0]["id"]

