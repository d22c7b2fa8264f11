"""Before/after figures for issue 44 items 3 and 8: a fresh `sgld serve` (demo model, fp32) of the code at ROOT
per figure, under an address-space limit and an RSS watchdog (so old code cannot take the machine down).

(a) queued_lora_memory: 8 requests sent at once, each naming 8 distinct per-request LoRAs (64 files, fp32,
    rank 112 on the 28 block linears: 11.7 MB each), --lora-cache-mb 16 (or $LORA_CACHE_MB: 32 holds one LoRA with
    its resident terms, 28.9 MiB, which the fixed server counts), --max-batch 1 (one runs, 7 queue). The server's
    RSS every 50 ms from before the requests (after a plain warm-up request) until all are answered: baseline,
    peak, growth (peak - baseline), after; the requests answered 200; the seconds in all.
(b) plain_behind_blocked: --max-loras-per-forward 1; A (1 LoRA, many steps) runs, B (another LoRA) waits for
    LoRA room, then C (no "loras": the server's set, no LoRA room needed; 2 steps): C's latency against A's run.

Each figure prints one JSON line and one markdown table row. The LoRA files (and the servers' logs) go to a
private temporary folder; the LoRA files are deleted at the end, the logs kept (their folder is printed).

Usage: python bench/speed/lora_cache_bench.py ROOT LABEL [FIGURE ...]   (ROOT: a checkout, e.g. `git archive` of an
old commit unpacked into a temporary folder, or `.` for this one; LABEL names the rows; FIGURE: a, b)"""
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests
import serve_process  # bench/speed/, beside this script
import torch
from safetensors.torch import save_file

ROOT, LABEL = os.path.abspath(sys.argv[1]), sys.argv[2]
AS_LIMIT = 10 << 30
RSS_KILL = 6 << 30
TMP = tempfile.mkdtemp(prefix="sgld-lora-cache-bench-")  # private (0700): the LoRA files and the servers' logs
LORA_DIR = os.path.join(TMP, "loras")
MIB = 1 << 20

# the demo DiT's block linears {name: (out, in)}: 4 blocks x 7; rank 112 in fp32 -> 104,448 bytes per rank = 11.7 MB
LAYERS = {f"layers.{i}.{name}": shape for i in range(4) for name, shape in (
    ("self_attention.to_q", (384, 384)), ("self_attention.to_k", (384, 384)), ("self_attention.to_v", (384, 384)),
    ("self_attention.to_out.0", (384, 384)), ("mlp.gate_proj", (768, 384)), ("mlp.up_proj", (768, 384)),
    ("mlp.linear_fc2", (384, 768)))}
RANK, N_FILES = 112, 64
A_REQUESTS, A_LORAS, A_STEPS = 8, 8, 40
A_CACHE_MB = int(os.environ.get("LORA_CACHE_MB", "16"))  # 32: one LoRA with its resident terms fits
B_LONG_STEPS, B_PLAIN_STEPS = 1000, 2  # the demo on a 2-core CPU: ~18 ms a step (64x64), ~33 ms with one of these LoRAs
TIMEOUT = 600.0


def lora_name(i: int) -> str:
    return f"lora_{i:02d}.safetensors"


def write_loras() -> int:
    """N_FILES distinct LoRAs in ComfyUI's key format (alpha 1: a small update); the bytes of one."""
    os.makedirs(LORA_DIR)
    for i in range(N_FILES):
        g = torch.Generator().manual_seed(1000 + i)
        sd = {}
        for name, (out_f, in_f) in LAYERS.items():
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(RANK, in_f, generator=g) * 0.1
            sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(out_f, RANK, generator=g) * 0.1
            sd[f"diffusion_model.{name}.alpha"] = torch.tensor(1.0)
        save_file(sd, os.path.join(LORA_DIR, lora_name(i)))
    return os.path.getsize(os.path.join(LORA_DIR, lora_name(0)))


def start(name: str, *flags):
    return serve_process.start(ROOT, os.path.join(TMP, f"{name}.log"), ("--dtype", "fp32", "--lora-dir", LORA_DIR,
                                                                         "--request-timeout", str(TIMEOUT), *flags),
                               AS_LIMIT)


