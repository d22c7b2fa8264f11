"""`sgld serve --dp-size N` and `--ray` (issue 48): images per second of 1 and 2 replicas side by side, a replica's death.

    PYTHONPATH=$PWD .venv/bin/python bench/speed/replicas_bench.py [--ray] [--images 32] [--clients 8] [--steps 30]

One front per row (the demo model, one CPU thread per replica, `--max-batch 8`), warmed up, then ``--images``
requests (n=1, 64x64, seeds 0..) from ``--clients`` concurrent clients; images/s over the wall time, the rows measured
in the same run (the 1-replica row is `--dp-size 1`: the plain server; with ``--ray`` both rows are Ray Serve
applications on a Ray started on this machine, `sgld serve --ray --dp-size N`). Then, on the 2-replica front: the same load
again with replica 0 killed (SIGKILL) once both hold work: the requests answered (all, or the bench fails), those sent
again, and the seconds from the kill to the replacement answering /health."""
import argparse
import functools
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_process  # noqa: E402
from serve_process import stop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "a large red circle on the left, on a blue background"


def start(flags, log_path):
    """A front (or the plain server) of this checkout: one thread per replica, batches of 8."""
    return serve_process.start(ROOT, log_path, ["--threads", "1", "--max-batch", "8", *flags], address_space=0)


def one(url, seed, steps):
    r = requests.post(url + "/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "seed": seed,
                                                             "num_inference_steps": steps}, timeout=600)
    return r.status_code, r.headers.get("x-sgld-replica")


def load(url, images, clients, steps, during=None):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(one, url, seed, steps) for seed in range(images)]
        if during:
            during()
        answers = [f.result() for f in futures]
    return images / (time.perf_counter() - t0), answers


def kill(url, pid) -> None:
    """SIGKILL to replica ``pid`` once every replica holds work."""
    deadline = time.monotonic() + 60
    while not all(r["in_flight"] for r in requests.get(url + "/health", timeout=10).json()["replicas"]):
        if time.monotonic() > deadline:
            raise SystemExit("the load never reached both replicas")
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


def replaced(url, victim) -> bool:
    """Two replicas up again, none of them the killed process."""
    replicas = requests.get(url + "/health", timeout=10).json()["replicas"]
    return len(replicas) == 2 and all(r["status"] == "up" and r["pid"] != victim for r in replicas)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ray", action="store_true", help="the rows as Ray Serve applications (sgld serve --ray)")
    args = ap.parse_args()
    rows = {}
    for dp in (1, 2):
        proc, url = start(["--dp-size", str(dp), *(["--ray"] if args.ray else [])], f"/tmp/replicas-bench-{dp}.log")
        while args.ray and len(requests.get(url + "/health", timeout=10).json()["replicas"]) < dp:
            time.sleep(0.2)
        try:
            load(url, 4, 4, args.steps)  # warm up
            rows[dp], answers = load(url, args.images, args.clients, args.steps)
            assert all(status == 200 for status, _ in answers), answers
            if dp == 2:
                health = requests.get(url + "/health", timeout=10).json()
                victim = health["replicas"][0]["pid"]
                _, answers = load(url, args.images, args.clients, args.steps, during=functools.partial(kill, url, victim))
                while not replaced(url, victim):
                    time.sleep(0.1)
                health = requests.get(url + "/health", timeout=10).json()
                rows["kill"] = {"answered": sum(s == 200 for s, _ in answers), "sent": len(answers),
                                "resent": health["retried"], "replacement_s": health["last_replacement_s"]}
        finally:
            stop(proc)
    print(json.dumps({"images_per_s": {"1 replica": round(rows[1], 3), "2 replicas": round(rows[2], 3)},
                      "speedup": round(rows[2] / rows[1], 2), "kill": rows["kill"], "images": args.images,
                      "clients": args.clients, "steps": args.steps, "ray": args.ray}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
