"""`sgld serve --dp-size N`: N replicas of the server behind one front, on one machine.

A replica is a whole `sgld serve` process on a private port of 127.0.0.1 (its own engine, queue, step-level
batcher, text encoder and VAE; on GPUs its own devices, ``CUDA_VISIBLE_DEVICES``): the server's code stays one, the
front only routes. The front answers the same API:

* a generation goes to the replica with the fewest images in flight; one naming LoRAs preferably to a replica that
  has served them (``AFFINITY_SLACK`` images of extra load at most), so their files stay read and resident there;
* ``/v1/set_lora`` and ``/v1/unset_lora`` reach every replica (and are replayed on a replacement); ``/metrics`` sums
  the replicas' samples and adds the front's own;
* a replica that dies (its process killed) loses no accepted request: the front fixes a request's seed before
  sending it, so a request whose replica died before answering is sent once more, to a live replica, and gives the
  same picture; with no live replica left it is a 503 with ``Retry-After``. A `/v1/sample` stream that loses its
  replica after it began ends with a last 503 line. The dead replica is started again (``/health`` says which are
  up, and how long the last replacement took).

Plain ``http.client`` calls in a thread pool reach the replicas (no client library more than the server's own).
"""
from __future__ import annotations

import asyncio
import ctypes
import http.client
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

from ..parallel.pool import free_port

log = logging.getLogger("sgld.serve")

AFFINITY_SLACK = 4  # images more in flight than the least busy replica that a LoRA's own replica may have
READY_TIMEOUT_S = 600.0  # a replica's start: load the model, answer /health
WATCH_S = 0.2  # how often the front looks at its replicas' processes
# the headers a replica's answer keeps through the front
PASSED_HEADERS = ("content-type", "retry-after")
PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


REPLICA_OF = "SGLD_REPLICA_OF"  # a replica's environment: the front's pid


def end_with_front() -> None:
    """In a replica (``REPLICA_OF`` set), Linux: SIGTERM when the front's process ends, even killed, so no replica
    outlives it (and none starts after it is gone)."""
    front = os.environ.get(REPLICA_OF)
    if not front:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if str(os.getppid()) != front:  # it ended before the line above
        os.kill(os.getpid(), signal.SIGTERM)


class ReplicaGone(Exception):
    """The replica's connection failed before its answer began: the request was not answered there."""


@dataclass
class Replica:
    """One `sgld serve` process: its port, its process and what the front knows of its load."""

    index: int
    port: int
    env: Dict[str, str]
    log_path: str
    proc: Optional[subprocess.Popen] = None
    state: str = "starting"  # starting, up, down
    in_flight: int = 0  # images of requests sent and not answered
    loras: set = field(default_factory=set)  # the LoRA names of the requests it answered
    served: int = 0  # requests answered
    restarts: int = 0
    last_pick: float = 0.0

    def describe(self) -> dict:
        return {"index": self.index, "status": self.state, "pid": self.proc.pid if self.proc else None,
                "in_flight": self.in_flight, "served": self.served, "restarts": self.restarts,
                "loras": sorted(self.loras)}