stop = serve_process.stop


def generate(url: str, steps: int, seed: int, loras=None) -> dict:
    """POST /v1/images/generations; its status, seconds from send to answer, and when it was answered."""
    extra = {"loras": [{"name": n} for n in loras]} if loras is not None else {}
    body = {"model": "sgld-demo", "prompt": "a red fox in the snow", "size": "64x64", "response_format": "b64_json",
            "num_inference_steps": steps, "guidance_scale": 1.0, "seed": seed, **extra}
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/v1/images/generations", json=body, timeout=TIMEOUT)
        status = r.status_code
        info = {k: v for k, v in r.json().items() if k != "data"} if status != 200 else \
            {k: r.json().get(k) for k in ("inference_time_s", "samples_per_forward")}
    except (requests.RequestException, ValueError) as e:
        status, info = None, {"error": type(e).__name__}
    t1 = time.monotonic()
    return {"status": status, "seconds": t1 - t0, "sent": t0, "answered": t1, "info": info}


def metric(url: str, name: str) -> float:
    """A gauge or counter of /metrics (the sum over its labels); -1 when absent or unreadable."""
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return -1.0
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? ([-+0-9.eE]+|NaN)$", text, re.M)]
    return sum(values) if values else -1.0


def wait_metric(url: str, name: str, at_least: float, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metric(url, name) >= at_least:
            return True
        time.sleep(0.05)
    return False


class Watch:
    """The server's RSS every 50 ms (peak; the process killed past RSS_KILL) and, every 0.2 s, the deepest
    queue and the largest LoRA cache /metrics showed."""

    def __init__(self, proc, url: str):
        self.ps, self.proc, self.url = psutil.Process(proc.pid), proc, url
        self.base = self.peak = self.ps.memory_info().rss
        self.queue = self.cache = 0.0
        self.killed, self._stop = False, threading.Event()
        self._threads = [threading.Thread(target=self._rss), threading.Thread(target=self._metrics)]
        for t in self._threads:
            t.start()

    def _rss(self):
        while not self._stop.is_set():
            try:
                rss = self.ps.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            if rss > RSS_KILL:
                self.killed = True
                self.proc.kill()
                return
            time.sleep(0.05)

    def _metrics(self):
        while not self._stop.is_set():
            self.queue = max(self.queue, metric(self.url, "sgld_queue_depth"))
            self.cache = max(self.cache, metric(self.url, "sgld_lora_cache_bytes"))
            time.sleep(0.2)

    def close(self) -> int:
        """Stop watching; the RSS now."""
        self._stop.set()
        for t in self._threads:
            t.join()
        try:
            return self.ps.memory_info().rss
        except psutil.Error:
            return 0


def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def figure_a() -> None:
    flags = ("--lora-cache-mb", str(A_CACHE_MB), "--max-batch", "1", "--max-loras-per-forward", str(A_LORAS))
    proc, url = start("a", *flags)
    try:
        warm = generate(url, A_STEPS, seed=0)  # a plain run first: the forward's own buffers are in the baseline
        time.sleep(0.5)
        watch = Watch(proc, url)
        time.sleep(0.5)
        t0 = time.monotonic()
        sets = [[lora_name(r * A_LORAS + k) for k in range(A_LORAS)] for r in range(A_REQUESTS)]
        with ThreadPoolExecutor(A_REQUESTS) as pool:
            answers = list(pool.map(lambda r: generate(url, A_STEPS, seed=r + 1, loras=sets[r]), range(A_REQUESTS)))
        total = time.monotonic() - t0
        time.sleep(0.5)
        after = watch.close()
    finally:
        stop(proc)
    ok = sum(a["status"] == 200 for a in answers)
    errors = sorted({json.dumps(a["info"])[:200] for a in answers if a["status"] != 200})
    out = {"label": LABEL, "figure": "a_queued_lora_memory", "server": " ".join(flags), "warmup_status": warm["status"],
           "requests": A_REQUESTS, "ok": ok, "baseline_rss_mib": round(watch.base / MIB, 1),
           "peak_rss_mib": round(watch.peak / MIB, 1), "growth_mib": round((watch.peak - watch.base) / MIB, 1),
           "rss_after_mib": round(after / MIB, 1), "max_queue_depth": watch.queue,
           "max_lora_cache_mib": round(watch.cache / MIB, 1), "total_s": round(total, 2),
           "killed_by_watchdog": watch.killed, "errors": errors}
    print(json.dumps(out), flush=True)
    print(row(["code", "figure", "requests ok", "baseline RSS MiB", "peak RSS MiB", "growth MiB", "RSS after MiB",
               "max queue", "total s"]))
    print(row(["---"] * 9))
    print(row([LABEL, f"(a) {A_REQUESTS} x {A_LORAS} LoRAs, {A_CACHE_MB} MiB budget", f"{ok}/{A_REQUESTS}",
               out["baseline_rss_mib"], out["peak_rss_mib"], out["growth_mib"], out["rss_after_mib"], int(watch.queue),
               out["total_s"]]), flush=True)


def figure_b() -> None:
    flags = ("--lora-cache-mb", "64", "--max-loras-per-forward", "1")
    proc, url = start("b", *flags)
    try:
        generate(url, B_PLAIN_STEPS, seed=0)  # warm-up
        alone = generate(url, B_PLAIN_STEPS, seed=0)  # C's own time, alone
        results, threads = {}, []

        def send(key, steps, seed, loras):
            results[key] = generate(url, steps, seed, loras)
        for key, steps, seed, loras, ready in (("A", B_LONG_STEPS, 1, [lora_name(0)], "sgld_running_batch_size"),
                                               ("B", B_PLAIN_STEPS, 2, [lora_name(1)], "sgld_queue_depth")):
            threads.append(threading.Thread(target=send, args=(key, steps, seed, loras)))
            threads[-1].start()
            if not wait_metric(url, ready, 1):  # A running, then B queued behind it
                print(f"# warning: {key} not seen in {ready}", flush=True)
            time.sleep(0.2)
        a_running_when_c_sent = metric(url, "sgld_running_batch_size") >= 1
        send("C", B_PLAIN_STEPS, 3, None)
        for t in threads:
            t.join()
    finally:
        stop(proc)
    a, b, c = results["A"], results["B"], results["C"]
    out = {"label": LABEL, "figure": "b_plain_behind_blocked", "server": " ".join(flags),
           "status": {k: v["status"] for k, v in results.items()}, "c_latency_s": round(c["seconds"], 2),
           "c_alone_s": round(alone["seconds"], 2), "a_total_s": round(a["seconds"], 2),
           "b_latency_s": round(b["seconds"], 2), "a_running_when_c_sent": a_running_when_c_sent,
           "c_answered_before_a": c["answered"] < a["answered"], "a_steps": B_LONG_STEPS, "c_steps": B_PLAIN_STEPS}
    print(json.dumps(out), flush=True)
    print(row(["code", "figure", "C latency s", "C alone s", "A total s", "B latency s", "C before A"]))
    print(row(["---"] * 7))
    print(row([LABEL, f"(b) C ({B_PLAIN_STEPS} steps, no loras) behind blocked B; A {B_LONG_STEPS} steps",
               out["c_latency_s"], out["c_alone_s"], out["a_total_s"], out["b_latency_s"],
               "yes" if out["c_answered_before_a"] else "no"]), flush=True)


def main():
    only = sys.argv[3:] or ["a", "b"]
    try:
        size = write_loras()
        print(f"# {LABEL}: ROOT {ROOT}; {N_FILES} LoRA files of {size / 1e6:.2f} MB ({size / MIB:.2f} MiB; fp32, rank "
              f"{RANK}, {len(LAYERS)} block linears); logs in {TMP}", flush=True)
        for name, run in (("a", figure_a), ("b", figure_b)):
            if name in only:
                run()
    finally:
        shutil.rmtree(LORA_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
