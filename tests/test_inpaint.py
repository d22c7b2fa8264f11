"""Inpainting, img2img and batches in Engine.sample against ComfyUI 0.3.75's own KSampler arithmetic.

The reference is ComfyUI's code imported in-process from .cache/ComfyUI: the noise (comfy.sample.prepare_noise,
with batch_index), the mask (comfy.sampler_helpers.prepare_mask), the per-call blend (KSamplerX0Inpaint inside
comfy.samplers.KSAMPLER.sample, through ComfyUI's samplers) and CFG (comfy.samplers.cfg_function), on a real
comfy.model_base.BaseModel with ERNIE-Image's flow settings. The one thing ComfyUI cannot give here is its
model object for ERNIE-Image (0.3.75 has none), so the reference's denoiser is our tiny DiT's velocity turned
into ComfyUI's CONST denoised (ModelSampling.calculate_denoised), one forward per CFG branch. ComfyUI runs
nodes under torch.inference_mode(), so every run here does too.
"""
import os
import sys

import pytest
import torch

from engine import EngineConfig, InputError, open_engine
from engine.features.cache import CacheConfig
from engine.models.random_weights import SIZES, save_random_checkpoint
from engine.sampling import prepare_mask, seeded_noise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY = os.environ.get("SGLD_COMFYUI_DIR", os.path.join(ROOT, ".cache", "ComfyUI"))
CFG = SIZES["tiny"]
H, W = 4, 6  # latent size (the tiny model's patch size is 1)


@pytest.fixture(scope="module")
def comfy():
    if not os.path.exists(os.path.join(COMFY, "comfy", "samplers.py")):
        pytest.skip("ComfyUI is not installed (run scripts/comfyui.sh)")
    sys.path.insert(0, COMFY)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.latent_formats
    import comfy.model_base
    import comfy.sample
    import comfy.sampler_helpers
    import comfy.samplers
    import comfy.supported_models_base

    class ErnieFlowConfig(comfy.supported_models_base.BASE):  # ComfyUI >= 0.19's ERNIE-Image settings
        unet_config = {}
        unet_extra_config = {}
        sampling_settings = {"multiplier": 1000.0, "shift": 3.0}
        latent_format = comfy.latent_formats.Flux2

    base = comfy.model_base.BaseModel(ErnieFlowConfig({"disable_unet_model_creation": True}), comfy.model_base.ModelType.FLOW)
    return {"base": base, "samplers": comfy.samplers, "sample": comfy.sample, "helpers": comfy.sampler_helpers}


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.safetensors"
    save_random_checkpoint(str(path), CFG, seed=5)
    return open_engine(str(path), EngineConfig(dtype="fp32"))


def feats(n, seed):
    return torch.randn(n, CFG.text_in_dim, generator=torch.Generator().manual_seed(seed))


def input_latent(batch, seed=9):
    return torch.randn(batch, CFG.in_channels, H, W, generator=torch.Generator().manual_seed(seed))


def pixel_mask(n):
    """[n, 1, 32, 48] at pixel size (16x the latent): 0 on the left (kept), 1 on the right, a ramp between,
    so the scaled mask holds exact 0s, exact 1s and fractions; each of the n masks a little different."""
    m = torch.zeros(n, 1, 4 * H * 2, 4 * W * 2)
    for i in range(n):
        m[i, :, :, 20 + 2 * i:] = torch.linspace(0.0, 1.0, 28 - 2 * i).clamp(0, 1) * 1.5
    return m.clamp(0, 1)


def comfy_sigmas(comfy, scheduler, steps, denoise):
    """comfy.samplers.KSampler.set_steps."""
    ms = comfy["base"].model_sampling
    if denoise > 0.9999:
        return comfy["samplers"].calculate_sigmas(ms, scheduler, steps)
    return comfy["samplers"].calculate_sigmas(ms, scheduler, int(steps / denoise))[-(steps + 1):]


