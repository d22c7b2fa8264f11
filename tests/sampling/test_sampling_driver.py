"""One sampling driver (issue 26 item 1): a batcher Job takes everything ``Engine.sample`` takes (shift, the
caller's sigmas, a noise mask, batch_index, a batch latent, denoise < 1 and 0) and, batched with other jobs at
each step, gives the latent of ``Engine.sample`` with the same inputs (demo engine, fp32, CPU: bit-equal alone,
within tests/test_batcher.py's TOLERANCE batched; measured 0 here)."""
import pytest
import torch

from engine import open_demo
from engine.features.cache import CacheConfig
from engine.serve import Batcher, Job

TOLERANCE = 1e-5
TIMEOUT = 120


@pytest.fixture(scope="module")
def text():
    with torch.inference_mode():
        demo = open_demo()
        return demo.encode(["a red circle", "a large blue triangle at the bottom right"]), demo.encode([""])[0]


def engine_sample(eng, j: Job) -> torch.Tensor:
    batched = j.latent.dim() == 4
    cond = [j.cond] if isinstance(j.cond, torch.Tensor) else list(j.cond)
    uncond = None if j.uncond is None else [j.uncond]
    out = eng.sample(j.latent if batched else j.latent[None], cond, uncond, seed=j.seed, steps=j.steps, cfg=j.cfg,
                     sampler=j.sampler, scheduler=j.scheduler, denoise=j.denoise, shift=j.shift, cache=j.cache,
                     noise_mask=j.noise_mask, batch_index=j.batch_index, sigmas=j.sigmas)
    return out if batched else out[0]


def jobs_of_every_kind(text):
    (red, blue), empty = text
    start = torch.linspace(-1, 1, 48 * 16 * 16).reshape(48, 16, 16)
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 16:48, 8:40] = 1.0  # repaint a box (a mask at pixel size: scaled to the latent, as ComfyUI does)
    return {
        "shift": Job(latent=torch.zeros(48, 16, 16), cond=red, uncond=empty, seed=1, steps=5, cfg=3.0, shift=1.5),
        "sigmas": Job(latent=torch.zeros(48, 16, 16), cond=blue, uncond=empty, seed=2, steps=4, cfg=2.0, sampler="heun",
                      sigmas=torch.tensor([1.0, 0.7, 0.4, 0.1, 0.0])),
        "img2img": Job(latent=start, cond=red, uncond=None, seed=3, steps=6, cfg=1.0, denoise=0.6, scheduler="normal"),
        "inpaint": Job(latent=start, cond=blue, uncond=empty, seed=4, steps=5, cfg=3.0, noise_mask=mask, denoise=0.8),
        "batch": Job(latent=torch.zeros(2, 48, 16, 16), cond=[red, blue], uncond=empty, seed=5, steps=4, cfg=3.0, batch_index=[3, 1],
                     sampler="dpmpp_2m"),
        "batch_inpaint_cache": Job(latent=torch.stack([start, -start]), cond=red, uncond=empty, seed=6, steps=8, cfg=2.5,
                                   noise_mask=torch.cat([mask, 1 - mask]), cache=CacheConfig(preset="balanced")),
    }


def test_every_engine_sample_input_through_the_batcher_equals_engine_sample(eng, text):
    b = Batcher(eng, max_batch=16)
    try:
        with torch.inference_mode():
            jobs = jobs_of_every_kind(text)
            futures = dict(zip(jobs, b.submit_many(list(jobs.values()))))  # all join at the first step
            got = {k: f.result(TIMEOUT) for k, f in futures.items()}
            for name, j in jobs.items():
                ref = engine_sample(eng, j)
                assert got[name].shape == ref.shape, name
                err = float((got[name] - ref).abs().max() / ref.abs().max())
                assert err <= TOLERANCE, (name, err)
                assert j.stats.step_mask == eng.last_run.step_mask, name
        stats = b.stats()
        assert stats["samples_per_forward"] > 4, stats  # they did share the forwards
    finally:
        b.close()


def test_one_job_alone_with_mask_and_batch_index_is_bit_equal(eng, text):
    b = Batcher(eng, max_batch=8)
    try:
        with torch.inference_mode():
            j = jobs_of_every_kind(text)["batch_inpaint_cache"]
            j.batch_index = [2, 0]
            got = b.submit(j).result(TIMEOUT)
            ref = engine_sample(eng, j)
        assert torch.equal(got, ref)
        assert False in j.stats.step_mask and j.stats.cache["mask"] == eng.last_run.cache["mask"]
    finally:
        b.close()


def test_denoise_0_answers_the_latent_unchanged(eng, text):
    """As Engine.sample: no step, the input back and a warning (the batcher refused denoise 0 before)."""
    b = Batcher(eng, max_batch=8)
    try:
        start = torch.randn(48, 16, 16, generator=torch.Generator().manual_seed(0))
        j = Job(latent=start, cond=text[0][0], uncond=text[1], seed=1, steps=5, cfg=3.0, denoise=0.0)
        future = b.submit(j)
        assert torch.equal(future.result(TIMEOUT), start)
        assert future.run_stats == {"model_calls": 0, "calls_computed": 0, "samples_per_forward": 0.0}
        assert j.stats.steps == 0 and "denoise is 0" in j.stats.warnings[0]
        assert b.stats()["forwards"] == 0
    finally:
        b.close()
