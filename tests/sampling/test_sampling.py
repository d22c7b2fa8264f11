"""Schedules and samplers against ComfyUI's own source (0.3.75, imported in-process)."""
import os
import sys

import pytest
import torch

from engine import sampling

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFY = os.environ.get("SGLD_COMFYUI_DIR", os.path.join(ROOT, ".cache", "ComfyUI"))


@pytest.fixture(scope="module")
def comfyui_samplers():
    """ComfyUI's samplers module, imported in this process with --cpu semantics (no GPU here; no server: not
    tests/conftest.py's `comfy`)."""
    if not os.path.exists(os.path.join(COMFY, "comfy", "samplers.py")):
        pytest.skip("ComfyUI is not installed (run scripts/comfyui.sh)")
    sys.path.insert(0, COMFY)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.k_diffusion.sampling as kd
    import comfy.model_sampling as ms
    import comfy.samplers as samplers

    class ErnieFlow(ms.ModelSamplingDiscreteFlow, ms.CONST):
        pass

    class Config:
        sampling_settings = {"multiplier": 1000.0, "shift": 3.0}

    return {"samplers": samplers, "kd": kd, "model_sampling": ErnieFlow(Config()), "ms": ms, "ErnieFlow": ErnieFlow}


def comfy_sigmas(comfyui_samplers, scheduler, steps, denoise=1.0, shift=3.0):
    ms = comfyui_samplers["model_sampling"]
    if shift != 3.0:
        class C:
            sampling_settings = {"multiplier": 1000.0, "shift": shift}
        ms = comfyui_samplers["ErnieFlow"](C())
    fn = comfyui_samplers["samplers"].SCHEDULER_HANDLERS[scheduler].handler

    if denoise > 0.9999:
        return fn(ms, steps)
    return fn(ms, int(steps / denoise))[-(steps + 1):]


@pytest.mark.parametrize("scheduler", sampling.SCHEDULERS)
@pytest.mark.parametrize("steps", [1, 8, 20, 50])
def test_schedules_equal_comfyui(comfyui_samplers, scheduler, steps):
    want = comfy_sigmas(comfyui_samplers, scheduler, steps)
    got = sampling.sigma_schedule(steps, scheduler)
    assert torch.equal(got, want), f"{scheduler}/{steps}: {got} != {want}"


@pytest.mark.parametrize("denoise", [0.3, 0.55, 0.9])
def test_partial_denoise_schedule_equals_comfyui(comfyui_samplers, denoise):
    for scheduler in sampling.SCHEDULERS:
        assert torch.equal(sampling.sigma_schedule(10, scheduler, denoise), comfy_sigmas(comfyui_samplers, scheduler, 10, denoise))


def test_shift_changes_schedule(comfyui_samplers):
    assert torch.equal(sampling.sigma_schedule(8, "simple", shift=4.0), comfy_sigmas(comfyui_samplers, "simple", 8, shift=4.0))
    s3, s4 = sampling.sigma_schedule(8, "simple", shift=3.0), sampling.sigma_schedule(8, "simple", shift=4.0)
    assert s3[0] == s4[0] == 1.0 and (s4[1:-1] > s3[1:-1]).all()


def toy_denoiser(x, sigma):
    """A smooth, nonlinear stand-in for a model (x0 prediction)."""
    return torch.tanh(x * 0.7) * (1 - sigma.view(-1, 1, 1, 1) * 0.3) + 0.1 * x.flip(-1)


class ComfyModelWrap:
    """The shape of the object k-diffusion samplers call: model(x, sigma) plus the model_sampling
    chain that sample_euler_ancestral inspects to pick its flow (RF) variant."""

    def __init__(self, model_sampling):
        class Inner:
            pass
        self.inner_model = Inner()
        self.inner_model.inner_model = Inner()
        self.inner_model.inner_model.model_sampling = model_sampling

    def __call__(self, x, sigma, **kwargs):
        return toy_denoiser(x, sigma)


@pytest.mark.parametrize("name", sampling.SAMPLERS)
@pytest.mark.parametrize("scheduler", ["simple", "beta"])
def test_samplers_equal_comfyui(comfyui_samplers, name, scheduler):
    sigmas = sampling.sigma_schedule(7, scheduler)
    x0 = sampling.seeded_noise((2, 4, 3, 5), seed=42)
    kd_fn = getattr(comfyui_samplers["kd"], f"sample_{name}")
    want = kd_fn(ComfyModelWrap(comfyui_samplers["model_sampling"]), x0.clone(), sigmas, extra_args={"seed": 7}, disable=True)
    got = sampling.run_sampler(name, toy_denoiser, x0.clone(), sigmas, seed=7)
    assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max()}"


def test_noise_is_comfyuis(comfyui_samplers):
    import importlib

    prepare_noise = importlib.import_module("comfy.sample").prepare_noise
    latent = torch.zeros(2, 16, 5, 7)
    assert torch.equal(sampling.seeded_noise(latent.shape, 1234), prepare_noise(latent, 1234))
    # scaling at the first sigma, as the CONST (flow) parameterisation does it
    ms = comfyui_samplers["model_sampling"]
    noise = sampling.seeded_noise(latent.shape, 5)
    lat = torch.randn(latent.shape)
    for s in (torch.tensor(1.0), torch.tensor(0.6)):
        assert torch.equal(sampling.noise_scaling(s, noise, lat), ms.noise_scaling(s, noise, lat))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="scheduler 'karras' is not supported; choose one of simple, normal, beta"):
        sampling.sigma_schedule(5, "karras")
    with pytest.raises(ValueError, match="sampler 'lms' is not supported"):
        sampling.run_sampler("lms", toy_denoiser, torch.zeros(1), torch.ones(2))


def test_schedule_length_is_bounded_before_it_is_built():
    """denoise=1e-6 used to build a schedule of steps / denoise entries (minutes, about a GB); now refused at once."""
    with pytest.raises(ValueError, match=r"steps / denoise must be at most 10000 \(got 20 / 1e-06\)"):
        sampling.sigma_schedule(20, "simple", denoise=1e-6)
    with pytest.raises(ValueError, match=r"steps must be from 1 to 10000 \(got 10001\)"):
        sampling.sigma_schedule(10001)
    with pytest.raises(ValueError, match=r"denoise must be a finite number from 0 to 1 \(got nan\)"):
        sampling.sigma_schedule(5, denoise=float("nan"))
    assert len(sampling.sigma_schedule(10, "simple", denoise=10 / 10000)) == 11  # the limit itself is allowed


def test_step_of_each_model_call():
    calls = sampling.model_calls("heun", 4)
    assert [sampling.step_of_call("heun", c) for c in range(calls)] == [0, 0, 1, 1, 2, 2, 3]
    assert [sampling.step_of_call("euler", c) for c in range(4)] == [0, 1, 2, 3]