class Replicas:
    """The replica processes: started, watched, replaced; requests forwarded to them."""

    def __init__(self, argv: Sequence[str], count: int, envs: Sequence[Dict[str, str]], timeout: float,
                 max_connections: int):
        self.argv, self.timeout = list(argv), timeout
        self.folder = tempfile.mkdtemp(prefix="sgld-replicas-")  # 0700: the replicas' logs
        self.replicas = [Replica(i, free_port(), dict(envs[i]), os.path.join(self.folder, f"replica-{i}.log"))
                         for i in range(count)]
        self.pool = ThreadPoolExecutor(max_workers=max_connections + 2 * count, thread_name_prefix="sgld-front")
        self.lock = threading.Lock()
        self.lora_changes: List[Tuple[str, bytes]] = []  # (path, body) of every LoRA change applied, in order
        self.retried = 0
        self.replacement_seconds: List[float] = []
        self.closing = False
        self._watcher: Optional[threading.Thread] = None

    # -- processes ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Every replica started and ready; ValueError naming the replica and its log's end otherwise."""
        for r in self.replicas:
            self._spawn(r)
        for r in self.replicas:
            if not self._ready(r, READY_TIMEOUT_S):
                last = (_tail(r.log_path).strip().splitlines() or ["(no output)"])[-1]
                self.close()
                raise ValueError(f"--dp-size: replica {r.index} did not start ({r.log_path}): {last}")
        self._watcher = threading.Thread(target=self._watch, name="sgld-replicas", daemon=True)
        self._watcher.start()

    def _spawn(self, r: Replica) -> None:
        r.state = "starting"
        with open(r.log_path, "ab") as out:
            env = {**os.environ, **r.env, REPLICA_OF: str(os.getpid())}
            r.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *self.argv, "--host", "127.0.0.1",
                                       "--port", str(r.port)], cwd=PACK_ROOT, env=env,
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _ready(self, r: Replica, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.closing:
            if r.proc.poll() is not None:
                return False
            try:
                status, _, _ = self.call(r, "GET", "/health", timeout=2.0)
                if status == 200:
                    r.state = "up"
                    return True
            except (ReplicaGone, OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        return False

    def _watch(self) -> None:
        """A replica whose process ended is marked down and started again; the LoRA changes made since the front
        started are replayed on it before it takes requests."""
        while not self.closing:
            for r in self.replicas:
                if r.proc is not None and r.proc.poll() is not None and not self.closing:
                    died = time.monotonic()
                    r.state = "down"
                    log.warning("replica %d (pid %d) exited with %s: starting it again", r.index, r.proc.pid,
                                r.proc.returncode)
                    r.restarts += 1
                    self._spawn(r)
                    if self._ready(r, READY_TIMEOUT_S) and self._replay(r):
                        self.replacement_seconds.append(time.monotonic() - died)
                        log.warning("replica %d replaced in %.1f s", r.index, self.replacement_seconds[-1])
                    else:
                        r.state = "down"
                        _stop(r.proc)  # the next look starts it again
            time.sleep(WATCH_S)

    def _replay(self, r: Replica) -> bool:
        r.state = "starting"
        for path, body in list(self.lora_changes):
            try:
                status, _, data = self.call(r, "POST", path, body)
            except (ReplicaGone, OSError, http.client.HTTPException):
                return False
            if status != 200:
                log.warning("replica %d refused the replayed %s: %s", r.index, path, data[:300])
                return False
        r.loras.clear()
        r.state = "up"
        return True

    def record_change(self, path: str, body: bytes) -> None:
        """A LoRA change every replica made, kept for a replacement to replay; switching every LoRA off (an unset
        with no names) makes the changes before it moot."""
        if clears_all(path, body):
            self.lora_changes.clear()
        self.lora_changes.append((path, body))

    def close(self) -> None:
        """Stop every replica (SIGTERM: each drains as a single server does), then the threads."""
        self.closing = True
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            if r.proc is not None:
                _stop(r.proc, grace=60.0)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- routing -------------------------------------------------------------------------------------------------
    def pick(self, images: int, loras: frozenset, tried: Sequence[int] = ()) -> Optional[Replica]:
        """The replica for a request of ``images`` naming ``loras`` (its load counted until ``done``), or None."""
        with self.lock:
            live = [r for r in self.replicas if r.state == "up" and r.index not in tried]
            if not live:
                return None
            least = min(r.in_flight for r in live)
            own = [r for r in live if loras and loras <= r.loras and r.in_flight <= least + AFFINITY_SLACK]
            choice = min(own or live, key=lambda r: (r.in_flight, r.last_pick))
            choice.in_flight += images
            choice.last_pick = time.monotonic()
            return choice

    def done(self, r: Replica, images: int, loras: frozenset, answered: bool) -> None:
        with self.lock:
            r.in_flight -= images
            if answered:
                r.served += 1
                r.loras |= loras

    def call(self, r: Replica, method: str, path: str, body: Optional[bytes] = None, headers=None,
             timeout: Optional[float] = None) -> Tuple[int, Dict[str, str], bytes]:
        """One request to replica ``r``: (status, passed headers, body). ReplicaGone if its connection failed before
        an answer began (refused, reset, closed: the replica is gone or going)."""
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=timeout or self.timeout)
        try:
            try:
                conn.request(method, path, body=body, headers=dict(headers or {}))
                resp = conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine) as e:
                raise ReplicaGone(f"replica {r.index}: {type(e).__name__}: {e}") from None
            data = resp.read()
            return resp.status, {k: v for k, v in resp.getheaders() if k.lower() in PASSED_HEADERS}, data
        finally:
            conn.close()

    def stream(self, r: Replica, path: str, body: bytes, headers, lines: "asyncio.Queue", loop) -> None:
        """A streamed answer's lines into ``lines`` (then None); ReplicaGone before its first byte."""
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=self.timeout)
        started = False
        try:
            try:
                conn.request("POST", path, body=body, headers=dict(headers))
                resp = conn.getresponse()
                started = True
                loop.call_soon_threadsafe(lines.put_nowait, ("start", resp.status,
                                                             resp.getheader("content-type", "application/x-ndjson")))
                if resp.status != 200:  # a refusal: one JSON body, relayed as it is
                    loop.call_soon_threadsafe(lines.put_nowait, ("line", resp.read()))
                    return
                last = b""
                for line in resp:
                    if not line.endswith(b"\n"):  # cut in the middle: not relayed
                        break
                    loop.call_soon_threadsafe(lines.put_nowait, ("line", line))
                    last = line if line.strip() else last
                if not _final(last):  # the connection ended before the result's line
                    loop.call_soon_threadsafe(lines.put_nowait, ("cut", "the stream ended early"))
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                if not started:
                    raise ReplicaGone(f"replica {r.index}: {type(e).__name__}: {e}") from None
                loop.call_soon_threadsafe(lines.put_nowait, ("cut", str(e)))
        finally:
            conn.close()
            loop.call_soon_threadsafe(lines.put_nowait, None)

    def describe(self) -> dict:
        with self.lock:
            up = sum(r.state == "up" for r in self.replicas)
            return {"status": "ok" if up == len(self.replicas) else ("degraded" if up else "down"),
                    "replicas": [r.describe() for r in self.replicas], "retried": self.retried,
                    "restarts": sum(r.restarts for r in self.replicas),
                    "last_replacement_s": round(self.replacement_seconds[-1], 3) if self.replacement_seconds else None}


