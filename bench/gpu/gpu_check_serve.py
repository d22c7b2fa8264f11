"""The GPU check's rows after the headline ones (bench/gpu/gpu_check.py): LoRA apply / switch on the 8B model,
the real HTTP server under concurrent clients, the ComfyUI MODEL path, and placeholders for formats not
built yet.

serve: ``sgld serve --sample-only`` (the DiT alone: a random checkpoint has no text encoder or VAE) on the check's
checkpoint, in a process of its own; the clients use ``POST /v1/sample`` (latent and text features in, latent out:
every request is a whole Turbo run on the batcher, the DiT work of an image request without encoding and decoding).
Clients are threads with raw HTTP (``requests``); the sequential baseline is the same requests one after another.
serve-dp: the same server with ``--dp-size N``, one replica per GPU, N x 8 clients, beside serve's 8 clients."""
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.speed.lora_bench import RANK, lora_state_dict  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402

SERVE_NEEDS = ("fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "opentelemetry", "prometheus_client",
               "requests")
CLIENTS = (1, 4, 8)
REQUESTS = 8  # per scenario: 8 clients send one each
LORA_RANK = 16  # the per-request scenario: each of the 8 clients names its own LoRA of this rank


# -- LoRA ----------------------------------------------------------------------------------------------------------
def row_lora(ctx):
    """Rank-32 LoRAs on every linear (bench/speed/lora_bench.py's), read from files: apply, strength, switch, remove."""
    m = ctx.model()
    eng = Engine(m, EngineConfig(device=str(ctx.dev), attention="sdpa"))
    folder = tempfile.mkdtemp(prefix="gpu_check_lora_")  # 0700, ours
    paths = []
    for seed in (1, 2):
        p = os.path.join(folder, f"lora{seed}.safetensors")
        save_file(lora_state_dict(m, RANK, seed), p)
        paths.append(p)
    mib = os.path.getsize(paths[0]) / 2 ** 20
    times = {}
    start = ctx.start_window()
    for label, spec in (("apply", [(paths[0], 1.0)]), ("strength", [(paths[0], 0.5)]), ("switch", [(paths[1], 1.0)]),
                        ("remove", [])):
        s = time.perf_counter()
        eng.set_loras(spec)
        ctx.sync()
        times[label] = time.perf_counter() - s
    for p in paths:
        os.remove(p)
    os.rmdir(folder)
    ctx.report.row("lora", "measured", f"LoRA rank {RANK} on every linear ({mib:.0f} MiB file), Engine.set_loras", None, None,
                   ctx.peak(), start, "; ".join(f"{k} {v:.2f} s" for k, v in times.items())
                   + " (apply and switch include reading the file)", check=True, **{f"{k}_s": round(v, 3) for k, v in times.items()})


# -- serve ---------------------------------------------------------------------------------------------------------
def serve_estimate(ctx) -> float:
    f = ctx.forward_estimate
    startup = 8 + ctx.model_bytes() / (2e9 if ctx.dev.type == "cuda" else 1e12)
    return ctx.checkpoint_estimate("serve") + startup + 10 + 1.2 * 8 * f() * (1 + REQUESTS * (len(CLIENTS) + 1))


def missing_for_serve():
    return [m for m in SERVE_NEEDS if importlib.util.find_spec(m) is None]


