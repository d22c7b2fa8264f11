"""Serving benchmark (issue 21, item 6): a real `sgld serve` process (demo model) on 127.0.0.1, 32 requests
from 1, 4, 8 and 16 concurrent `openai` SDK clients, with Cache-DiT off and `balanced`.

Per scenario: images/s (32 / wall time from the first request to the last answer), p50/p95 latency of a
request, and the mean batch size (samples per DiT forward, cond and uncond rows together) and images per
forward from the server's GET /metrics read before and after. The 1-client scenario is the sequential
baseline (the same 32 requests one after another), measured in the same run. Prints one JSON line and a
markdown table; writes a plot (throughput and p95 latency vs clients, cache off / on).

Per-request LoRAs (issue 37, ``--loras none same different``): one server with a --lora-dir of 8 LoRAs (rank 16
on every block linear of the demo DiT); each mode runs the same requests with no ``loras``, all with the same
LoRA, or request i with LoRA i % 8, so 8 clients carry 8 different LoRAs in one forward.

    PYTHONPATH=$PWD .venv/bin/python bench/speed/serve_bench.py --plot bench/speed/serve_bench.png
    PYTHONPATH=$PWD .venv/bin/python bench/speed/serve_bench.py --loras none same different --clients 8 --requests 16
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.demo.data import COLOURS, SHAPES, SIZES, WHERE  # noqa: E402

MODEL = "sgld-demo"
LORA_MODES = ("none", "same", "different")
LORA_FILES = 8
BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")


def write_loras(folder: str, rank: int = 16) -> None:
    """LORA_FILES LoRAs (ComfyUI's keys) of ``rank`` on every block linear of the demo DiT, in ``folder``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.models.demo import DEMO_WEIGHTS

    with safe_open(DEMO_WEIGHTS, "pt") as f:
        shapes = {k[len("diffusion_model."):-len(".weight")]: f.get_slice(k).get_shape() for k in f.keys()
                  if k.startswith("diffusion_model.layers.") and k.endswith(tuple(n + ".weight" for n in BLOCK_LINEARS))}
    for i in range(LORA_FILES):
        g = torch.Generator().manual_seed(i)
        sd = {}
        for name, (out_f, in_f) in shapes.items():
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.05
            sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.05
        save_file(sd, os.path.join(folder, f"lora{i}.safetensors"))


def lora_choice(mode: str):
    """Request i's ``loras`` in ``mode`` (None: the field left out)."""
    if mode == "same":
        return lambda i: [{"name": "lora0.safetensors"}]
    if mode == "different":
        return lambda i: [{"name": f"lora{i % LORA_FILES}.safetensors"}]
    return lambda i: None


def prompts(count: int) -> list:
    """``count`` different captions of the demo grammar (one object; the background another colour)."""
    out = []
    for size, colour, shape, where, bg in itertools.product(SIZES, COLOURS, SHAPES, WHERE, COLOURS):
        if bg != colour:
            out.append(f"a {size} {colour} {shape} {WHERE[where]}, on a {bg} background")
    step = len(out) // count  # spread over the grammar, not the first colours only
    return out[::step][:count]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `sgld serve` process (default options but the given flags) on a free port of 127.0.0.1."""

    def __init__(self, flags: list):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="serve_bench_")
        env = {**os.environ, "PYTHONPATH": ROOT}
        env.pop("SGLANG_CACHE_DIT_ENABLED", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *flags], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"sgld serve exited with {self.proc.returncode}:\n{self.log.read()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"sgld serve did not answer /health in {timeout} s")

    def counters(self) -> dict:
        """forwards, samples (rows through the DiT) and model calls so far, from GET /metrics."""
        values = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        forwards = values["sgld_forwards_total"]
        return {"forwards": forwards, "samples": values["sgld_samples_per_forward"] * forwards,
                "calls": values["sgld_model_calls_total"], "computed": values["sgld_model_calls_computed_total"]}

    def gauge(self, name: str) -> float:
        """One unlabelled value of GET /metrics (0 when absent)."""
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def percentile(values: list, q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def scenario(server: Server, clients: int, texts: list, seed0: int, cache: str, loras: str = "none") -> dict:
    """``len(texts)`` requests from ``clients`` concurrent clients (each takes the next request when its
    last one is answered), their ``loras`` as ``loras`` (a LORA_MODES) says; the figures of the run."""
    lora_of = lora_choice(loras)
    todo = iter(enumerate(texts))
    lock = threading.Lock()
    latencies = []

    def client_loop():
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            i, text = job
            t0 = time.perf_counter()
            extra = {"seed": seed0 + i, "cache": cache}
            if lora_of(i) is not None:
                extra["loras"] = lora_of(i)
            answer = client.images.generate(model=MODEL, prompt=text, n=1, size="64x64", response_format="b64_json",
                                            extra_body=extra)
            seconds = time.perf_counter() - t0
            assert len(answer.data) == 1 and answer.data[0].b64_json, "an answer without its image"
            with lock:
                latencies.append(seconds)

    before = server.counters()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client_loop) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    after = server.counters()
    d = {k: after[k] - before[k] for k in after}
    return {"cache": cache, "loras": loras, "clients": clients, "requests": len(texts), "wall_s": round(wall, 2),
            "images_per_s": round(len(texts) / wall, 3), "p50_s": round(percentile(latencies, 0.5), 2),
            "p95_s": round(percentile(latencies, 0.95), 2),
            "samples_per_forward": round(d["samples"] / d["forwards"], 2) if d["forwards"] else 0.0,
            "images_per_forward": round(d["calls"] / d["forwards"], 2) if d["forwards"] else 0.0,
            "computed_fraction": round(d["computed"] / d["calls"], 3) if d["calls"] else 0.0,
            "server_rss_mib": round(psutil.Process(server.proc.pid).memory_info().rss / 2 ** 20, 1),
            "lora_cache_mib": round(server.gauge("sgld_lora_cache_bytes") / 2 ** 20, 2)}


def table(rows: list) -> str:
    lines = ["| server | cache | loras | clients | images/s | × sequential | p50 s | p95 s | samples/forward | "
             "images/forward | DiT calls computed | server RSS MiB | LoRA cache MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['cache']} | {r['loras']} | "
                     f"{r['clients']}{' (sequential)' if r['clients'] == 1 else ''} | "
                     f"{r['images_per_s']:.3f} | **{r['speedup']:.2f}** | {r['p50_s']:.2f} | {r['p95_s']:.2f} | "
                     f"{r['samples_per_forward']:.2f} | {r['images_per_forward']:.2f} | "
                     f"{100 * r['computed_fraction']:.0f}% | {r['server_rss_mib']:.0f} | {r['lora_cache_mib']:.2f} |")
    return "\n".join(lines)


def plot(rows: list, path: str, max_batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(10, 4))
    for (server, cache, loras), group in itertools.groupby(rows, key=lambda r: (r["server"], r["cache"], r["loras"])):
        group = list(group)
        x = [r["clients"] for r in group]
        label = f"{server}, cache {cache}" + (f", loras {loras}" if loras != "none" else "")
        ax_t.plot(x, [r["images_per_s"] for r in group], marker="o", label=label)
        ax_p.plot(x, [r["p95_s"] for r in group], marker="o", label=label)
    for ax, title in ((ax_t, "throughput (images/s)"), (ax_p, "p95 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["clients"] for r in rows[:len({r['clients'] for r in rows})]])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients (32 requests)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"sgld serve --max-batch {max_batch}, demo model 64x64, 30 steps (shared {os.cpu_count()}-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--caches", nargs="+", default=["off", "balanced"])
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[0],
                   help="one server per value (sgld serve --threads; 0: torch's choice)")
    p.add_argument("--plot", default=None, help="PNG path for the plot")
    p.add_argument("--loras", nargs="+", choices=LORA_MODES, default=["none"],
                   help="per-request LoRA modes, each run at every client count (none: the field left out; same: "
                        "one LoRA for all; different: request i LoRA i %% 8)")
    args = p.parse_args()

    texts = prompts(args.requests)
    rows = []
    lora_dir = tempfile.mkdtemp(prefix="serve_bench_loras_")
    write_loras(lora_dir)
    for threads in args.threads:
        name = f"--threads {threads}" if threads else "default threads"
        server = Server(["--max-batch", str(args.max_batch), "--threads", str(threads), "--lora-dir", lora_dir])
        try:
            server.wait_ready()
            for cache, loras in itertools.product(args.caches, args.loras):  # warm-up: one alone, then a batch
                scenario(server, 1, texts[:1], 10_000, cache, loras)
                scenario(server, 4, texts[:4], 10_000, cache, loras)
            for cache, loras in itertools.product(args.caches, args.loras):
                base = None
                for clients in args.clients:
                    r = {"server": name, **scenario(server, clients, texts, 0, cache, loras)}
                    base = base or r["images_per_s"]
                    r["speedup"] = round(r["images_per_s"] / base, 2)
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
        finally:
            server.stop()
    shutil.rmtree(lora_dir, ignore_errors=True)
    print(json.dumps({"bench": "serve", "max_batch": args.max_batch, "nproc": os.cpu_count(), "rows": rows}))
    print(table(rows))
    if args.plot:
        plot(rows, args.plot, args.max_batch)


if __name__ == "__main__":
    main()
