"""Inputs that would make NaN are named as the input, not blamed on the weights (issue 25 item 9): the engine's
input checks (engine/inputs.py) refuse NaN / inf and values beyond MAX_INPUT_VALUE in latents, text features
and noise masks, and a sigma of 0 before the last. Engine.sample runs them (the demo model, in this process,
under inference mode as ComfyUI runs nodes), and so does a real `sgld serve` on POST /v1/sample (a plain 400,
before any stream; it was a ``status: 400`` line inside a 200 stream saying the weights may be damaged)."""
from __future__ import annotations

import json

import pytest
import requests
import torch
from safetensors.torch import save

from engine import EngineConfig, InputError, open_engine
from engine.inputs import check_model_call, check_run_sigmas
from engine.sampling import MAX_INPUT_VALUE

try:  # tests/ may or may not be a package
    from .test_serve import Server
except ImportError:
    from test_serve import Server


@pytest.fixture(scope="module")
def demo():
    return open_engine("demo", EngineConfig(dtype="fp32"))


def sample(engine, latent=None, cond=None, **kw):
    mc = engine.model_config
    latent = torch.zeros(1, mc.in_channels, 16, 16) if latent is None else latent
    cond = torch.randn(5, mc.text_in_dim) if cond is None else cond
    with torch.inference_mode():
        return engine.sample(latent, [cond], None, seed=1, steps=kw.pop("steps", 2), cfg=1.0, **kw)


@pytest.mark.parametrize("value, words", [(3e38, "holds values up to 3e\\+38"), (float("inf"), "holds NaN or inf"),
                                          (float("nan"), "holds NaN or inf")])
def test_text_features_beyond_the_limit_are_named(demo, value, words):
    cond = torch.randn(5, demo.model_config.text_in_dim)
    cond[2, 3] = value
    with pytest.raises(InputError, match=f"positive conditioning #0 {words}") as e:
        sample(demo, cond=cond)
    assert "weights" not in str(e.value)


def test_latent_and_mask_values_are_named(demo):
    latent = torch.zeros(1, demo.model_config.in_channels, 16, 16)
    latent[0, 0, 0, 0] = -2 * MAX_INPUT_VALUE
    with pytest.raises(InputError, match="latent holds values up to 2e\\+06"):
        sample(demo, latent=latent, denoise=0.5)
    with pytest.raises(InputError, match="noise_mask holds NaN or inf values"):
        sample(demo, noise_mask=torch.full((1, 1, 16, 16), float("nan")))
    assert torch.isfinite(sample(demo, cond=torch.full((5, demo.model_config.text_in_dim), MAX_INPUT_VALUE / 10))).all()


def test_a_sigma_of_zero_before_the_last_is_refused(demo):
    """A schedule of zeros is non-increasing, so it passed and made NaN (a division by sigma)."""
    with pytest.raises(InputError, match="sigma 1 of 3 is 0: only the last sigma may be 0"):
        sample(demo, sigmas=[0.0, 0.0, 0.0])
    assert check_run_sigmas([0.9, 0.5, 0.0]).tolist() == pytest.approx([0.9, 0.5, 0.0])
    assert check_run_sigmas([1e-4, 0.5, 1.0]).numel() == 3  # ComfyUI's FlipSigmas: increasing, first 1e-4
    with pytest.raises(InputError, match="sigma 2 of 3 is 0"):
        check_run_sigmas([1.0, 0.0, 0.5])


def test_check_model_call_names_the_branch(demo):
    mc = demo.model_config
    x = torch.zeros(2, mc.in_channels, 16, 16)
    text = torch.randn(2, 5, mc.text_in_dim)
    check_model_call(mc, x, text, ["negative", "positive"])
    text[1, 0, 0] = float("nan")
    with pytest.raises(InputError, match="positive conditioning #0 holds NaN"):
        check_model_call(mc, x, text, ["negative", "positive"])
    with pytest.raises(InputError, match="the sampler's latent has 4 channels"):
        check_model_call(mc, torch.zeros(1, 4, 16, 16), text[:1], ["negative"])


@pytest.mark.server
def test_sample_endpoint_refuses_huge_conditioning_with_a_plain_400(tmp_path):
    server = Server(tmp_path / "serve.log").wait_ready()
    try:
        cond = torch.randn(4, 128)
        cond[1, 1] = 3e38
        data = save({"latent": torch.zeros(48, 16, 16), "cond": cond},
                    metadata={"sgld": json.dumps({"seed": 0, "steps": 2, "cfg": 1.0})})
        r = requests.post(server.base + "/sample", data=data, timeout=60)
        assert r.status_code == 400, (r.status_code, r.text[:2000])
        message = r.json()["error"]["message"]
        assert "positive conditioning #0 holds values up to 3e+38" in message and "weights" not in message, message
        assert server.healthy()
    finally:
        server.stop()
