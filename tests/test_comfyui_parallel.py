"""Parallel (num_gpus > 1) in a real ComfyUI server (0.3.75, tests/comfy_server.py): on this CPU
machine the ranks are 2 gloo worker processes, children of the server. The workers stop when their
model is released (the loader switched back to one GPU, POST /free), and the loader reports bad
parallel options as its own ValueError. One server for the module."""
from __future__ import annotations

import os
import time

import psutil
import torch

try:  # tests/ may or may not be a package
    from . import comfy_server as cs
except ImportError:
    import comfy_server as cs

TINY = "tiny-ernie.safetensors"
LOADER = "SGLDiffusionModelLoader"


# The module's ComfyUI server is tests/conftest.py's `comfy` fixture with the shared base folder (TINY); the
# workers a test leaves go with the next module's reset (POST /free) or the server's process group.


def graph(seed: int, **loader_options) -> dict:
    return cs.tiny_graph(TINY, seed=seed, loader_options=loader_options)


def run_ok(comfy, prompt) -> dict:
    entry = comfy.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", (entry["status"], comfy.log()[-3000:])
    return entry


def loaded(comfy) -> list:
    r = comfy.get("/sgldiffusion/models")
    assert r.status_code == 200
    return r.json()["loaded"]


def worker_pids(comfy) -> list:
    """The rank processes of the one cached engine; they are the server's children."""
    [model] = loaded(comfy)
    pids = model["worker_pids"]
    children = {p.pid for p in psutil.Process(comfy.proc.pid).children(recursive=True)}
    assert len(pids) == 2 and set(pids) <= children, (pids, children)
    return pids


def loader_error(entry: dict) -> str:
    """The loader's error as the ComfyUI user sees it: a plain ValueError that names the node."""
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = cs.error_message(entry)
    assert err is not None and err["kind"] == "execution_error", entry["status"]
    assert err["node_type"] == LOADER, err
    assert err["exception_type"] == "ValueError", err["exception_type"]
    msg = err["exception_message"]
    assert msg.startswith("SGLDiffusion Model Loader: "), msg
    assert "Traceback" not in msg and "\n" not in msg.strip(), msg
    return msg


def test_workers_stop_when_the_loader_goes_back_to_one_gpu(comfy):
    parallel = cs.saved_latent(comfy, run_ok(comfy, graph(1, num_gpus=2)))
    pids = worker_pids(comfy)
    single = cs.saved_latent(comfy, run_ok(comfy, graph(1, num_gpus=1)))  # same loader node, new inputs
    assert cs.pids_gone(pids), f"worker processes {pids} still run after the loader switched to num_gpus=1"
    assert [m["worker_pids"] for m in loaded(comfy)] == [[]]
    assert (parallel - single).abs().max() <= 1e-4 * single.abs().max()


def test_workers_stop_on_free_and_the_next_run_starts_them(comfy):
    run_ok(comfy, graph(2, num_gpus=2))
    pids = worker_pids(comfy)
    assert comfy.post("/free", {"unload_models": True, "free_memory": True}).status_code == 200
    assert cs.pids_gone(pids), f"worker processes {pids} still run after POST /free"
    deadline = time.monotonic() + 15
    while loaded(comfy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loaded(comfy) == []
    run_ok(comfy, graph(3, num_gpus=2))
    new = worker_pids(comfy)
    assert not set(new) & set(pids)


def test_bad_parallel_options_are_the_loaders_value_errors(comfy):
    from engine.parallel.plan import cpu_rank_limit

    msg = loader_error(comfy.run(graph(4, num_gpus=3, ulysses_degree=2), timeout=120))
    assert "do not multiply to num_gpus" in msg and "num_gpus = 3" in msg
    msg = loader_error(comfy.run(graph(5, num_gpus=8), timeout=120))
    if cpu_rank_limit() < 8:  # the server runs on the CPU (--cpu): the ranks would be gloo processes
        assert "num_gpus = 8" in msg and "on the CPU the ranks run as gloo processes, at most" in msg, msg
        if not torch.cuda.is_available():
            assert "this machine has no CUDA GPU" in msg, msg
    else:  # enough cores for 8 gloo ranks: the tiny model's 4 heads refuse ulysses 8
        assert "ulysses_degree = 8 does not divide" in msg, msg
    assert comfy.alive()
    run_ok(comfy, graph(6))  # the server keeps serving


def test_worker_killed_mid_run_is_the_ksamplers_value_error_and_the_next_run_works(comfy):
    """A rank dies while SGLDiffusion KSampler samples: the node fails with a plain ValueError naming the
    node and the dead rank (not a path-mangled engine exception type), and the next run restarts the pool."""
    import signal

    run_ok(comfy, graph(7, num_gpus=2))  # workers up, weights loaded
    pids = worker_pids(comfy)
    prompt = cs.tiny_graph(TINY, seed=8, steps=400, loader_options={"num_gpus": 2})
    ws = comfy.websocket()
    try:
        prompt_id = comfy.queue(prompt)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the KSampler reports progress: the ranks are computing
            msg = ws.recv()
            if isinstance(msg, str) and '"progress"' in msg and prompt_id in msg:
                break
        os.kill(pids[1], signal.SIGKILL)
        entry = comfy.wait(prompt_id, timeout=120)
    finally:
        ws.close()
    err = cs.error_message(entry)
    assert err is not None and err["node_type"] == "SGLDiffusionKSampler", entry["status"]
    assert err["exception_type"] == "ValueError", err["exception_type"]
    assert err["exception_message"].startswith("SGLDiffusion KSampler: parallel run failed"), err["exception_message"]
    assert f"worker rank 1 (pid {pids[1]})" in err["exception_message"], err["exception_message"]
    run_ok(comfy, graph(9, num_gpus=2))
