"""Parallel engine on CPU with 2 gloo worker processes (engine/parallel).

Each test's engine starts a pool of 2 processes, and closing the engine stops them (the last user
of the pool). Each mode must equal the single-process engine: fp32 max abs error
<= 1e-4 x max|reference|, with and without Cache-DiT. Everything is bounded by timeouts.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from engine import EngineConfig, open_engine
from engine.features.cache import CacheConfig
from engine.models.random_weights import SIZES, save_random_checkpoint
from engine.parallel import ParallelConfigError, ParallelWorkerError, make_plan, open_ranked_runner, shutdown_pools, validate
from engine.parallel.plan import cpu_rank_limit

try:  # tests/ may or may not be a package
    from .comfy_server import pids_gone
except ImportError:
    from comfy_server import pids_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {"ulysses2": dict(ulysses_degree=2), "ring2": dict(ring_degree=2), "tp2": dict(tp=2), "cfg2": dict(cfg_parallel=True)}
STEPS = 8
# Data-dependent cache decisions (threshold path; margins to 0.95 are >= 0.017 on this model): the
# decision must be all-reduced across ranks (under CFG parallel the two branches disagree at some calls).
DYNAMIC_CACHE = CacheConfig(warmup=1, rdt=0.95, mc=2)
PRESET_CACHE = CacheConfig(preset="fast")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import engine.parallel.pool as pool_mod

    # bounded: a hang becomes an error (start 120 s, a request 60 s, a collective 60 s); the heartbeat
    # limit stays at its default
    saved = pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S
    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = 120.0, 60.0, 60.0
    path = str(tmp_path_factory.mktemp("par") / "tiny.safetensors")
    cfg = SIZES["tiny"]
    save_random_checkpoint(path, cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    # 6x5 image tokens + text of 7 and 3 tokens: the unified sequence (37) is odd (padding for sp=2)
    # and the text is padded (key mask).
    inputs = dict(latent=torch.zeros(1, cfg.in_channels, 6, 5), cond=[torch.randn(7, cfg.text_in_dim, generator=g)],
                  uncond=[torch.randn(3, cfg.text_in_dim, generator=g)])
    single = open_engine(path, EngineConfig())
    refs = {}
    for name, cache in (("off", CacheConfig(enabled=False)), ("dynamic", DYNAMIC_CACHE), ("preset", PRESET_CACHE)):
        out = single.sample(inputs["latent"], inputs["cond"], inputs["uncond"], seed=3, steps=STEPS, cfg=3.0, cache=cache)
        refs[name] = (out, single.last_run.to_dict()["step_mask"])
    yield path, inputs, refs
    shutdown_pools()
    pool_mod.START_TIMEOUT_S, pool_mod.CALL_TIMEOUT_S, pool_mod.PG_TIMEOUT_S = saved


def _run(eng, inputs, cache, **kw):
    return eng.sample(inputs["latent"], inputs["cond"], inputs["uncond"], seed=3, steps=STEPS, cfg=3.0, cache=cache, **kw)


def _close(out, ref):
    return (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_equals_single_process(setup, mode):
    path, inputs, refs = setup
    eng = open_engine(path, EngineConfig(**MODES[mode]))
    try:
        assert eng.runner.plan.world_size == 2
        for name, cache in (("off", CacheConfig(enabled=False)), ("dynamic", DYNAMIC_CACHE), ("preset", PRESET_CACHE)):
            out = _run(eng, inputs, cache)
            ref, mask = refs[name]
            err = (out - ref).abs().max().item()
            assert _close(out, ref), f"{mode} cache={name}: max abs err {err:.3g} vs max|ref| {ref.abs().max().item():.3g}"
            # every rank took the same decisions, and the same as one process
            assert eng.last_run.to_dict()["step_mask"] == mask, (mode, name)
            if name != "off":
                assert eng.last_run.cache["cached"] > 0
    finally:
        eng.release()


def _write_lora(path, cfg, seed=0, rank=4):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    sd = {}
    for m, (o, i) in {"layers.0.self_attention.to_q": (h, h), "layers.1.mlp.linear_fc2": (h, f),
                      "layers.1.self_attention.to_out.0": (h, h)}.items():
        sd[f"transformer.{m}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.3
        sd[f"transformer.{m}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.3
    save_file(sd, str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.subprocess
def test_lora_on_the_workers(setup, tmp_path):
    """LoRAs merge on every rank (sequence/CFG parallel: the whole weights; TP: each rank's slices) like on one process."""
    from engine.features.lora import LoRAError

    path, inputs, refs = setup
    lora = _write_lora(tmp_path / "l.safetensors", SIZES["tiny"])
    single = open_engine(path, EngineConfig())
    single.set_loras([(lora, 0.8)])
    ref = _run(single, inputs, CacheConfig(enabled=False))
    assert not _close(ref, refs["off"][0])  # the LoRA changes the image
    eng = open_engine(path, EngineConfig(ring_degree=2))
    try:
        assert eng.set_loras([(lora, 0.8)]) == single.lora_report
        assert _close(_run(eng, inputs, CacheConfig(enabled=False)), ref)
        assert eng.check_lora(lora) == []
        with pytest.raises(LoRAError):
            eng.set_loras([(str(tmp_path / "missing.safetensors"), 1.0)])
        eng.set_loras([])  # exact restore on the workers, and the pool survived the bad file
        assert _close(_run(eng, inputs, CacheConfig(enabled=False)), refs["off"][0])
    finally:
        eng.release()
    tp = open_engine(path, EngineConfig(tp=2))  # each rank its slice of every update (it was refused)
    try:
        assert tp.set_loras([(lora, 0.8)]) == single.lora_report
        assert _close(_run(tp, inputs, CacheConfig(enabled=False)), ref)
        tp.set_loras([])
        assert _close(_run(tp, inputs, CacheConfig(enabled=False)), refs["off"][0])
    finally:
        tp.release()


@pytest.mark.slow
@pytest.mark.subprocess
def test_worker_killed_mid_run_fails_fast_and_next_run_works(setup):
    path, inputs, refs = setup
    eng = open_engine(path, EngineConfig(ulysses_degree=2))
    pids = eng.runner.pids
    assert len(pids) == 2

    def kill_rank1(step, total, x, denoised):
        if step == 1:
            os.kill(pids[1], signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(ParallelWorkerError, match="rank 1"):
        _run(eng, inputs, CacheConfig(enabled=False), callback=kill_rank1)
    assert time.monotonic() - t0 < 30
    out = _run(eng, inputs, CacheConfig(enabled=False))  # a fresh pool
    assert eng.runner.pids and eng.runner.pids[1] != pids[1]
    assert _close(out, refs["off"][0])
    assert eng.release() > 0  # weights unloaded from the workers for the host; the next run loads them again
    assert _close(_run(eng, inputs, CacheConfig(enabled=False)), refs["off"][0])
    eng.release()


@pytest.mark.slow
@pytest.mark.subprocess
def test_stopped_worker_is_named_within_30_s_and_next_run_works(setup):
    """A worker that stops answering (SIGSTOP) is found by its missing heartbeat, with the default
    limit and a call timeout (60 s here) far away: the error names rank 1 and its pid in < 30 s."""
    path, inputs, refs = setup
    eng = open_engine(path, EngineConfig(ring_degree=2))
    pids = eng.runner.pids

    def stop_rank1(step, total, x, denoised):
        if step == 1:
            os.kill(pids[1], signal.SIGSTOP)

    t0 = time.monotonic()
    try:
        with pytest.raises(ParallelWorkerError, match=f"rank 1 \\(pid {pids[1]}\\) stopped answering") as err:
            _run(eng, inputs, CacheConfig(enabled=False), callback=stop_rank1)
        assert time.monotonic() - t0 < 30
        assert "the process is stopped" in str(err.value)
        assert not eng.runner.transport.pool.alive and pids_gone(pids)  # the stopped worker was killed too
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    out = _run(eng, inputs, CacheConfig(enabled=False))  # a fresh pool
    assert eng.runner.pids and not set(eng.runner.pids) & set(pids)
    assert _close(out, refs["off"][0])
    eng.release()


@pytest.mark.slow
@pytest.mark.subprocess
def test_slow_but_healthy_worker_is_not_taken_for_hung(setup, monkeypatch):
    """Every rank busy in one request for 3x the heartbeat limit (a long kernel, a compile): its
    heartbeat thread keeps beating, so the request completes and the pool stays up."""
    import engine.parallel.pool as pool_mod

    path, inputs, refs = setup
    eng = open_engine(path, EngineConfig(ulysses_degree=2))
    try:
        monkeypatch.setattr(pool_mod, "HEARTBEAT_TIMEOUT_S", 2.0)
        pool = eng.runner.transport.pool
        assert pool.request(("debug_sleep", 6.0)) is True
        assert pool.alive
        assert _close(_run(eng, inputs, CacheConfig(enabled=False)), refs["off"][0])
    finally:
        eng.release()


@pytest.mark.slow
@pytest.mark.subprocess
def test_close_stops_the_workers_of_the_last_engine(setup):
    """Workers hold memory (a GPU context, ~1 GB each): they stop when the last engine using them is
    closed or released, and the next run starts them again."""
    path, inputs, refs = setup
    a = open_engine(path, EngineConfig(ulysses_degree=2))
    b = open_engine(path, EngineConfig(ring_degree=2))  # same shape: the same pool
    pids = a.runner.pids
    assert len(pids) == 2 and b.runner.pids == pids
    a.release()
    assert not pids_gone(pids, timeout=0.5) and b.runner.pids == pids  # b still uses them
    b.release()
    assert pids_gone(pids) and a.runner.pids == [] and b.runner.pids == []
    assert _close(_run(b, inputs, CacheConfig(enabled=False)), refs["off"][0])
    new = b.runner.pids
    assert len(new) == 2 and not set(new) & set(pids)
    b.release()
    assert pids_gone(new)


@pytest.mark.subprocess
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_workers_end_with_the_parent_process(setup, ending):
    """The workers do not outlive the process that started them: a normal exit (engine not closed)
    or a SIGKILL of the parent."""
    path, _, _ = setup
    script = textwrap.dedent(f"""
        import sys, time
        from engine import EngineConfig, open_engine
        eng = open_engine({path!r}, EngineConfig(ulysses_degree=2))
        print(*eng.runner.pids, flush=True)
        if {ending == "sigkill"!r}:
            time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.communicate(timeout=60)
        if ending == "sigkill":
            proc.kill()
        assert proc.wait(timeout=60) in (0, -signal.SIGKILL)
        assert pids_gone(pids)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf"])
def test_bad_timeout_variable_is_refused_before_any_worker(setup, monkeypatch, value):
    import engine.parallel.pool as pool_mod

    path, _, _ = setup

    def no_start(*a, **k):
        raise AssertionError("a worker pool was started with a bad timeout variable")

    monkeypatch.setattr(pool_mod.WorkerPool, "start", no_start)
    monkeypatch.setattr(pool_mod, "CALL_TIMEOUT_S", None)  # read the environment, as outside the tests
    monkeypatch.setenv("SGLD_PARALLEL_CALL_TIMEOUT", value)
    with pytest.raises(ParallelConfigError, match="SGLD_PARALLEL_CALL_TIMEOUT=.* positive number of seconds"):
        open_engine(path, EngineConfig(ulysses_degree=2))
    monkeypatch.setenv("SGLD_PARALLEL_CALL_TIMEOUT", " 2.5 ")
    assert pool_mod.setting("CALL_TIMEOUT_S") == 2.5
    monkeypatch.delenv("SGLD_PARALLEL_CALL_TIMEOUT")
    assert pool_mod.setting("CALL_TIMEOUT_S") == 1800.0


@pytest.mark.subprocess
def test_bad_timeout_variable_does_not_break_the_import():
    """The variables are read when a pool starts: importing the engine (ComfyUI loading the pack) works."""
    env = dict(os.environ, PYTHONPATH=ROOT, SGLD_PARALLEL_CALL_TIMEOUT="abc", SGLD_PARALLEL_HEARTBEAT_TIMEOUT="x")
    code = ("import engine.parallel.pool as p\n"
            "from engine import EngineConfig\n"
            "EngineConfig(ulysses_degree=2)\n"
            "try:\n    p.check_settings()\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "SGLD_PARALLEL_CALL_TIMEOUT='abc' is not valid" in r.stdout


def test_invalid_degrees_refused_before_any_worker(setup, monkeypatch):
    path, _, _ = setup
    import engine.parallel.pool as pool_mod

    def no_start(*a, **k):
        raise AssertionError("a worker pool was started for an invalid configuration")

    monkeypatch.setattr(pool_mod.WorkerPool, "start", no_start)
    with pytest.raises(ValueError, match="do not multiply"):
        EngineConfig(tp=2, ulysses_degree=2, num_gpus=2)
    with pytest.raises(ValueError, match="tp"):
        EngineConfig(tp=0)
    with pytest.raises(ValueError, match="cfg_parallel"):
        EngineConfig(cfg_parallel=3)
    # tiny has 4 heads (MLP 192): ulysses 8 and tp 3 do not divide them (a machine with 64 cores)
    with pytest.raises(ParallelConfigError, match="ulysses_degree = 8 does not divide"):
        validate(EngineConfig(ulysses_degree=8), 4, 192, cpu_ranks=64)
    with pytest.raises(ParallelConfigError, match="tp = 3 does not divide"):
        validate(EngineConfig(tp=3), 4, 192, cpu_ranks=64)
    with pytest.raises(ParallelConfigError, match="TP rank holds"):
        validate(EngineConfig(tp=2, ulysses_degree=4), 4, 192, cpu_ranks=64)
    with pytest.raises(ParallelConfigError, match="ulysses_degree = 8 does not divide"):
        open_ranked_runner(path, EngineConfig(ulysses_degree=8, device="cuda"), available_gpus=8)
    # more ranks than GPUs, or, on the CPU (gloo processes), than CPU cores: that comes first
    with pytest.raises(ParallelConfigError, match="needs 4 GPUs but 1 are visible"):
        validate(EngineConfig(device="cuda", ulysses_degree=4), 32, 12288, available_gpus=1)
    with pytest.raises(ParallelConfigError, match="num_gpus = 8 .*needs 8 GPUs but this machine has no CUDA GPU; run on the CPU"):
        validate(EngineConfig(device="cuda", num_gpus=8), 32, 12288, available_gpus=0)
    too_many = cpu_rank_limit() + 1
    with pytest.raises(ParallelConfigError, match=f"num_gpus = {too_many} .*on the CPU the ranks run as gloo processes, "
                                                  f"at most {too_many - 1} here"):
        open_engine(path, EngineConfig(num_gpus=too_many))
    with pytest.raises(ParallelConfigError, match="num_gpus = 8 \\(ulysses=8\\): this machine has no CUDA GPU; on the CPU"):
        validate(EngineConfig(num_gpus=8), 32, 12288, available_gpus=0, cpu_ranks=2)
    with pytest.raises(ParallelConfigError, match="cpu"):
        validate(EngineConfig(device="mps", ulysses_degree=2), 32, 12288)


def test_plan_layout_and_degrees():
    p = make_plan(tp=2, ulysses_degree=2, ring_degree=2, cfg_parallel=True)
    assert p.world_size == 16
    groups = p.groups()
    assert groups["tp"][0] == [0, 1] and groups["ulysses"][0] == [0, 2] and groups["ring"][0] == [0, 4]
    assert groups["cfg"][0] == [0, 8] and groups["sp"][0] == [0, 2, 4, 6]
    for kind in groups:  # every rank in exactly one group of each kind
        flat = sorted(r for g in groups[kind] for r in g)
        assert flat == list(range(16))
    for rank in range(16):
        assert p.rank_of(*p.coords(rank)) == rank
    assert make_plan(num_gpus=4).ulysses == 4  # a GPU count alone: Ulysses over all ranks
    assert EngineConfig().world_size == 1 and EngineConfig(ring_degree=2, cfg_parallel=True).world_size == 4


def test_attention_primitives_in_process():
    """LSE merge of key blocks equals full masked attention (no process group needed)."""
    from engine.features.attention import attention_with_lse, merge_lse, sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, 3:] = False  # the second block of sample 1 is fully masked
    ref = sdpa(q, k, v, mask)
    out = lse = None
    for sl in (slice(0, 4), slice(4, 9)):
        bo, bl = attention_with_lse(q, k[:, sl], v[:, sl], mask[:, sl])
        out, lse = merge_lse(out, lse, bo, bl)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 1e-5
    # the fast path: torch's flash kernel (checked against the reference once), prefix lengths per block
    from engine.features.attention import block_attention, block_lens, lse_kernel

    kernel = lse_kernel(q.device, q.dtype, q.shape[-1])
    out = lse = None
    for sl in (slice(0, 4), slice(4, 9)):
        blk = block_lens(mask[:, sl])
        assert blk in ([4, 3], [2, 0])
        bo, bl = block_attention(q, k[:, sl], v[:, sl], blk, kernel)
        out, lse = merge_lse(out, lse, bo, bl)
    assert (out - ref).abs().max() < 1e-5
    assert block_lens(torch.ones(2, 5, dtype=torch.bool)) is None
    odd = torch.tensor([[True, False, True]])
    assert block_lens(odd) is odd  # not a prefix: the masked reference path


def test_comm_table_bench():
    """bench/speed/parallel_comm.py: hand-checked Ulysses-2 figure, the expected orderings, every mode tabled."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("parallel_comm", os.path.join(root, "bench", "speed", "parallel_comm.py"))
    pc = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["parallel_comm"] = pc  # dataclasses look their module up
    spec.loader.exec_module(pc)
    img, txt = 4096, 256
    local = 2 * (img + txt) / 2 * 4096 * 2  # one of q/k/v/out on a rank, bf16, batch 2
    expect = 36 * 4 * local / 2 + 2 * (img + txt) * 4096 * 2 / 2
    assert abs(pc.per_gpu_bytes(pc.Mode("u", ulysses=2), img, txt) - expect) < 1
    u8, r8, t8 = (pc.per_gpu_bytes(pc.Mode("", **{k: 8}), img, txt) for k in ("ulysses", "ring", "tp"))
    assert u8 < r8 < t8  # Ulysses sends least per GPU at 8, TP most
    text = pc.table()
    for name in ("Ulysses 8", "Ring 8", "USP 4x2", "TP 8", "CFG 2 x Ulysses 4", "2048²"):
        assert name in text