def request_body(ctx, seed: int, lora: str = "") -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {"latent": torch.zeros(ctx.cfg.in_channels, ctx.args.height // 16, ctx.args.width // 16),
               "cond": torch.randn(ctx.args.text_tokens, ctx.cfg.text_in_dim, generator=g)}
    settings = {"seed": seed, "steps": 8, "cfg": 1.0, "cache": "off"}
    if lora:
        settings["loras"] = [{"name": lora, "strength": 0.8}]
    return save(tensors, metadata={"sgld": json.dumps(settings)})


def post_sample(url: str, body: bytes) -> float:
    """One /v1/sample request, its answer read to the last line; its latency (an error raises)."""
    import requests

    s = time.perf_counter()
    with requests.post(url + "/v1/sample", data=body, stream=True, timeout=600,
                       headers={"Content-Type": "application/octet-stream"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/sample answered {r.status_code}: {r.text[:200]}")
        last = None
        for line in r.iter_lines():
            if line.strip():
                last = json.loads(line)
    if not last or "latent" not in last:
        raise RuntimeError(f"/v1/sample ended without a latent: {str(last)[:200]}")
    return time.perf_counter() - s


def row_serve(ctx):
    missing = missing_for_serve()
    if missing:
        ctx.report.row("serve", "n/a", "the HTTP server", notes=f"missing on this machine: {', '.join(missing)} (carry them "
                       "as wheels: bash scripts/gpu_wheels.sh puts fastapi, starlette, pydantic, uvicorn in .whl/)")
        return
    path = ctx.checkpoint()
    loras = tempfile.mkdtemp(prefix="gpu_check_serve_loras_")  # 0700, ours
    model = ctx.model()
    for i in range(REQUESTS):
        save_file(lora_state_dict(model, LORA_RANK, 100 + i), os.path.join(loras, f"client{i}.safetensors"))
    del model
    ctx.release()  # the GPU to the server process
    proc = _start(ctx, path, "--lora-dir", loras)
    try:
        url = _wait_ready(proc, timeout=max(30.0, ctx.left()))
        bodies = [request_body(ctx, i) for i in range(REQUESTS)]
        post_sample(url, bodies[0])  # warm-up: the first forward's allocations and kernels
        results = {}
        for clients in CLIENTS:
            wall, lat = _timed(url, bodies, clients)
            results[clients] = (wall, lat)
            p = sorted(lat)
            seq = results[CLIENTS[0]][0]
            ctx.report.row("serve", "measured", f"POST /v1/sample, Turbo {ctx.args.width}x{ctx.args.height}, 8 steps, bf16: "
                           f"{REQUESTS} requests from {clients} client(s)" + (" (one after another)" if clients == 1 else ""),
                           None, wall / REQUESTS, None, None,
                           f"{REQUESTS / wall:.2f} images/s (**{seq / wall:.2f}x of one after another**); latency p50 "
                           f"{statistics.median(p):.2f} s, p95 {p[min(len(p) - 1, int(0.95 * len(p)))]:.2f} s; "
                           f"server: sgld serve --sample-only --max-batch {max(CLIENTS)}",
                           images_per_s=round(REQUESTS / wall, 3), clients=clients)
        # per-request LoRAs: the same 8 clients, each naming its own LoRA; one batched forward carries them all
        bodies = [request_body(ctx, i, f"client{i}.safetensors") for i in range(REQUESTS)]
        post_sample(url, bodies[0])  # warm-up: reads the first file
        wall, _ = _timed(url, bodies, REQUESTS)
        plain = results[max(CLIENTS)][0]
        ctx.report.row("serve", "measured", f"POST /v1/sample as above, {REQUESTS} clients each with its own rank-{LORA_RANK} "
                       "LoRA (per-request `loras`)", None, wall / REQUESTS, None, None,
                       f"{REQUESTS / wall:.2f} images/s (**{plain / wall:.2f}x of the same clients without LoRA**; "
                       "the files are read in the run)", images_per_s=round(REQUESTS / wall, 3), clients=REQUESTS,
                       loras=REQUESTS)
    finally:
        _stop(proc)
        shutil.rmtree(loras, ignore_errors=True)


# -- serve-dp: replicas on several GPUs ----------------------------------------------------------------------------
def replicas_here(ctx) -> int:
    """One replica per GPU (two CPU replicas of one thread each in the rehearsal)."""
    return torch.cuda.device_count() if ctx.dev.type == "cuda" else 2


def serve_dp_estimate(ctx) -> float:
    if replicas_here(ctx) < 2:
        return 0.0
    startup = 8 + ctx.model_bytes() / (2e9 if ctx.dev.type == "cuda" else 1e12)  # the replicas load side by side
    return ctx.checkpoint_estimate("serve") + startup + 10 + 1.2 * 8 * ctx.forward_estimate(REQUESTS) * 2


def row_serve_dp(ctx):
    """`sgld serve --dp-size N` (N replicas, one per GPU): N x 8 clients against the serve row's 8 on one server."""
    count = replicas_here(ctx)
    what = f"sgld serve --dp-size {count}: {count} replicas, {REQUESTS} clients each"
    if count < 2:
        ctx.report.row("serve-dp", "n/a", what, notes=f"{count} GPU on this machine: replicas need a lend of 2 or more")
        return
    missing = missing_for_serve()
    if missing:
        ctx.report.row("serve-dp", "n/a", what, notes=f"missing on this machine: {', '.join(missing)}")
        return
    path = ctx.checkpoint()
    ctx.release()
    proc = _start(ctx, path, "--dp-size", str(count))
    try:
        url = _wait_ready(proc, timeout=max(30.0, ctx.left()))
        bodies = [request_body(ctx, i) for i in range(REQUESTS * count)]
        _timed(url, bodies[:count], count)  # warm-up: each replica's first forward (least busy first: one each)
        wall, lat = _timed(url, bodies, len(bodies))
        one = [r for r in ctx.report.rows_named("serve") if r.get("clients") == max(CLIENTS) and not r.get("loras")]
        rate = len(bodies) / wall
        beside_one = (f"**{rate / one[0]['images_per_s']:.2f}x of one server** with {max(CLIENTS)} clients (the serve row)"
                      if one else "the serve row did not run in this check: no single-server figure beside it")
        ctx.report.row("serve-dp", "measured", f"{what}: {len(bodies)} POST /v1/sample, Turbo {ctx.args.width}x"
                       f"{ctx.args.height}, 8 steps", None, wall / len(bodies), None, None,
                       f"{rate:.2f} images/s, {beside_one}; latency p50 {statistics.median(lat):.2f} s",
                       images_per_s=round(rate, 3), replicas=count, clients=len(bodies))
    finally:
        _stop(proc)


def _start(ctx, path, *flags):
    """`sgld serve --sample-only` on the check's checkpoint, on a free port of 127.0.0.1 (its start line names it)."""
    cmd = [sys.executable, "-u", "-m", "engine.cli", "serve", "--sample-only", "--model", path, "--device",
           str(ctx.dev.type), "--dtype", "bf16", "--attention", "sdpa", "--max-batch", str(max(CLIENTS)),
           "--max-body-bytes", str(256 << 20), "--host", "127.0.0.1", "--port", "0", *flags]
    if ctx.dev.type == "cpu":
        cmd += ["--threads", "1"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)


def _timed(url, bodies, clients):
    """(seconds for all ``bodies`` from ``clients`` threads, each request's latency)."""
    s = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        lat = list(pool.map(lambda b: post_sample(url, b), bodies))
    return time.perf_counter() - s, lat


def _wait_ready(proc, timeout):
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server exited before it listened: {' / '.join(lines[-3:])[:300]}")
        lines.append(line.strip())
        found = re.search(r"^sgld serve: .* on (http://[0-9.]+:[0-9]+)/v1", line)
        if found:
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # a full pipe would block the server
            _wait_health(found.group(1), deadline)
            return found.group(1)
    raise RuntimeError("the server did not listen in time")


def _drain(proc):
    for line in proc.stdout:
        print(f"  [serve] {line.rstrip()}", flush=True)


def _wait_health(url, deadline):
    import requests

    while time.time() < deadline:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health did not answer in time")


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# -- ComfyUI (not carried) -------------------------------------------------------------------------------------------
def row_comfy(ctx):
    ctx.report.row("comfy", "n/a", "ComfyUI KSampler on comfy_model vs SGLDiffusion KSampler, per-step overhead",
                   notes="ComfyUI is not carried: ComfyUI 0.3.75 (33 MB) with its frontend package (48 MB) is more than the "
                         "64 MiB that travels with a call, and its requirements are not on the GPU machine; the CPU figures "
                         "are bench/speed/comfy_model_bench.py's (bench/RESULTS.md)")


