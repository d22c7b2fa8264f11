"""engine.serve.Batcher: step-level continuous batching on the demo engine (fp32, CPU), each job against its own
``Engine.sample`` run alone.

Exactness: a job alone in the batch is asserted bit-equal. Batched with others, a job's latent is asserted within
``TOLERANCE`` x max|ref| (fp32): the joined forward keeps every sample's shape-dependent ops at its own shapes
(engine/serve/forward.py), and on this CPU the measured error is 0 (bit-equal), but another BLAS may round the
joined GEMMs' rows differently (on a GPU, cuBLAS picks kernels by M).
"""
import threading

import pytest
import torch

from engine import EngineConfig, InputError, open_demo, open_engine
from engine.engine import pad_text
from engine.features.cache import CacheConfig
from engine.serve import Batcher, Job
from engine.serve.forward import Call, joint_velocity

TOLERANCE = 1e-5  # max abs error / max|ref| for a batched job
PROMPTS = ["a large red circle on the left, on a blue background", "green square", "a red circle",
           "a large blue triangle at the bottom right, on a yellow background", "circle", "a small yellow circle"]
JOIN_TIMEOUT = 60  # seconds a test waits for a result before calling the batcher stuck


@pytest.fixture(scope="module")
def text():
    with torch.inference_mode():
        demo = open_demo()
        return demo.encode(PROMPTS), demo.encode([""])[0]


@pytest.fixture
def batcher(eng):
    b = Batcher(eng, max_batch=8)
    yield b
    b.close()


def job(text, i, *, steps=6, cfg=3.0, sampler="euler", size=(16, 16), **kw):
    feats, uncond = text
    return Job(latent=torch.zeros(48, *size), cond=feats[i], uncond=uncond, seed=100 + i, steps=steps, cfg=cfg, sampler=sampler, **kw)


def solo(eng, j: Job) -> torch.Tensor:
    """The job alone through Engine.sample."""
    return eng.sample(j.latent[None], [j.cond], None if j.uncond is None else [j.uncond], seed=j.seed, steps=j.steps,
                      cfg=j.cfg, sampler=j.sampler, scheduler=j.scheduler, cache=j.cache)[0]


