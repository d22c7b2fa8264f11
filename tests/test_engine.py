"""Engine.sample: the public sampling API (CFG batching, denoise, noise, callbacks, input errors)."""
import pytest
import torch

from engine import Engine, EngineConfig, InputError
from engine.random_weights import SIZES
from engine.sampling import noise_scaling, seeded_noise, sigma_schedule

CFG = SIZES["tiny"]


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from engine.random_weights import save_random_checkpoint

    path = tmp_path_factory.mktemp("m") / "tiny.safetensors"
    save_random_checkpoint(str(path), CFG, seed=5)
    return Engine.from_file(str(path), EngineConfig(dtype="fp32"))


def feats(n, seed):
    return torch.randn(n, CFG.text_in_dim, generator=torch.Generator().manual_seed(seed))


def manual_euler(eng, latent, cond, uncond, seed, steps, cfg, denoise=1.0):
    """The sampling loop written out by hand, ComfyUI's way, one branch per forward."""
    m = eng.model
    sigmas = sigma_schedule(steps, "simple", denoise)
    x = noise_scaling(sigmas[0], seeded_noise(latent.shape, seed), latent)

    def den(x, s, c):
        v = m(x, (s * 1000).expand(x.shape[0]), c[None], torch.tensor([c.shape[0]])).float()
        return x - v * s

    for i in range(len(sigmas) - 1):
        d_c = den(x, sigmas[i], cond)
        d = d_c if uncond is None else den(x, sigmas[i], uncond) + (d_c - den(x, sigmas[i], uncond)) * cfg
        x = x + (x - d) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


def test_matches_hand_written_loop_with_cfg(eng):
    latent = torch.zeros(1, CFG.in_channels, 4, 6)
    cond, uncond = feats(7, 1), feats(2, 2)  # different lengths: padded + masked in one batch
    got = eng.sample(latent, [cond], [uncond], seed=11, steps=5, cfg=4.0)
    want = manual_euler(eng, latent, cond, uncond, 11, 5, 4.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert eng.last_run.model_calls == 5 and eng.last_run.steps_computed == 5


def test_cfg_one_is_a_single_pass_and_ignores_uncond(eng, monkeypatch):
    latent = torch.zeros(2, CFG.in_channels, 4, 4)
    batches = []
    orig = eng.model.forward

    def spy(x, *a):
        batches.append(x.shape[0])
        return orig(x, *a)

    monkeypatch.setattr(eng.model, "forward", spy)
    a = eng.sample(latent, [feats(3, 1)], [feats(4, 2)], seed=1, steps=3, cfg=1.0)
    b = eng.sample(latent, [feats(3, 1)], None, seed=1, steps=3, cfg=1.0)
    assert torch.equal(a, b)
    assert batches == [2] * 6  # no uncond half
    batches.clear()
    eng.sample(latent, [feats(3, 1)], [feats(4, 2)], seed=1, steps=3, cfg=2.0)
    assert batches == [4] * 3  # cond and uncond in one batch


def test_seed_and_batch_broadcast(eng):
    latent = torch.zeros(2, CFG.in_channels, 4, 4)
    a = eng.sample(latent, [feats(3, 1)], seed=3, steps=2, cfg=1.0)
    b = eng.sample(latent, [feats(3, 1), feats(3, 1)], seed=3, steps=2, cfg=1.0)
    c = eng.sample(latent, [feats(3, 1)], seed=4, steps=2, cfg=1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])  # noise differs across the batch, as in ComfyUI


def test_denoise_starts_from_the_input_latent(eng):
    latent = torch.randn(1, CFG.in_channels, 4, 4)
    got = eng.sample(latent, [feats(3, 1)], seed=9, steps=4, cfg=1.0, denoise=0.5)
    assert eng.last_run.steps == 4
    want = manual_euler(eng, latent, feats(3, 1), None, 9, 4, 1.0, denoise=0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(eng.sample(latent, [feats(3, 1)], seed=9, steps=4, cfg=1.0, denoise=0.0), latent)


def test_callback_sees_every_step_and_can_interrupt(eng):
    seen = []
    eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), [feats(3, 1)], seed=0, steps=4, cfg=1.0,
               callback=lambda i, n, x, d: seen.append((i, n, tuple(x.shape), tuple(d.shape))))
    assert [s[:2] for s in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)]

    class Stop(Exception):
        pass

    def stop_at_2(i, n, x, d):
        if i == 2:
            raise Stop()

    with pytest.raises(Stop):
        eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), [feats(3, 1)], seed=0, steps=10, cfg=1.0, callback=stop_at_2)
    assert eng.last_run.steps_computed == 3  # stopped within one step
    # the next run is unaffected
    out = eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), [feats(3, 1)], seed=0, steps=4, cfg=1.0)
    assert torch.isfinite(out).all() and eng.last_run.steps_computed == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(latent=torch.zeros(1, 4, 4, 4)), "latent has 4 channels but this model takes 16"),
    (dict(latent=torch.zeros(16, 4, 4)), r"latent has shape \(16, 4, 4\); expected \[batch, 16, height, width\]"),
    (dict(cond=[]), "positive conditioning is empty"),
    (dict(cond=[torch.zeros(5, 3072)]), "positive conditioning #0 has 3072 features per token but this model takes 48"),
    (dict(cond=[torch.zeros(0, 48)]), r"positive conditioning #0 has shape \(0, 48\)"),
    (dict(uncond=[torch.zeros(2, 7)], cfg=3.0), "negative conditioning #0 has 7 features"),
    (dict(cond=[torch.zeros(2, 48)] * 3), "positive conditioning has 3 entries for a latent batch of 2"),
    (dict(sampler="lms"), "sampler 'lms' is not supported"),
    (dict(scheduler="karras"), "scheduler 'karras' is not supported"),
    (dict(steps=0), "steps must be at least 1"),
])
def test_bad_inputs_are_explained(eng, kwargs, match):
    args = dict(latent=torch.zeros(2, CFG.in_channels, 4, 4), cond=[feats(3, 1)], uncond=None, seed=0, steps=2, cfg=1.0)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        eng.sample(args.pop("latent"), args.pop("cond"), args.pop("uncond"), **args)
