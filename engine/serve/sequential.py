"""A stand-in for the step-level batcher (engine/serve/batcher.py): the same interface, one job at a time on a
worker thread through ``Engine.sample``. The server runs on either; this one keeps it working until the
continuous batcher lands, and is the reference a batched image must equal."""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..errors import InputError
from ..features.cache import CacheConfig
from ..inputs import check_sampling_settings, check_seed


@dataclass
class Job:
    """One image to sample: its latent [C, h, w], text features [T, C] (uncond None: no CFG) and settings."""
    latent: torch.Tensor
    cond: torch.Tensor
    uncond: Optional[torch.Tensor]
    seed: int
    steps: int
    cfg: float
    sampler: str = "euler"
    scheduler: str = "simple"
    cache: Optional[CacheConfig] = None
    on_step: Optional[Callable[[int, int], None]] = None  # (steps done, steps in all) after each step


class _Cancelled(Exception):
    """Raised from the step callback to stop a cancelled job at its next step."""


class SequentialBatcher:
    """Jobs run one after another on one worker thread. ``submit`` returns a Future whose result is the final
    latent [C, h, w] (float32, CPU); its ``run_stats`` (model_calls, calls_computed) are set before the result."""

    def __init__(self, engine, max_batch: int = 8):
        self.engine = engine
        self.max_batch = max_batch  # one sample at a time here; the step-level batcher honours it
        self._queue: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._cancelled = set()  # running futures to stop at their next step
        self._cancel_all = False
        self._closed = False
        self._running = 0
        self._counts = dict(forwards=0, steps_done=0, calls_computed=0, calls_total=0, samples=0)
        self._worker = threading.Thread(target=self._work, name="sgld-batcher", daemon=False)
        self._worker.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        return self.submit_many([job])[0]

    def submit_many(self, jobs: List[Job]) -> List[concurrent.futures.Future]:
        """Several jobs (a request for n images), all checked before any is queued."""
        for job in jobs:
            if job.latent.dim() != 3:
                raise InputError(f"a job's latent must be [C, h, w]; got shape {tuple(job.latent.shape)}")
            check_sampling_settings(steps=job.steps, cfg=job.cfg)
            check_seed(job.seed)
        futures = [concurrent.futures.Future() for _ in jobs]
        with self._lock:
            if self._closed:
                raise RuntimeError("the batcher is closed: it takes no more jobs")
            for job, future in zip(jobs, futures):
                self._queue.put((job, future))
        return futures

    def cancel(self, future: concurrent.futures.Future) -> None:
        """A queued job is dropped; a running one stops at its next step (its Future gets CancelledError)."""
        if not future.cancel():
            with self._lock:
                if future.running():
                    self._cancelled.add(future)

    def close(self, cancel_running: bool = True) -> None:
        """Refuse new jobs, cancel the queued ones (and the running one unless told not to), stop the worker."""
        with self._lock:
            self._closed = True
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        if cancel_running:
            with self._lock:
                self._cancel_all = True
        self._queue.put(None)
        self._worker.join()

    def stats(self) -> dict:
        with self._lock:
            c = dict(self._counts)
            running = self._running
        return dict(queued=self._queue.qsize(), running=running, forwards=c["forwards"],
                    samples_per_forward=c["samples"] / c["forwards"] if c["forwards"] else 0.0,
                    steps_done=c["steps_done"], calls_computed=c["calls_computed"], calls_total=c["calls_total"])

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running = 1
            try:
                latent = self._run(job, future)
            except _Cancelled:
                future.set_exception(concurrent.futures.CancelledError("the job was cancelled"))
            except Exception as e:  # reported to the job's caller; the worker goes on with the next job
                future.set_exception(e)
            else:
                future.set_result(latent)
            finally:
                with self._lock:
                    self._running = 0
                    self._cancelled.discard(future)

    def _run(self, job: Job, future) -> torch.Tensor:
        samples = 1 if job.uncond is None or job.cfg == 1.0 else 2  # a CFG pair is one forward of two

        def step(i, total, x, denoised):
            with self._lock:
                if self._cancel_all or future in self._cancelled:
                    raise _Cancelled()
                self._counts["steps_done"] += 1
            if job.on_step is not None:
                job.on_step(i + 1, total)

        eng = self.engine
        out = eng.sample(job.latent[None], [job.cond], None if job.uncond is None else [job.uncond], seed=job.seed,
                         steps=job.steps, cfg=job.cfg, sampler=job.sampler, scheduler=job.scheduler, cache=job.cache,
                         callback=step)
        run = eng.last_run
        with self._lock:
            calls = len(run.step_mask)
            self._counts["forwards"] += run.calls_computed
            self._counts["samples"] += run.calls_computed * samples
            self._counts["calls_computed"] += run.calls_computed
            self._counts["calls_total"] += calls
        future.run_stats = {"model_calls": calls, "calls_computed": run.calls_computed}
        return out[0].float().cpu()