def rel_err(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.slow
def test_joint_forward_equals_each_call_alone(eng, text):
    """The joined forward (texts of lengths 2..9, CFG pairs and single rows) against the model alone per call."""
    feats, uncond = text
    g = torch.Generator().manual_seed(1)
    calls = []
    with torch.inference_mode():
        for i, f in enumerate(feats):
            branches = [f, uncond] if i % 3 != 2 else [f]
            t, lens = pad_text(branches, eng.runner.dtype, eng.device)
            x, s = torch.randn(1, 48, 16, 16, generator=g), torch.rand(1, generator=g)
            calls.append(Call(torch.cat([x] * len(branches)), torch.cat([s] * len(branches)), t, lens))
        got = joint_velocity(eng.model, calls, eng.device)
        for c, v in zip(calls, got):
            ref = eng.runner.velocity(c.x, c.sigma, c.text, c.lens)
            assert rel_err(v, ref) <= TOLERANCE


def test_one_job_alone_is_engine_sample_bit_exact(eng, text, batcher):
    with torch.inference_mode():
        j = job(text, 0, steps=8)
        ref = solo(eng, j)
        future = batcher.submit(j)
        got = future.result(JOIN_TIMEOUT)
    assert torch.equal(got, ref)
    assert got.shape == (48, 16, 16) and got.dtype == torch.float32 and got.device.type == "cpu"
    assert batcher.stats()["forwards"] == 8 and j.stats.step_mask == [True] * 8
    assert future.run_stats == {"model_calls": 8, "calls_computed": 8, "samples_per_forward": 2.0}  # CFG: 2 rows


def test_six_jobs_joining_mid_run_each_equal_their_solo_run(eng, text, batcher):
    """Different prompts, seeds, steps, cfg (1 = no CFG) and samplers; four of them join while others run."""
    with torch.inference_mode():
        jobs = [job(text, 0, steps=8, cfg=3.0), job(text, 1, steps=6, cfg=1.0, sampler="euler_ancestral"),
                job(text, 2, steps=5, cfg=4.0, sampler="heun"), job(text, 3, steps=7, cfg=2.5, sampler="dpmpp_2m"),
                job(text, 4, steps=4, cfg=1.0), job(text, 5, steps=9, cfg=5.0)]
        refs = [solo(eng, j) for j in jobs]
        futures = {}
        joined_at = {}

        def later(step, total):  # job 0's progress submits the others mid-run
            for k, at in ((2, 2), (3, 3), (4, 3), (5, 5)):
                if step == at and k not in futures:
                    futures[k] = batcher.submit(jobs[k])
                    joined_at[k] = step

        jobs[0].on_step = later
        futures[0], futures[1] = batcher.submit_many(jobs[:2])
        got = {k: f.result(JOIN_TIMEOUT) for k, f in sorted(futures.items()) if k < 2}
        got.update({k: futures[k].result(JOIN_TIMEOUT) for k in range(2, 6)})
    errors = [rel_err(got[k], refs[k]) for k in range(6)]
    assert max(errors) <= TOLERANCE, errors
    assert joined_at == {2: 2, 3: 3, 4: 3, 5: 5}
    stats = batcher.stats()
    calls = sum(j.stats.model_calls for j in jobs)  # heun: 2 per step but the last
    assert stats["calls_total"] == calls and stats["calls_computed"] == calls
    assert stats["steps_done"] == sum(j.steps for j in jobs)
    assert stats["forwards"] < calls and stats["samples_per_forward"] > 1.5, stats
    assert stats["running"] == 0 and stats["queued"] == 0


def test_max_batch_bounds_the_samples_in_flight(eng, text):
    """Three CFG jobs (2 samples each) with max_batch 4: the third waits for a slot; results unchanged."""
    b = Batcher(eng, max_batch=4)
    try:
        with torch.inference_mode():
            jobs = [job(text, k, steps=4) for k in range(3)]
            got = [f.result(JOIN_TIMEOUT) for f in b.submit_many(jobs)]
            refs = [solo(eng, j) for j in jobs]
        assert max(rel_err(g, r) for g, r in zip(got, refs)) <= TOLERANCE
        stats = b.stats()
        assert stats["forwards"] == 8 and stats["samples_per_forward"] == 3.0  # 4 ticks of 4 samples, 4 of 2
    finally:
        b.close()


def test_jobs_wait_for_device_memory_beside_the_running_batch(eng, text):
    """On a GPU the batcher also admits jobs by bytes: their activations (the model family's estimate, with offload
    "auto"'s margin) within the memory free beside the weights at its start (``LocalRunner.activation_room``).
    This CPU has no device memory to read (the room is None: no byte bound), so the test sets the room to what a
    small card would leave, two jobs' worth: three CFG jobs under max_batch 8 then run two, then one (the
    rehearsal on fake CUDA tensors checks the room itself: tests/test_memory_rehearsal.py)."""
    b = Batcher(eng, max_batch=8)
    assert b.activation_room is None
    try:
        with torch.inference_mode():
            jobs = [job(text, k, steps=4) for k in range(3)]
            tokens = max(max(j.cond.shape[0], j.uncond.shape[0]) for j in jobs)
            one = eng.runner.activation_bytes((2, 48, 16, 16), tokens) * 1.25
            b.activation_room = int(2.5 * one)
            got = [f.result(JOIN_TIMEOUT) for f in b.submit_many(jobs)]
            refs = [solo(eng, j) for j in jobs]
        assert max(rel_err(g, r) for g, r in zip(got, refs)) <= TOLERANCE
        stats = b.stats()
        assert stats["forwards"] == 8 and stats["samples_per_forward"] == 3.0  # 4 ticks of 4 samples, 4 of 2
        assert stats["waited_for_memory"] == 1
    finally:
        b.close()


def test_two_latent_sizes_never_share_a_forward(eng, text, batcher):
    with torch.inference_mode():
        jobs = [job(text, 0, steps=5), job(text, 1, steps=5, size=(8, 12)), job(text, 2, steps=5, size=(8, 12))]
        futures = batcher.submit_many(jobs)
        got = [f.result(JOIN_TIMEOUT) for f in futures]
        refs = [solo(eng, j) for j in jobs]
    assert [tuple(g.shape) for g in got] == [(48, 16, 16), (48, 8, 12), (48, 8, 12)]
    assert max(rel_err(g, r) for g, r in zip(got, refs)) <= TOLERANCE
    assert batcher.stats()["forwards"] == 10  # two forwards a tick: one per size


def test_cancel_frees_a_slot_and_the_others_finish(eng, text):
    """max_batch 2 with three cfg-1 jobs: the third waits; cancelling the first mid-run lets it in."""
    b = Batcher(eng, max_batch=2)
    try:
        with torch.inference_mode():
            jobs = [job(text, 0, steps=50, cfg=1.0), job(text, 1, steps=6, cfg=1.0), job(text, 2, steps=6, cfg=1.0)]
            first, queued_then, known = [], [], threading.Event()

            def cancel_at_2(step, total):
                if step == 2:
                    queued_then.append(b.stats()["queued"])
                    known.wait(JOIN_TIMEOUT)
                    b.cancel(first[0])

            jobs[0].on_step = cancel_at_2
            futures = b.submit_many(jobs)
            first.append(futures[0])
            known.set()
            got = [f.result(JOIN_TIMEOUT) for f in futures[1:]]
            refs = [solo(eng, j) for j in jobs[1:]]
        assert first[0].cancelled() and queued_then == [1]  # the third waited for the slot
        assert max(rel_err(g, r) for g, r in zip(got, refs)) <= TOLERANCE
        assert len(jobs[0].stats.step_mask) <= 3  # it left at the next step
        assert b.stats()["calls_total"] <= 3 + 12
    finally:
        b.close()


def test_failing_jobs_fail_alone_and_the_loop_keeps_serving(eng, text, batcher):
    """An on_step that raises: that future fails, the rest (in the same forwards) match their solo runs. Text
    features that would overflow the model to inf (3e38) are refused at submit, naming the input (issue 25
    item 9: they made a ModelOutputError blaming the weights), and the loop keeps serving."""
    def boom(step, total):
        if step == 2:
            raise RuntimeError("client went away")

    with torch.inference_mode():
        with pytest.raises(InputError, match="positive conditioning #0 holds values up to 3e\\+38"):
            batcher.submit(Job(latent=torch.zeros(48, 16, 16), cond=torch.full((3, 128), 3e38), uncond=text[1], seed=1, steps=5, cfg=3.0))
        jobs = [job(text, 0, steps=5), job(text, 1, steps=5, on_step=boom), job(text, 2, steps=5)]
        futures = batcher.submit_many(jobs)
        with pytest.raises(RuntimeError, match="client went away"):
            futures[1].result(JOIN_TIMEOUT)
        for k in (0, 2):
            assert rel_err(futures[k].result(JOIN_TIMEOUT), solo(eng, jobs[k])) <= TOLERANCE
        after = job(text, 4, steps=3)
        assert torch.equal(batcher.submit(after).result(JOIN_TIMEOUT), solo(eng, after))


def test_close_with_running_jobs_returns_and_cancels_them(eng, text):
    b = Batcher(eng, max_batch=4)
    started = threading.Event()
    with torch.inference_mode():
        running = [b.submit(job(text, k, steps=5000, on_step=lambda s, t: started.set())) for k in range(2)]
        queued = b.submit(job(text, 2, steps=5000))
        assert started.wait(JOIN_TIMEOUT)
    closer = threading.Thread(target=b.close)
    closer.start()
    closer.join(JOIN_TIMEOUT)
    assert not closer.is_alive() and not b._loop.is_alive()
    assert all(f.cancelled() for f in running + [queued])
    assert b.stats()["running"] == 0 and b.stats()["queued"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(job(text, 0))


def test_close_without_cancel_lets_running_jobs_finish(eng, text):
    b = Batcher(eng, max_batch=2)
    with torch.inference_mode():
        started, closing = threading.Event(), threading.Event()

        def first_step_waits_for_close(step, total):  # the job is running; it goes on once close() dropped the queue
            started.set()
            closing.wait(JOIN_TIMEOUT)

        j = job(text, 0, steps=4, on_step=first_step_waits_for_close)
        running, queued = b.submit_many([j, job(text, 1, steps=4)])
        queued.add_done_callback(lambda f: closing.set())
        assert started.wait(JOIN_TIMEOUT)
        b.close(cancel_running=False)
        assert torch.equal(running.result(0), solo(eng, j))
    assert queued.cancelled() and not b._loop.is_alive()


def test_cache_on_jobs_skip_the_middle_blocks_inside_the_shared_forward(eng, text, batcher):
    """Per-request Cache-DiT: two balanced jobs (static masks, TaylorSeer), a dynamic-threshold job with other
    fn/bn, and a cache-off job share every forward; each cache-on job's latent and step mask equal its
    Engine.sample with the same cache."""
    balanced = CacheConfig(preset="balanced")
    dynamic = CacheConfig(fn=2, bn=1, warmup=2, rdt=0.5, mc=2)
    with torch.inference_mode():
        jobs = [job(text, 0, steps=12, cache=balanced), job(text, 1, steps=12), job(text, 2, steps=10, cache=balanced),
                job(text, 3, steps=12, cache=dynamic)]
        got = [f.result(JOIN_TIMEOUT) for f in batcher.submit_many(jobs)]
        for g, j in zip(got, jobs):
            ref = solo(eng, j)
            assert rel_err(g, ref) <= TOLERANCE
            assert j.stats.step_mask == eng.last_run.step_mask
            if j.cache is not None:
                assert False in j.stats.step_mask and j.stats.cache["mask"] == eng.last_run.cache["mask"]
    stats = batcher.stats()
    assert stats["forwards"] == 12  # the cache-on jobs did not run apart
    assert stats["calls_total"] == 46
    assert stats["calls_computed"] == 46 - sum(j.stats.step_mask.count(False) for j in jobs)


@pytest.mark.parametrize("change, message", [
    (dict(sampler="ddim"), "sampler 'ddim' is not supported; choose one of euler, euler_ancestral, heun, dpmpp_2m"),
    (dict(scheduler="karras"), "scheduler 'karras' is not supported"),
    (dict(steps=0), "steps"),
    (dict(cfg=-1.0), "cfg"),
    (dict(seed=-1), "seed"),
    (dict(latent=torch.zeros(1, 1, 48, 16, 16)),
     r"latent has shape \(1, 1, 48, 16, 16\); expected \[48, height, width\] or \[batch, 48, height, width\]"),
    (dict(noise_mask=torch.full((16, 16), 2.0)), "noise_mask values must be from 0"),
    (dict(batch_index=[0, 1]), "batch_index must be a list of 1 integers"),
    (dict(sigmas=torch.tensor([1.0, 0.5, 0.0])), "steps is 6 but the sigmas make 2 steps"),
    (dict(shift=0.0), "shift"),
    (dict(latent=torch.zeros(16, 16, 16)), "latent has 16 channels"),
    (dict(cond=torch.zeros(3, 7)), "positive conditioning #0 has 7 features per token"),
    (dict(uncond=torch.full((2, 128), float("nan"))), "negative conditioning #0 holds NaN"),
    (dict(cache=CacheConfig(fn=3, bn=2)), "leaves no middle blocks"),
    (dict(on_step=5), "on_step must be callable"),
])
def test_bad_jobs_are_refused_at_submit(eng, text, batcher, change, message):
    j = job(text, 0)
    for k, v in change.items():
        setattr(j, k, v)
    with pytest.raises(InputError, match=message):
        batcher.submit(j)
    assert batcher.stats()["queued"] == 0 and batcher.stats()["running"] == 0


def test_bad_max_batch_is_refused(eng):
    with pytest.raises(InputError, match="max_batch must be an integer >= 1"):
        Batcher(eng, max_batch=0)


@pytest.mark.slow
@pytest.mark.subprocess
def test_several_ranks_run_one_job_at_a_time_equal_to_engine_sample(tiny_checkpoint):
    """An engine on 2 gloo ranks (RankedRunner: the ranks keep one run at a time): the batcher admits one job
    at a time, each job (one with Cache-DiT on the ranks) equal to the same engine's Engine.sample."""
    from engine.models.random_weights import SIZES
    from engine.parallel import shutdown_pools

    cfg = SIZES["tiny"]
    g = torch.Generator().manual_seed(1)
    remote = open_engine(str(tiny_checkpoint), EngineConfig(ulysses_degree=2))
    b = Batcher(remote, max_batch=8)
    try:
        with torch.inference_mode():
            jobs = [Job(latent=torch.zeros(cfg.in_channels, 6, 5), cond=torch.randn(7, cfg.text_in_dim, generator=g),
                        uncond=torch.randn(3, cfg.text_in_dim, generator=g), seed=3, steps=8, cfg=3.0,
                        cache=CacheConfig(preset="fast")),
                    Job(latent=torch.zeros(cfg.in_channels, 6, 5), cond=torch.randn(4, cfg.text_in_dim, generator=g), uncond=None,
                        seed=4, steps=5, cfg=1.0)]
            got = [f.result(JOIN_TIMEOUT) for f in b.submit_many(jobs)]
            for g_, j in zip(got, jobs):
                assert torch.equal(g_, solo(remote, j))
                assert j.stats.step_mask == remote.last_run.step_mask
        assert False in jobs[0].stats.step_mask
        stats = b.stats()
        assert stats["forwards"] == 13 and stats["samples_per_forward"] == (8 * 2 + 5) / 13
    finally:
        b.close()
        shutdown_pools()


def test_a_fault_of_the_loop_fails_every_job_and_closes(eng, text, monkeypatch):
    """The loop itself failing (injected here: the real loop has no known fault) leaves no future waiting."""
    b = Batcher(eng, max_batch=8)

    def broken(slots):
        raise MemoryError("injected")

    monkeypatch.setattr(b, "_tick", broken)
    with torch.inference_mode():
        futures = b.submit_many([job(text, 0), job(text, 1)])
    for f in futures:
        with pytest.raises(RuntimeError, match="the batcher's loop failed: MemoryError: injected"):
            f.result(JOIN_TIMEOUT)
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(job(text, 0))
    b.close()
    assert not b._loop.is_alive()
