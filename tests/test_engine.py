"""Engine.sample: the public sampling API (CFG batching, denoise, noise, callbacks, input errors)."""
import pytest
import torch

from engine import EngineConfig, InputError, open_engine
from engine.models.random_weights import SIZES
from engine.sampling import noise_scaling, seeded_noise, sigma_schedule

CFG = SIZES["tiny"]


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from engine.models.random_weights import save_random_checkpoint

    path = tmp_path_factory.mktemp("m") / "tiny.safetensors"
    save_random_checkpoint(str(path), CFG, seed=5)
    return open_engine(str(path), EngineConfig(dtype="fp32"))


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
    assert eng.last_run.model_calls == 5 and eng.last_run.calls_computed == 5


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
    assert eng.last_run.calls_computed == 3  # stopped within one step
    # the next run is unaffected
    out = eng.sample(torch.zeros(1, CFG.in_channels, 4, 4), [feats(3, 1)], seed=0, steps=4, cfg=1.0)
    assert torch.isfinite(out).all() and eng.last_run.calls_computed == 4


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
    (dict(steps=0), r"steps must be an integer from 1 to 10000 \(got 0\)"),
    # non-finite and out-of-range numbers (a blank picture otherwise) and unbounded work, refused up front
    (dict(steps=10001), r"steps must be an integer from 1 to 10000 \(got 10001\)"),
    (dict(steps=2.5), r"steps must be an integer"),
    (dict(cfg=float("nan")), r"cfg must be a finite number from 0 to 100 \(got nan\)"),
    (dict(cfg=float("inf")), r"cfg must be a finite number from 0 to 100 \(got inf\)"),
    (dict(cfg=-1.0), r"cfg must be a finite number from 0 to 100 \(got -1.0\)"),
    (dict(cfg=101.0), r"cfg must be a finite number from 0 to 100"),
    (dict(shift=0.0), r"shift must be a finite number above 0 to 100 \(got 0.0\)"),
    (dict(shift=-3.0), r"shift must be a finite number above 0 to 100"),
    (dict(shift=float("nan")), r"shift must be a finite number above 0 to 100 \(got nan\)"),
    (dict(denoise=float("nan")), r"denoise must be a finite number from 0 to 1 \(got nan\)"),
    (dict(denoise=1.5), r"denoise must be a finite number from 0 to 1 \(got 1.5\)"),
    (dict(denoise=-0.1), r"denoise must be a finite number from 0 to 1"),
    (dict(denoise=1e-6), r"steps / denoise must be at most 10000: 2 steps at denoise 1e-06 need a schedule of 2000000"),
    (dict(seed=2 ** 64), r"seed must be an integer from 0 to 18446744073709551615 \(got 18446744073709551616\)"),
    (dict(seed=-1), r"seed must be an integer from 0 to 18446744073709551615 \(got -1\)"),
    (dict(latent=torch.zeros(1, 16, 257, 256)), r"latent size \(257, 256\) makes 65792 image tokens per sample; the limit "
                                                r"is 65536 \(4096x4096 pixels for ERNIE-Image\)"),
    (dict(latent=torch.full((1, 16, 4, 4), float("nan"))), "latent holds NaN or inf values"),
    (dict(cond=[torch.full((3, 48), float("inf"))]), "positive conditioning #0 holds NaN or inf values"),
])
def test_bad_inputs_are_explained(eng, kwargs, match):
    args = dict(latent=torch.zeros(2, CFG.in_channels, 4, 4), cond=[feats(3, 1)], uncond=None, seed=0, steps=2, cfg=1.0)
    args.update(kwargs)
    calls = []
    handle = eng.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(InputError, match=match):
            eng.sample(args.pop("latent"), args.pop("cond"), args.pop("uncond"), **args)
    finally:
        handle.remove()
    assert calls == []  # refused before any model call


def test_the_largest_seed_and_schedule_are_accepted(eng):
    latent = torch.zeros(1, CFG.in_channels, 4, 4)
    eng.sample(latent, [feats(3, 1)], seed=2 ** 64 - 1, steps=1, cfg=1.0)
    eng.sample(latent, [feats(3, 1)], seed=0, steps=2, cfg=1.0, denoise=2 / 10000)  # a schedule of exactly 10000
    assert eng.last_run.steps == 2


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    """A real checkpoint with one damaged (NaN) weight in the last block's MLP."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from engine.models.random_weights import save_random_checkpoint

    d = tmp_path_factory.mktemp("nan")
    save_random_checkpoint(str(d / "good.safetensors"), CFG, seed=5)
    with safe_open(str(d / "good.safetensors"), "pt") as f:
        meta = f.metadata()
    sd = load_file(str(d / "good.safetensors"))
    sd["layers.1.mlp.linear_fc2.weight"][3, 7] = float("nan")
    save_file(sd, str(d / "nan.safetensors"), metadata=meta)
    return str(d / "nan.safetensors")


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_a_model_that_produces_nan_stops_at_the_first_bad_step(nan_checkpoint, sampler):
    """Under inference_mode, as ComfyUI runs the KSampler node; an InputError subclass, so the node and the CLI
    report it as one."""
    from engine.errors import ModelOutputError

    bad = open_engine(nan_checkpoint, EngineConfig(dtype="fp32"))
    with torch.inference_mode(), pytest.raises(ModelOutputError) as err:
        bad.sample(torch.zeros(1, CFG.in_channels, 4, 4), [feats(3, 1)], [feats(2, 2)], seed=0, steps=6, cfg=3.0,
                   sampler=sampler)
    calls = 11 if sampler == "heun" else 6
    assert str(err.value).startswith(f"the model produced NaN/inf at step 1 of 6 (model call 1 of {calls}): "
                                     "the weights may be damaged")
    assert isinstance(err.value, InputError)
    assert len(bad.last_run.call_seconds) == 1  # stopped at once, not after the whole run


def test_both_runners_follow_the_runner_protocol(eng):
    """What Engine asks of where the DiT runs is declared once (engine/runner.py): the local runner and the ranked
    one provide every member, and so do their runs (the ranked runner's attributes read from its constructor: making
    one starts worker processes, which tests/test_parallel.py does)."""
    import inspect
    import re

    from engine.local import LocalRun
    from engine.parallel.ranked import RankedRun, RankedRunner
    from engine.runner import Run, Runner, members

    assert "run" in members(Runner) and "config" in members(Runner) and members(Run) == ["call", "finish"]
    assert [m for m in members(Runner) if not hasattr(eng.runner, m)] == []
    assigned = inspect.getsource(RankedRunner.__init__)
    assert [m for m in members(Runner)
            if not hasattr(RankedRunner, m) and not re.search(rf"self\.{m}\b[^=\n]*=", assigned)] == []
    assert [m for m in members(Run) if not (hasattr(LocalRun, m) and hasattr(RankedRun, m))] == []