def comfy_sample(comfy, eng, latent, cond, uncond, *, seed, steps, cfg, sampler, scheduler="simple", denoise=1.0,
                 mask=None, batch_index=None):
    """ComfyUI's KSampler path from common_ksampler on (noise, sigmas, mask, KSAMPLER.sample, latent in/out)."""
    base = comfy["base"]
    ms = base.model_sampling
    noise = comfy["sample"].prepare_noise(latent, seed, batch_index)
    sigmas = comfy_sigmas(comfy, scheduler, steps, denoise)
    denoise_mask = None if mask is None else comfy["helpers"].prepare_mask(mask, noise.shape, "cpu")
    latent_in = base.process_latent_in(latent) if torch.count_nonzero(latent) > 0 else latent

    class Guider:  # what KSAMPLER calls (a CFGGuider): our DiT as ComfyUI's CONST flow denoiser, CFG by ComfyUI
        inner_model = base

        def __call__(self, x, sigma, model_options=None, seed=None):
            def branch(text):
                b = x.shape[0]
                v = eng.model(x, ms.timestep(sigma).float(), text[None].expand(b, -1, -1), torch.full((b,), text.shape[0]))
                return ms.calculate_denoised(sigma, v.float(), x)

            cond_pred = branch(cond)
            if uncond is None:
                return cond_pred
            return comfy["samplers"].cfg_function(base, cond_pred, branch(uncond), cfg, x, sigma)

    k = comfy["samplers"].ksampler(sampler)
    out = k.sample(Guider(), sigmas, {"model_options": {}, "seed": seed}, None, noise, latent_in, denoise_mask, disable_pbar=True)
    return base.process_latent_out(out.to(torch.float32))


def assert_matches(got, want):
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"max abs error {err} (max |ref| {want.abs().max().item()})"


@pytest.mark.parametrize("denoise", [1.0, 0.6])
@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_masked_batch_equals_comfyui(comfy, eng, sampler, denoise):
    latent, mask = input_latent(2), pixel_mask(2)
    cond, uncond = feats(7, 1), feats(3, 2)
    kw = dict(seed=21, steps=4, cfg=3.0, sampler=sampler, denoise=denoise)
    with torch.inference_mode():
        want = comfy_sample(comfy, eng, latent, cond, uncond, mask=mask, **kw)
        got = eng.sample(latent, [cond], [uncond], noise_mask=mask, **kw)
    assert got.shape == latent.shape
    assert_matches(got, want)
    keep = comfy["helpers"].prepare_mask(mask, latent.shape, "cpu") == 0
    assert keep.any() and (~keep).any()
    kept_exactly = keep & (want == latent)  # where ComfyUI returns the input bit for bit, so do we
    assert kept_exactly.any()
    assert torch.equal(got[kept_exactly], latent[kept_exactly])
    torch.testing.assert_close(got[keep], latent[keep], rtol=0, atol=1e-5)  # the rest of the kept region: rounding
    assert not torch.allclose(got[~keep], latent[~keep], atol=1e-2)  # the masked region is repainted


def test_mask_preparation_is_comfyuis(comfy):
    """Pixel-size masks of 1 or N entries, [h, w] and [N, h, w] forms, tiled or cut to the batch."""
    for mask, shape in [(pixel_mask(1), (3, 16, 4, 6)), (pixel_mask(2), (3, 16, 4, 6)), (pixel_mask(3), (2, 8, 5, 7)),
                        (pixel_mask(1)[0, 0], (2, 16, 4, 6)), (pixel_mask(2)[:, 0], (2, 16, 8, 12))]:
        assert torch.equal(prepare_mask(mask, shape), comfy["helpers"].prepare_mask(mask, shape, "cpu")), (mask.shape, shape)


def test_batch_index_noise_is_comfyuis(comfy):
    latent = torch.zeros(3, 16, 5, 7)
    for index in ([0, 1, 2], [2, 0, 2], [4, 1, 7]):
        assert torch.equal(seeded_noise(latent.shape, 77, index), comfy["sample"].prepare_noise(latent, 77, index))
    assert torch.equal(seeded_noise(latent.shape, 77), comfy["sample"].prepare_noise(latent, 77))


@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_2m"])
def test_batch_index_and_one_mask_for_the_batch_equal_comfyui(comfy, eng, sampler):
    """A batch cut out of a larger one (LatentFromBatch: batch_index) with one mask for both samples, no CFG."""
    latent, mask = input_latent(2, seed=4), pixel_mask(1)
    kw = dict(seed=5, steps=3, cfg=1.0, sampler=sampler, denoise=0.8)
    with torch.inference_mode():
        want = comfy_sample(comfy, eng, latent, feats(5, 3), None, mask=mask, batch_index=[1, 3], **kw)
        got = eng.sample(latent, [feats(5, 3)], noise_mask=mask, batch_index=[1, 3], **kw)
        other = eng.sample(latent, [feats(5, 3)], noise_mask=mask, **kw)
    assert_matches(got, want)
    assert not torch.allclose(got, other)  # batch_index chose other noise


