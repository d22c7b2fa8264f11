"""A fresh `sgld serve` of the code at a checkout, for the before/after attack benchmarks (serve_attacks.py,
lora_cache_bench.py): started under an address-space limit (old code fails an allocation instead of taking the
shared machine), waited for until /health answers, stopped."""
import os
import resource
import socket
import subprocess
import sys
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: str, log_path: str, flags, address_space: int):
    """(process, base url) of `sgld serve` of ``root`` with ``flags``, its output in ``log_path`` (``address_space``
    bytes at most; 0: no limit)."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--log-level", "warning",
                             *flags], cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=log,
                            stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space)))
                            if address_space else None)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except (requests.ConnectionError, requests.Timeout):  # not listening yet, or (--ray) its front not up yet
            time.sleep(0.3)
    stop(proc)
    raise SystemExit(f"no server (log: {log_path})")


def stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
