"""Before/after figures for issue 33 items 3 and 4 (bench/RESULTS.md): a fresh `sgld serve` (demo model) of the
code at ROOT per attack, under an address-space limit and an RSS watchdog (so old code cannot take the machine
down); for each attack its peak RSS, the answer, and /health's worst latency while it runs.

Usage: python bench/speed/serve_attacks.py ROOT LABEL [ATTACK ...]   (ROOT: a checkout, e.g. `git archive` of an old
commit unpacked into a temporary folder, or `.` for this one; LABEL names the rows)"""
import json
import os
import sys
import tempfile
import threading
import time

import psutil
import requests
import serve_process  # bench/speed/, beside this script
import torch
from safetensors.torch import save

ROOT, LABEL = sys.argv[1], sys.argv[2]
AS_LIMIT = 10 << 30
RSS_KILL = int(6.5 * (1 << 30))
LOGS = tempfile.mkdtemp(prefix="sgld-serve-attacks-")  # private (0700): the servers' logs


def start():
    return serve_process.start(ROOT, os.path.join(LOGS, f"{LABEL}.log"), ("--max-body-bytes", str(4 << 20)), AS_LIMIT)


def body(latent, settings, **more):
    return save({"latent": latent, **more}, metadata={"sgld": json.dumps(settings)})


def attack(proc, url, name, data, seconds=40.0):
    ps = psutil.Process(proc.pid)
    base = ps.memory_info().rss
    peak, worst, stop, killed = [base], [0.0], threading.Event(), [False]

    def watch():
        while not stop.is_set():
            try:
                rss = ps.memory_info().rss
            except psutil.Error:
                return
            peak[0] = max(peak[0], rss)
            if rss > RSS_KILL:
                killed[0] = True
                proc.kill()
                return
            time.sleep(0.02)

    def health():
        while not stop.is_set():
            t = time.monotonic()
            try:
                requests.get(url + "/health", timeout=30)
            except requests.RequestException:
                return
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.05)
    threads = [threading.Thread(target=watch), threading.Thread(target=health)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/v1/sample", data=data, timeout=seconds, stream=True)
        status = r.status_code
        first = b""
        deadline = time.monotonic() + seconds
        for line in r.iter_lines():
            if line.strip():
                first = line
                if b'"latent"' in line or b'"error"' in line or time.monotonic() > deadline:
                    break
            if time.monotonic() > deadline:
                break
        r.close()
        answer = first[:160].decode(errors="replace")
    except requests.RequestException as e:
        status, answer = None, f"{type(e).__name__}"
    wall = time.monotonic() - t0
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    print(json.dumps({"label": LABEL, "attack": name, "status": status, "answer": answer, "wall_s": round(wall, 2),
                      "peak_rss_gb": round(peak[0] / 2 ** 30, 2), "rss_before_gb": round(base / 2 ** 30, 2),
                      "killed_by_watchdog": killed[0], "worst_health_s": round(worst[0], 3)}), flush=True)
    return not killed[0] and proc.poll() is None


def main():
    torch.manual_seed(0)
    attacks = [
        # issue 33 item 3: a 64-sample batch in a body of ~665 KB, CFG on, long text features
        ("batch64_665KB", body(torch.zeros(64, 48, 4, 4), {"seed": 0, "steps": 30, "cfg": 3.0},
                               cond=torch.randn(1000, 128) * 0.1, uncond=torch.zeros(1, 128))),
        # item 4: batch_index [4095] on one 64x64 latent (a 256x256 image): 4096 noise draws
        ("batch_index_4095", body(torch.zeros(1, 48, 64, 64), {"seed": 0, "steps": 1, "cfg": 1.0, "batch_index": [4095]},
                                  cond=torch.zeros(4, 128))),
        # item 4: the most batch_index allows by default (71: 72 draws) on a 128x128 latent: prepared off the loop?
        ("batch_index_71", body(torch.zeros(1, 48, 128, 128), {"seed": 0, "steps": 1, "cfg": 1.0, "batch_index": [71]},
                                cond=torch.zeros(4, 128))),
        # item 4: 200,000 one-pixel masks for one latent (the old code upscales all of them over 48 channels)
        ("masks_200000", body(torch.zeros(48, 16, 16), {"seed": 0, "steps": 1, "cfg": 1.0},
                              cond=torch.zeros(4, 128), noise_mask=torch.ones(200_000, 1, 1, 1))),
    ]
    for name, data in attacks:
        print(f"# {name}: body {len(data)} bytes", flush=True)
    only = sys.argv[3:] or [a[0] for a in attacks]
    for name, data in attacks:
        if name not in only:
            continue
        proc, url = start()
        try:
            attack(proc, url, name, data)
        finally:
            serve_process.stop(proc)


if __name__ == "__main__":
    main()