def test_unmasked_batch_equals_comfyui(comfy, eng):
    """Batch 2 without a mask: per-sample noise from one seed, the same conditioning for both."""
    latent = torch.zeros(2, CFG.in_channels, H, W)
    kw = dict(seed=8, steps=3, cfg=2.0, sampler="euler")
    with torch.inference_mode():
        want = comfy_sample(comfy, eng, latent, feats(4, 6), feats(6, 7), **kw)
        got = eng.sample(latent, [feats(4, 6)], [feats(6, 7)], **kw)
    assert_matches(got, want)


def test_mask_of_ones_is_plain_sampling_and_zeros_keep_the_input(eng):
    latent = input_latent(1)
    kw = dict(seed=3, steps=3, cfg=1.0, denoise=0.7)
    with torch.inference_mode():
        plain = eng.sample(latent, [feats(5, 1)], **kw)
        ones = eng.sample(latent, [feats(5, 1)], noise_mask=torch.ones(1, 1, 8, 12), **kw)
        zeros = eng.sample(latent, [feats(5, 1)], noise_mask=torch.zeros(8, 12), **kw)
    assert torch.equal(ones, plain)
    torch.testing.assert_close(zeros, latent, rtol=0, atol=1e-5)


def test_mask_with_the_cache_on(eng):
    """Cache-DiT skips DiT calls; the blend is outside the DiT, so the kept region is still the input."""
    latent, mask = input_latent(1), pixel_mask(1)
    kw = dict(seed=13, steps=8, cfg=1.0, denoise=1.0, noise_mask=mask)
    with torch.inference_mode():
        cached = eng.sample(latent, [feats(5, 1)], cache=CacheConfig(enabled=True, preset="fast"), **kw)
        mask_run = eng.last_run
        full = eng.sample(latent, [feats(5, 1)], cache=CacheConfig(enabled=False), **kw)
    assert mask_run.calls_computed < mask_run.model_calls
    keep = prepare_mask(mask, latent.shape) == 0
    torch.testing.assert_close(cached[keep], latent[keep], rtol=0, atol=1e-5)
    assert not torch.allclose(cached[~keep], full[~keep])  # the cache did change the repainted region


BAD_MASKS = [
    (torch.ones(1, 2, 8, 12), r"noise_mask has shape \(1, 2, 8, 12\); expected \[height, width\], \[batch, height, width\] or \[batch, 1, height, width\]"),
    (torch.ones(8), r"noise_mask has shape \(8,\); expected"),
    (torch.ones(1, 0, 12), r"noise_mask has shape \(1, 0, 12\); expected"),
    ([[1.0]], r"noise_mask has shape list; expected"),
    (torch.full((8, 12), float("nan")), r"noise_mask holds NaN or inf values; it takes values from 0 \(keep\) to 1 \(repaint\)"),
    (torch.full((8, 12), 1.5), r"noise_mask values must be from 0 \(keep\) to 1 \(repaint\) \(got 1.5 to 1.5\)"),
    (-torch.ones(8, 12), r"noise_mask values must be from 0 \(keep\) to 1 \(repaint\) \(got -1 to -1\)"),
]


@pytest.mark.parametrize("mask,message", BAD_MASKS, ids=range(len(BAD_MASKS)))
def test_bad_masks_are_refused(eng, mask, message):
    with pytest.raises(InputError, match=message):
        eng.sample(input_latent(1), [feats(3, 1)], seed=1, steps=2, cfg=1.0, noise_mask=mask)


@pytest.mark.parametrize("index", [[0], [0, -1], [0, 4096], [0, 1.5], "01", 3, [True, 1]])
def test_bad_batch_index_is_refused(eng, index):
    with pytest.raises(InputError, match=r"batch_index must be a list of 2 integers from 0 to 4095, one per latent"):
        eng.sample(input_latent(2), [feats(3, 1)], seed=1, steps=2, cfg=1.0, batch_index=index)