def _final(line: bytes) -> bool:
    """A stream's last line: its result (a latent) or its error (a status)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and ("latent" in obj or "status" in obj)


def clears_all(path: str, body: bytes) -> bool:
    """A LoRA change that switches every LoRA off (an unset naming none): the changes before it are moot."""
    if not path.endswith("/unset_lora"):
        return False
    try:
        return json.loads(body or b"{}").get("lora_nickname") is None
    except (ValueError, AttributeError):
        return False


def fixed_seed(body: dict, max_seed: int) -> dict:
    """``body`` with a seed: a request without one gets one here, so that it makes the same picture if it is sent
    again (its replica died)."""
    if body.get("seed") is None:
        body = {**body, "seed": random.randrange(max_seed + 1)}
    return body


def lora_names(body: dict) -> frozenset:
    """The names of a request's ``loras`` entries (the replica checks them; a malformed list names none here)."""
    entries = body.get("loras")
    if not isinstance(entries, list):
        return frozenset()
    return frozenset(e["name"] for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str))


def images_of(body: dict) -> int:
    n = body.get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def summed_metrics(texts: Sequence[str]) -> str:
    """Prometheus text of several replicas as one: each sample (name and labels) summed over the replicas (counters,
    gauges and histograms all add up across replicas; a ``_created`` time is the earliest), the families' HELP and
    TYPE lines kept once."""
    families: Dict[str, Tuple[str, str, Dict[Tuple[str, Tuple], float]]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):  # a counter's creation time: the earliest replica's
                    samples[key] = min(samples.get(key, s.value), s.value)
                else:
                    samples[key] = samples.get(key, 0.0) + s.value
    out = []
    for name, (kind, doc, samples) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for (sample, labels), value in samples.items():
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sample}{{{label_text}}} {value!r}" if labels else f"{sample} {value!r}")
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def dumps(obj) -> bytes:
    return json.dumps(obj).encode("utf-8")
