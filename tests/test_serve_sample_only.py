"""`sgld serve --sample-only` (issue 48): the DiT alone behind POST /v1/sample, for the SGLDiffusion Server nodes (ComfyUI
encodes the prompt and decodes the picture) and the GPU check's server rows, whose random checkpoint has no text encoder
or VAE. A real server process on a tiny random ERNIE-Image file: its /v1/sample latent is Engine.sample's on the same
file, its image route is a 400 saying why, /health_generate runs the DiT; the flags that load what it does not are
refused by name."""
from __future__ import annotations

import base64
import json

import pytest
import requests
import torch
from safetensors.torch import load, save, save_file
from test_serve import Server

from engine import EngineConfig, open_engine
from engine.cli.serve import _parsed, check_serve_args
from engine.models.random_weights import SIZES, random_state_dict

CFG = SIZES["tiny"]


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    path = tmp_path_factory.mktemp("sample_only") / "tiny-dit.safetensors"
    save_file(random_state_dict(CFG, 3), str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(dit, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("sample_only_log") / "serve.log", "--sample-only", "--model", dit,
               "--dtype", "fp32", "--threads", "1")
    yield s.wait_ready()
    assert s.stop() == 0, s.log()


@pytest.mark.server
def test_the_dit_alone_samples_what_engine_sample_makes(server, dit):
    latent = torch.zeros(CFG.in_channels, 8, 8)
    cond = torch.randn(5, CFG.text_in_dim, generator=torch.Generator().manual_seed(1))
    settings = {"seed": 7, "steps": 3, "cfg": 1.0}
    r = requests.post(server.base + "/sample", data=save({"latent": latent, "cond": cond},
                                                         metadata={"sgld": json.dumps(settings)}), timeout=60)
    assert r.status_code == 200, r.text
    got = load(base64.b64decode(json.loads(r.text.strip().splitlines()[-1])["latent"]))["latent"]
    torch.set_num_threads(1)
    want = open_engine(dit, EngineConfig(dtype="fp32")).sample(latent[None], [cond], seed=7, steps=3, cfg=1.0)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    card = requests.get(server.base + "/models", timeout=10).json()["data"][0]
    assert (card["id"], card["latent_channels"], card["text_dim"]) == ("tiny-dit", CFG.in_channels, CFG.text_in_dim)


@pytest.mark.server
def test_pictures_are_refused_saying_why_and_health_generate_runs_the_dit(server):
    r = server.post("/v1/images/generations", {"prompt": "a red cat"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "sample_only" and "POST /v1/sample" in error["message"]
    r = requests.get(server.url + "/health_generate", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert server.healthy()


@pytest.mark.parametrize("flags, named", [
    (["--vae", "vae/"], "drop --vae"),
    (["--text-encoder", "te/", "--pe"], "drop --text-encoder, --pe"),
    (["--text-encoder-device", "cpu"], "drop --text-encoder-device"),
])
def test_flags_that_load_what_it_does_not_are_refused_by_name(dit, flags, named):
    with pytest.raises(ValueError, match=named):
        check_serve_args(_parsed(["serve", "--sample-only", "--model", dit, *flags]))


def test_a_dit_without_companions_needs_no_text_encoder_here(dit):
    """Without --sample-only the same file needs its text encoder and VAE; with it, the file alone passes."""
    with pytest.raises(ValueError, match="missing --text-encoder, --vae"):
        check_serve_args(_parsed(["serve", "--model", dit]))
    assert check_serve_args(_parsed(["serve", "--sample-only", "--model", dit]))["steps"] >= 1


def test_the_demo_alone_keeps_its_own_size_and_name():
    """The default model (the demo, a bundle) served alone: its one picture size and its served name, not a family's."""
    from engine.cli.serve import served_model

    served = served_model(_parsed(["serve", "--sample-only"]))
    try:
        assert (served.id, served.default_size, served.parts.pictures) == ("sgld-demo", 64, False)
    finally:
        served.engine.release()
