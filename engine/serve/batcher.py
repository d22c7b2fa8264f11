"""Step-level continuous batching: many sampling jobs share each DiT forward (the server drives it; no HTTP).

``Batcher(engine).submit(Job(...))`` returns a future of the job's final latent. A job joins the running
batch at the next denoising step and leaves when its own schedule ends; each keeps its own text, seed,
noise, sigma schedule, step position, cfg and sampler state.

How: a job is ``Engine.sample`` split in its two halves. At submit, ``Engine.prepare`` makes its ``Run`` (every
check, the sigmas from steps / scheduler / denoise / shift or the job's own, the cache plan, the seeded noise
with its batch_index, the noise mask): so everything ``Engine.sample`` takes, a job takes. Admitted, it runs
``Engine.loop`` (the samplers' own arithmetic, CFG, inpainting; heun's second call is just the next tick) in a
thread of its own, its model calls answered by the batcher (``SharedCall``): a call posts itself and waits. The
loop thread waits until every running job has posted its next call (or left), groups the calls by latent size
(only equal sizes share a forward), makes one DiT forward per group (``engine.serve.forward.joint_velocity``:
each sample with the shapes it has alone) and hands every job its velocity. So a job's latent is
``Engine.sample`` of the same job alone, bit for bit on this CPU, also while batched (tests/test_batcher.py
measures it; on a GPU the batched GEMMs may round differently: fp32 tolerance, stated there).

Per-request Cache-DiT: a job whose cache is on (its ``cache``, else the engine's) gets its own ``DBCacheRunner``,
which decides for its job's rows inside the joined forward: the same latent and step mask as its run alone.
Per-request LoRAs: a job's ``lora_set`` (None: the engine's own set), minus the merged set, runs on its rows only
by the side path (engine/serve/job_loras.py). Admission, in order: ``max_batch`` bounds the samples (CFG branches
count) of the running jobs, ``max_loras`` their distinct LoRAs, and on a GPU the model family's estimate of their
activations (and their LoRAs' terms) the memory free beside the weights (``LocalRunner.activation_room``); a job
waits for room, one that alone passes a bound runs alone (or, for LoRAs, is refused at submit); jobs pass one
waiting for LoRA room, a bounded number of times. docs/serve.md has more.

Several ranks (an engine whose forward is ``RankedRunner``): the ranks keep one run at a time, so the
batcher admits one job at a time there (no batching; same results as ``Engine.sample``).

The batcher owns the engine while it runs: do not sample with the same engine from another thread.
Errors stay with their job: NaN/inf in a job's velocity (``ModelOutputError``), an ``on_step`` that
raises, or a forward that fails fails only the futures of those jobs; the loop keeps serving the others.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from ..engine import Engine, Run, RunStats
from ..errors import CacheConfigError, InputError
from ..features.cache import DBCacheRunner
from ..features.lora.rows import DEFAULT_BUDGET_BYTES
from ..features.offload.auto import with_margin
from ..sampling_options import SampleRequest
from .forward import Call, joint_velocity
from .job_loras import JobLoRAs


@dataclass
class Job(SampleRequest):
    """One sampling run for the batcher: a ``SampleRequest`` (what ``Engine.sample`` takes) and its progress.
    ``latent`` [C, h, w] (one sample; the result is [C, h, w]) or [B, C, h, w] (a batch; the result is
    [B, C, h, w]), float32, zeros for text-to-image; ``cond`` / ``uncond`` text features [T, C_text] (for every
    sample) or a list of one per sample (``uncond`` None or ``cfg`` 1: no CFG). ``cache``: this job's Cache-DiT
    (None: the engine's; no environment is read per job). ``on_step(step, total)`` runs after each step's model
    call (``step`` counts from 1) in the job's thread; it may raise to cancel the job (its future gets the error).
    It must return quickly: the next step of every job waits for it. ``lora_set``: this job's own LoRAs,
    [(path or LoRAFile, strength)] (None: the engine's set; []: none)."""

    on_step: Optional[Callable[[int, int], None]] = None
    lora_set: Optional[list] = None
    stats: RunStats = field(default_factory=RunStats, init=False)  # this job's run: step mask, cache summary

    @classmethod
    def of(cls, request, on_step: Optional[Callable[[int, int], None]] = None, lora_set: Optional[list] = None) -> "Job":
        """The job of a ``SampleRequest``."""
        return cls(**{f.name: getattr(request, f.name) for f in dataclasses.fields(SampleRequest)}, on_step=on_step,
                   lora_set=lora_set)


class BatcherClosed(RuntimeError):
    """``submit`` on a closed batcher (the server is stopping): the one failure that means "shutting down"."""


class _Cancelled(Exception):
    """Raised in a job's thread at its next model call once the job is cancelled."""


class _Slot:
    """An admitted or queued job: its prepared run, its thread and the model call it waits on."""

    def __init__(self, job: Job, future, run: Run, batched: bool):
        self.job, self.future, self.run, self.batched = job, future, run, batched
        self.rows = run.rows
        self.bucket = tuple(run.latent.shape[1:])
        self.working = 0  # its activations' device bytes (with offload auto's margin): what admission counts
        self.net: list = []  # [(CachedLoRA, strength)] its rows get on top of the merged set
        self.forwards, self.forward_samples = 0, 0  # forwards it was in, and their samples together
        self.runner: Optional[DBCacheRunner] = None  # this job's Cache-DiT (local engine)
        self.remote_run = None  # its run on the ranks (remote engine)
        self.call: Optional[Call] = None  # the model call it waits on
        self.answer = None  # (velocity, computed) from the loop
        self.error: Optional[BaseException] = None  # its forward failed
        self.cancelled = False
        self.waited_for_memory = False
        self.passed = 0  # jobs admitted before it while it waited for LoRA room
        self.done = False
        self.thread: Optional[threading.Thread] = None


class SharedCall:
    """A job's model calls for ``Engine.loop``, answered by the batcher's shared forward: ``call`` posts the call
    and waits for the loop's answer; ``finish`` gives the job's cache summary (its runner's, or the ranks')."""

    def __init__(self, batcher: "Batcher", slot: _Slot):
        self.batcher, self.slot = batcher, slot

    def call(self, x, sigma, text, lens):
        return self.batcher.wait_answer(self.slot, Call(x, sigma, text, lens))

    def finish(self) -> Optional[dict]:
        if self.slot.remote_run is not None:
            return self.slot.remote_run.finish()
        return self.slot.runner.summary() if self.slot.runner is not None else None


def _settle(future, result=None, error: Optional[BaseException] = None) -> None:
    """Give ``future`` its result or error unless it was cancelled meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _features(value) -> Optional[list]:
    if value is None:
        return None
    return [value] if isinstance(value, torch.Tensor) else list(value)


class Batcher:
    def __init__(self, engine: Engine, max_batch: int = 8, max_loras: int = 8,
                 lora_budget_bytes: int = DEFAULT_BUDGET_BYTES):
        """``max_batch``: samples (CFG branches count) in flight at once, so at most that many per forward;
        ``max_loras``: distinct per-request LoRAs in flight at once; ``lora_budget_bytes``: their cache's budget."""
        for name, value in (("max_batch", max_batch), ("max_loras", max_loras), ("lora_budget_bytes", lora_budget_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1 (got {value!r})")
        self.engine, self.max_batch, self.max_loras = engine, max_batch, max_loras
        self.local = engine.model is not None
        self.activation_room = engine.runner.activation_room() if self.local else None  # None: no byte bound
        self._loras = JobLoRAs(engine, max_loras, lora_budget_bytes)
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._running: List[_Slot] = []
        self._slots: Dict[concurrent.futures.Future, _Slot] = {}
        self._closed = False
        self._counts = dict(forwards=0, samples=0, steps_done=0, calls_computed=0, calls_total=0, waited_for_memory=0)
        self._threads = engine.threads or torch.get_num_threads()  # engine/threads.py: the demo 1, else the caller's
        self._loop = threading.Thread(target=self._serve, name="sgld-batcher", daemon=True)
        self._loop.start()

    # -- the API ---------------------------------------------------------------------------------------
    @property
    def loras(self):
        """The per-request LoRA cache (``RowLoRAs``, attached to the model when first asked for); None on
        several ranks (they keep one run at a time)."""
        return self._loras.cache

    def check_loras(self, lora_set) -> Optional[list]:
        """A job's [(path or LoRAFile, strength)] as the cache's entries, each named once, checked (from its
        header: linear-only, within the budget) and read, their count within ``max_loras`` (InputError naming
        ``loras``). Blocking; a server calls it first and gives its answer as the job's ``lora_set``: ``submit``
        reads nothing again, and the job holds entries, not the files' data."""
        return self._loras.check(lora_set)

    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue ``job``; its future gets the final latent ([C, h, w] or [B, C, h, w], as the job's; float32, CPU),
        and ``run_stats`` (model_calls, calls_computed, samples_per_forward: the mean samples of the forwards it was
        in) just before; ``job.stats`` holds its whole run. Bad jobs
        raise InputError here, before anything is queued."""
        return self.submit_many([job])[0]

    def submit_many(self, jobs: List[Job]) -> List[concurrent.futures.Future]:
        """Queue several jobs at once (a request for n images): they join the batch at the same step, as far
        as ``max_batch`` allows. All are checked before any is queued."""
        slots = [self._prepare(job) for job in jobs]
        with self._cv:
            if self._closed:
                raise BatcherClosed("the batcher is closed: it takes no more jobs")
            for slot in slots:
                if slot.run.steps:
                    self._slots[slot.future] = slot
                    self._queue.append(slot)
            self._cv.notify_all()
        for slot in slots:
            if slot.run.steps:
                slot.future.add_done_callback(self._on_done)
            else:  # denoise 0: nothing to sample, the latent is the answer (as Engine.sample)
                self._answer(slot, slot.run.latent.clone())
        return [slot.future for slot in slots]

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancel the job of ``future`` (``future.cancel()`` does the same): a queued job never runs, a running
        one leaves at the next step and its slot is free for the next job."""
        future.cancel()

    def close(self, cancel_running: bool = True) -> None:
        """Take no more jobs; cancel the queued ones and, with ``cancel_running``, the running ones (else let
        them finish); then stop the loop thread and take the per-request LoRAs off the model. Returns once it and
        the jobs' threads have stopped."""
        with self._cv:
            self._closed = True
            left = list(self._queue) + (list(self._running) if cancel_running else [])
        for slot in left:
            slot.future.cancel()
        with self._cv:
            self._cv.notify_all()
        self._loop.join()
        for slot in left:
            if slot.thread is not None:
                slot.thread.join()
        self._loras.close()

    def stats(self) -> dict:
        """queued / running jobs; forwards made; mean samples per forward; steps done (sampler steps of all
        jobs); model calls whose DiT was computed (the rest: Cache-DiT reuse) and all model calls; jobs that
        waited for device memory (not for ``max_batch``)."""
        with self._cv:
            c = dict(self._counts)
            running = sum(not s.future.done() for s in self._running)  # a finished job may not have left yet
            return {"queued": len(self._queue), "running": running, "forwards": c["forwards"],
                    "samples_per_forward": c["samples"] / c["forwards"] if c["forwards"] else 0.0,
                    "steps_done": c["steps_done"], "calls_computed": c["calls_computed"],
                    "calls_total": c["calls_total"], "waited_for_memory": c["waited_for_memory"]}

    # -- checks at submit ------------------------------------------------------------------------------
    def _prepare(self, job: Job) -> _Slot:
        """The job's ``Engine.prepare``: every check ``Engine.sample`` makes (InputError naming the field), the
        sigmas, the cache plan and the noise."""
        if not isinstance(job, Job):
            raise InputError(f"submit takes a Job, not {type(job).__name__}")
        mc, latent = self.engine.model_config, job.latent
        if not isinstance(latent, torch.Tensor) or latent.dim() not in (3, 4):
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise InputError(f"a job's latent has shape {shape}; expected [{mc.in_channels}, height, width] or "
                             f"[batch, {mc.in_channels}, height, width]")
        if job.on_step is not None and not callable(job.on_step):
            raise InputError(f"a job's on_step must be callable, not {type(job.on_step).__name__}")
        batched = latent.dim() == 4
        net_set = self._loras.net(job.lora_set)
        try:
            run = self.engine.prepare(dataclasses.replace(job, latent=latent if batched else latent[None],
                                                          cond=_features(job.cond), uncond=_features(job.uncond)))
        except CacheConfigError as e:
            raise InputError(str(e)) from e
        job.stats = run.stats
        slot = _Slot(job, concurrent.futures.Future(), run, batched)
        slot.net = net_set
        if self.activation_room is not None and run.steps:
            slot.working = with_margin(self.engine.runner.activation_bytes(run.call_shape, run.text_tokens))
        return slot

    def _on_done(self, future) -> None:
        """A future settled or cancelled (by anyone): forget it; a cancelled running job's thread wakes and
        leaves, and the loop frees its slot."""
        with self._cv:
            slot = self._slots.pop(future, None)
            if slot is None:
                return
            if future.cancelled():
                slot.cancelled = True
                if slot in self._queue:
                    self._queue.remove(slot)
            self._cv.notify_all()

    # -- a job's thread --------------------------------------------------------------------------------
    def _run_job(self, slot: _Slot) -> None:
        """The job's ``Engine.loop``, its model calls answered by the batcher's loop."""
        job = slot.job

        def step_done(i, total, x, denoised):
            with self._cv:
                self._counts["steps_done"] += 1
            if job.on_step is not None:
                job.on_step(i + 1, total)
        try:
            torch.set_num_threads(self._threads)
            with torch.inference_mode():
                out = self.engine.loop(slot.run, SharedCall(self, slot), callback=step_done)
            self._answer(slot, out)
        except _Cancelled:
            pass  # its future is cancelled already
        except BaseException as e:  # noqa: BLE001 - any failure is this job's alone
            _settle(slot.future, error=e)
        finally:
            with self._cv:
                slot.done = True
                self._cv.notify_all()

    @staticmethod
    def _answer(slot: _Slot, out: torch.Tensor) -> None:
        stats = slot.job.stats
        slot.future.run_stats = {"model_calls": len(stats.step_mask), "calls_computed": stats.calls_computed,
                                 "samples_per_forward": slot.forward_samples / slot.forwards if slot.forwards else 0.0}
        _settle(slot.future, out if slot.batched else out[0])

    def wait_answer(self, slot: _Slot, call: Call) -> tuple:
        """Post ``call`` for the loop and wait for its (velocity, computed); _Cancelled once the job is."""
        with self._cv:
            if slot.cancelled:
                raise _Cancelled()
            slot.call = call
            self._cv.notify_all()
            while slot.answer is None and slot.error is None and not slot.cancelled:
                self._cv.wait()
            if slot.cancelled:
                raise _Cancelled()
            if slot.error is not None:
                raise slot.error
            answer, slot.answer = slot.answer, None
        return answer

    # -- the loop --------------------------------------------------------------------------------------
    def _serve(self) -> None:
        torch.set_num_threads(self._threads)
        try:
            with torch.inference_mode():
                while True:
                    tick = self._next_tick()
                    if tick is None:
                        return
                    self._tick(tick)
        except BaseException as e:  # noqa: BLE001 - a fault of the loop itself: fail every job, take no more
            fault = RuntimeError(f"the batcher's loop failed: {type(e).__name__}: {e}")
            with self._cv:
                self._closed = True
                left = list(self._queue) + list(self._running)
                self._queue.clear()
                self._running = []
                for slot in left:
                    slot.error = fault
                self._cv.notify_all()
            for slot in left:
                _settle(slot.future, error=fault)

    def _admit(self) -> None:
        """Queued jobs join in order while their samples fit in ``max_batch`` and their activations (and their
        LoRAs' terms) in the device memory beside the weights (one that alone exceeds either runs when nothing
        else does); one job at a time on several ranks. A job waiting for LoRA room (``max_loras``) lets the jobs
        behind it join when they fit, at most ``max_batch`` of them: then it is first again (no starvation)."""
        i = 0
        while i < len(self._queue) and not self._closed:
            slot = self._queue[i]
            busy = sum(s.rows for s in self._running)
            if self._running and (not self.local or busy + slot.rows > self.max_batch):
                return
            if self._running and self.activation_room is not None and \
                    self._working(self._running + [slot]) > self.activation_room:
                if not slot.waited_for_memory:
                    slot.waited_for_memory = True
                    self._counts["waited_for_memory"] += 1
                return
            if self._running and not self._loras.fits([s.net for s in self._running + [slot]]):
                if slot.passed >= self.max_batch:
                    return  # it has waited long enough: nothing passes it now
                i += 1
                continue  # its LoRAs wait for a forward with room; the next job may fit
            del self._queue[i]
            for waiting in list(self._queue)[:i]:
                waiting.passed += 1
            i = 0  # those waiting for LoRA room first again: one may have been passed enough now
            if self.local and slot.run.plan is not None:
                slot.runner = DBCacheRunner(slot.run.plan, branches=2 if slot.run.cfg_batched else 1)
            slot.thread = threading.Thread(target=self._run_job, args=(slot,), name="sgld-job", daemon=True)
            self._running.append(slot)
            slot.thread.start()

    def _working(self, slots: List[_Slot]) -> int:
        """The device bytes the jobs' forwards need beside the weights: their activations, and their LoRAs' terms
        with those resident already."""
        return sum(s.working for s in slots) + self._loras.device_bytes([s.net for s in slots])

    def _next_tick(self) -> Optional[List[_Slot]]:
        """Under the lock: wait until every running job has posted its next model call; the jobs of the tick,
        or None once closed with nothing left to run."""
        with self._cv:
            while True:
                self._running = [s for s in self._running if not s.done and not s.cancelled]  # leavers free their slot
                self._admit()
                if self._running and all(s.call is not None for s in self._running):
                    return list(self._running)
                if self._closed and not self._running:
                    return None
                self._cv.wait()

    def _tick(self, slots: List[_Slot]) -> None:
        """One step of every job: one joined forward per latent size (a forward per job on several ranks);
        then every job gets its answer, or its forward's error."""
        groups: Dict[tuple, List[_Slot]] = {}
        for s in slots:
            groups.setdefault(s.bucket if self.local else id(s), []).append(s)
        answers: Dict[int, tuple] = {}
        errors: Dict[int, BaseException] = {}
        for group in groups.values():
            try:
                result = self._forward(group)
            except Exception as e:  # noqa: BLE001 - fails the jobs of this forward only
                errors.update({id(s): e for s in group})
                continue
            live = [s for s, answer in zip(group, result) if not isinstance(answer, BaseException)]
            for s, answer in zip(group, result):
                (errors if isinstance(answer, BaseException) else answers)[id(s)] = answer
            for s in live:
                s.forwards += 1
                s.forward_samples += sum(g.rows for g in live)
        with self._cv:
            c = self._counts
            c["forwards"] += len(groups)
            c["samples"] += sum(s.rows for s in slots)
            for s in slots:
                s.call = None
                if id(s) in errors:
                    s.error = errors[id(s)]
                    continue
                s.answer = answers[id(s)]
                c["calls_total"] += 1
                c["calls_computed"] += int(s.answer[1])
            self._cv.notify_all()

    def _forward(self, group: List[_Slot]) -> list:
        """(velocity, whether the DiT was computed) for each job of one forward, or the error of a job whose LoRAs
        could not be made ready (the others' forward runs without it): the joined forward locally (each job's
        Cache-DiT runner deciding for its own rows), or one job's call on the ranks through its own run."""
        if self.local:
            keys, bad = self._loras.ready([(s.net, s.rows) for s in group])
            calls = [Call(s.call.x, s.call.sigma, s.call.text, s.call.lens, s.runner,
                          {keys[e.ident]: strength for e, strength in s.net} or None)
                     for i, s in enumerate(group) if i not in bad]
            vs = iter(joint_velocity(self.engine.model, calls, self.engine.device) if calls else ())
            return [bad[i] if i in bad else (next(vs), s.runner is None or bool(s.runner.computed[-1]))
                    for i, s in enumerate(group)]
        slot, call = group[0], group[0].call
        if slot.remote_run is None:
            slot.remote_run = self.engine.runner.run(slot.run.plan, cfg_batched=slot.run.cfg_batched)
        return [slot.remote_run.call(call.x, call.sigma, call.text, call.lens)]
