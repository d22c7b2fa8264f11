"""The worker pool: spawned rank processes, the pipe to rank 0, failure detection, restart.

``get_pool(world, backend)`` returns the live pool for that shape or starts one. Every request
waits for rank 0's answer while watching all processes: a process that exits, or no answer
within the timeout, stops the whole pool and raises ``ParallelWorkerError`` (never a hang).
The next request through ``get_pool`` starts a fresh pool. Pools live until ``shutdown_pools()``
or the end of the parent process; a pool whose engines are all gone unloads its weights.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.multiprocessing as mp

log = logging.getLogger("sgld.parallel")

START_TIMEOUT_S = float(os.environ.get("SGLD_PARALLEL_START_TIMEOUT", "600"))
CALL_TIMEOUT_S = float(os.environ.get("SGLD_PARALLEL_CALL_TIMEOUT", "1800"))
PG_TIMEOUT_S = float(os.environ.get("SGLD_PARALLEL_PG_TIMEOUT", "1800"))


# The workers import the engine as the top-level package ``engine`` from the pack root, whatever
# name the parent imported it under (ComfyUI imports the pack by its folder name), and start with
# ``exec`` (a builtin) as their target, so nothing of the parent's module names is needed to start.
PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOTSTRAP = (
    "import sys\n"
    "sys.path.insert(0, ROOT)\n"
    "from engine.parallel.worker import worker_main\n"
    "worker_main(*ARGS)\n"
)
_spawn_lock = threading.Lock()


@contextlib.contextmanager
def _bare_children():
    """Spawned workers skip re-importing the parent's ``__main__`` (ComfyUI's main.py, a test
    runner, a script without a ``__main__`` guard): they need nothing from it."""
    import multiprocessing.spawn as mp_spawn

    with _spawn_lock:
        original = mp_spawn.get_preparation_data

        def preparation(name):
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        mp_spawn.get_preparation_data = preparation
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


class ParallelWorkerError(RuntimeError):
    """A worker died, failed or stopped answering; the pool was stopped and restarts on the next run."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerPool:
    def __init__(self, world: int, backend: str, threads: Optional[int] = None):
        self.world = world
        self.backend = backend
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // world) if backend == "gloo" else 0
        self.threads = threads
        self.procs: List[mp.Process] = []
        self.conn = None
        self.errors = None
        self.alive = False
        self.loaded = None  # key of the weights the workers hold
        self.users = 0
        self.lock = threading.RLock()
        self.pids: List[int] = []

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout: Optional[float] = None) -> "WorkerPool":
        timeout = START_TIMEOUT_S if timeout is None else timeout
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.conn, self.errors = parent, ctx.SimpleQueue()
        init = f"tcp://127.0.0.1:{free_port()}"
        t0 = time.perf_counter()
        with _bare_children():
            for rank in range(self.world):
                args = (rank, self.world, init, self.backend, child if rank == 0 else None, self.errors, self.threads,
                        PG_TIMEOUT_S)
                p = ctx.Process(target=exec, args=(_BOOTSTRAP, {"ROOT": PACK_ROOT, "ARGS": args}),
                                name=f"sgld-rank{rank}", daemon=True)
                p.start()
                self.procs.append(p)
        child.close()
        self.alive = True
        self._wait("starting the workers", timeout)
        self.pids = self.request(("pids",), timeout)
        log.info("parallel: %d %s workers up in %.1f s (pids %s)", self.world, self.backend, time.perf_counter() - t0, self.pids)
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self.lock:
            if self.alive:
                try:
                    self.conn.send(("exit",))
                    self._wait("stopping", timeout)
                except Exception:
                    pass
            self._stop()

    def _stop(self) -> None:
        self.alive = False
        self.loaded = None
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for res in (self.conn, self.errors):
            try:
                if res is not None:
                    res.close()
            except Exception:
                pass

    # -- requests ------------------------------------------------------------------------------------
    def request(self, msg: tuple, timeout: Optional[float] = None):
        timeout = CALL_TIMEOUT_S if timeout is None else timeout
        with self.lock:
            if not self.alive:
                raise ParallelWorkerError("the parallel workers are not running (a previous run failed); run again to restart them")
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError):
                self._fail(f"sending '{msg[0]}'", "rank 0 closed its channel")
            return self._wait(f"'{msg[0]}'", timeout)

    def _wait(self, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        closed_since = None
        while True:
            ready = False
            try:
                ready = self.conn.poll(0.05)
            except (EOFError, OSError):
                ready = False
            if ready:
                try:
                    kind, payload = self.conn.recv()
                    return payload
                except (EOFError, OSError):  # rank 0 closed its end: it is exiting
                    closed_since = closed_since or time.monotonic()
                    time.sleep(0.05)
            dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
            if dead:
                time.sleep(0.2)  # give a dying worker's error report (and its peers' exits) a moment
                self._fail(what, None)
            if closed_since is not None and time.monotonic() - closed_since > 5:
                self._fail(what, "rank 0 closed its channel")
            if time.monotonic() > deadline:
                self._fail(what, f"no answer within {timeout:.0f} s (a worker hangs)")

    def _fail(self, what: str, why: Optional[str]):
        reports = []
        try:
            while self.errors is not None and not self.errors.empty():
                reports.append(self.errors.get())
        except Exception:
            pass
        reported = {r for r, _, _ in reports}
        dead = [(i, p.pid, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]
        # the root cause first: a worker that died without reporting (killed), then the lowest rank
        dead.sort(key=lambda d: (d[0] in reported, d[0]))
        if why is None and dead:
            i, pid, code = dead[0]
            why = f"worker rank {i} (pid {pid}) exited with code {code}"
            if code is not None and code < 0:
                try:
                    import signal

                    why += f" ({signal.Signals(-code).name})"
                except ValueError:
                    pass
        self._stop()
        msg = f"parallel run failed while {what}: {why}. All {self.world} workers were stopped; the next run restarts them."
        if reports:
            reports.sort()
            msg += " Worker errors: " + " | ".join(f"rank {r}: {m}" for r, m, _ in reports)
            log.error("parallel worker traceback (rank %s):\n%s", reports[0][0], reports[0][2])
        raise ParallelWorkerError(msg)


_pools: Dict[Tuple[int, str], WorkerPool] = {}
_pools_lock = threading.Lock()


def get_pool(world: int, backend: str) -> WorkerPool:
    """The live pool of this shape, or a new one (a dead one is replaced)."""
    with _pools_lock:
        pool = _pools.get((world, backend))
        if pool is not None and pool.alive and all(p.exitcode is None for p in pool.procs):
            return pool
        if pool is not None:
            pool._stop()
        for key, other in list(_pools.items()):  # idle pools of another shape hold GPU contexts: stop them
            if key != (world, backend) and (other.loaded is None or not other.alive):
                other.shutdown()
                del _pools[key]
        pool = WorkerPool(world, backend).start()
        _pools[(world, backend)] = pool
        return pool


def shutdown_pools() -> None:
    with _pools_lock:
        for pool in _pools.values():
            pool.shutdown()
        _pools.clear()


atexit.register(shutdown_pools)
