"""The worker pool: spawned rank processes, the pipe to rank 0, failure detection, restart.

``get_pool(world, backend, user)`` returns the live pool for that shape or starts one. Every request
waits for rank 0's answer while watching all processes: a process that exits, a rank whose
heartbeat stops (a frozen process: SIGSTOP, a debugger), or no answer within the call timeout
stops the whole pool and raises ``ParallelWorkerError`` (never a hang). The next request through
``get_pool`` starts a fresh pool. A pool lives while an engine uses it: ``detach`` (the engine's
close / release) stops the workers when it was the last user; ``shutdown_pools()`` and the end of
the parent process stop them all.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import math
import multiprocessing.spawn as mp_spawn
import os
import signal
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.multiprocessing as mp

from ..errors import ParallelWorkerError
from .plan import ParallelConfigError

log = logging.getLogger("sgld.parallel")

# Timeouts in seconds: (environment variable, default). Read when a pool starts, not at import, so a
# bad value is one clear error naming the variable. A module attribute set to a number (tests)
# overrides the environment.
TIMEOUTS = {
    "START_TIMEOUT_S": ("SGLD_PARALLEL_START_TIMEOUT", 600.0),  # start the workers (spawn, import, process group)
    "CALL_TIMEOUT_S": ("SGLD_PARALLEL_CALL_TIMEOUT", 1800.0),  # one request (a live but stuck worker)
    "PG_TIMEOUT_S": ("SGLD_PARALLEL_PG_TIMEOUT", 1800.0),  # one collective inside the workers
    "HEARTBEAT_TIMEOUT_S": ("SGLD_PARALLEL_HEARTBEAT_TIMEOUT", 15.0),  # a rank's heartbeat this old: frozen
}
START_TIMEOUT_S: Optional[float] = None
CALL_TIMEOUT_S: Optional[float] = None
PG_TIMEOUT_S: Optional[float] = None
HEARTBEAT_TIMEOUT_S: Optional[float] = None


def setting(name: str) -> float:
    """A timeout of ``TIMEOUTS``: the module override, else its environment variable, else the default.
    Refuses anything but a positive finite number of seconds (``ParallelConfigError``)."""
    override = globals()[name]
    if override is not None:
        return float(override)
    var, default = TIMEOUTS[name]
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ParallelConfigError(f"environment variable {var}={raw!r} is not valid: it must be a positive number of "
                                  f"seconds (default {default:g}); fix or unset it")
    return value


def check_settings() -> Dict[str, float]:
    """Every timeout, parsed now (before a worker starts): {name: seconds}."""
    return {name: setting(name) for name in TIMEOUTS}


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
        self.users: set = set()  # keys of the engines that use this pool (see detach)
        self.lock = threading.RLock()
        self.pids: List[int] = []
        self.beats = None  # shared float64 per rank: the monotonic time of its last heartbeat (0 = none yet)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout: Optional[float] = None) -> "WorkerPool":
        timeout = setting("START_TIMEOUT_S") if timeout is None else timeout
        pg_timeout = setting("PG_TIMEOUT_S")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.conn, self.errors = parent, ctx.SimpleQueue()
        self.beats = ctx.RawArray("d", self.world)
        init = f"tcp://127.0.0.1:{free_port()}"
        t0 = time.perf_counter()
        with _bare_children():
            for rank in range(self.world):
                args = (rank, self.world, init, self.backend, child if rank == 0 else None, self.errors, self.threads,
                        pg_timeout, self.beats)
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
        timeout = setting("CALL_TIMEOUT_S") if timeout is None else timeout
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
        heartbeat_limit = setting("HEARTBEAT_TIMEOUT_S")
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
            frozen = self._frozen(heartbeat_limit)
            if frozen:
                self._fail(what, frozen)
            if closed_since is not None and time.monotonic() - closed_since > 5:
                self._fail(what, "rank 0 closed its channel")
            if time.monotonic() > deadline:
                self._fail(what, f"no answer within {timeout:.0f} s (a worker hangs)")

    def _frozen(self, limit: float) -> Optional[str]:
        """Why the first rank whose heartbeat is older than ``limit`` s is taken for frozen, or None.
        A busy rank (a long kernel, a compile, a slow load) still beats from its heartbeat thread;
        a stopped or frozen process does not. Ranks that have not beaten yet (still importing) are
        covered by the start timeout."""
        now = time.monotonic()
        for rank, beat in enumerate(self.beats or ()):
            if beat and now - beat > limit:
                pid = self.procs[rank].pid
                return (f"worker rank {rank} (pid {pid}) stopped answering: no heartbeat for {now - beat:.0f} s "
                        f"(limit {limit:g} s, SGLD_PARALLEL_HEARTBEAT_TIMEOUT){_process_state(pid)}")
        return None

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


def _process_state(pid: int) -> str:
    """' (the process is stopped: ...)' when Linux says so, else ''."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return " (the process is stopped: SIGSTOP or a debugger)" if state in ("T", "t") else ""


_pools: Dict[Tuple[int, str], WorkerPool] = {}
_pools_lock = threading.Lock()


def get_pool(world: int, backend: str, user=None) -> WorkerPool:
    """The live pool of this shape, or a new one (a dead one is replaced); ``user`` (an engine's key)
    is recorded as using it, so the pool stops when its last user detaches."""
    with _pools_lock:
        pool = _pools.get((world, backend))
        if not (pool is not None and pool.alive and all(p.exitcode is None for p in pool.procs)):
            check_settings()  # a bad timeout variable: refused before any worker starts
            if pool is not None:
                pool._stop()
            for key, other in list(_pools.items()):  # idle pools of another shape hold GPU contexts: stop them
                if key != (world, backend) and (other.loaded is None or not other.alive):
                    other.shutdown()
                    del _pools[key]
            pool = WorkerPool(world, backend)
            _pools[(world, backend)] = pool
            try:
                pool.start()
            except BaseException:
                pool._stop()
                del _pools[(world, backend)]
                raise
        if user is not None:
            pool.users.add(user)
        return pool


def detach(pool: WorkerPool, user) -> None:
    """The engine ``user`` no longer needs ``pool``: its weights are unloaded, and the worker processes
    stop when no other engine uses the pool (they hold memory: a GPU context, about 1 GB each)."""
    with _pools_lock:
        with pool.lock:  # waits for a request in flight
            pool.users.discard(user)
            if pool.users:
                if pool.alive and pool.loaded == user:
                    pool.request(("unload",))
                    pool.loaded = None
                return
            if pool.alive:
                log.info("parallel: stopping the %d %s workers (pids %s): no engine uses them", pool.world,
                         pool.backend, pool.pids)
            pool.shutdown()
            key = (pool.world, pool.backend)
            if _pools.get(key) is pool:
                del _pools[key]


def shutdown_pools() -> None:
    with _pools_lock:
        for pool in _pools.values():
            pool.shutdown()
        _pools.clear()


atexit.register(shutdown_pools)
