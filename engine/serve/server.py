"""The state and the work of ``sgld serve`` apart from its HTTP routes (engine/serve/app.py builds the app on it).

``ImageServer`` holds the served model, the settings, the batcher, the LoRA state, the admission bound
(--max-batch + --max-queue images in flight) and the ``Gate``. Prompts are encoded here (the text encoder lives in
the server process); each image is one ``Job`` for the batcher, which owns the DiT. Every request is admitted
against the bound, waited for with its client and its deadline: a client that leaves or a request past
--request-timeout has its jobs cancelled and its place freed. LoRA changes wait for the running generations and
hold new ones back (``Gate``), so the batcher never samples while the weights change."""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import io
import random
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from fastapi import Request
from PIL import Image

from ..errors import USER_ERRORS, InputError
from ..features.lora import active_loras
from ..image_parts import ImageParts
from ..sampling import DEFAULT_SHIFT, MAX_SEED
from ..text_to_image import Picture, sample_request
from .batcher import BatcherClosed, Job
from .loras import Loras
from .metrics import Metrics
from .protocol import ApiError, Generation, bad_field

PREPARE_THREADS = 2  # jobs prepared at once (seeded noise, the mask at the latent's size), off the event loop


@dataclass
class ServedModel:
    """What the server needs from a model: its name, its engine, its image parts and its defaults."""
    id: str
    engine: object
    parts: ImageParts  # encode a prompt, the latent of a size (the one size check), decode (engine/image_parts.py)
    default_steps: int
    default_cfg: float
    root: str = ""  # the model's file
    shift: float = DEFAULT_SHIFT  # its images' sigma shift (a --model-path release's scheduler config, Release.shift)
    shift_at: Optional[Callable[[int, int], float]] = None  # (width, height) -> the shift: a release's dynamic one
    # the prompt enhancer (sgld serve --pe): (prompt, width, height, seed, stop event) -> (revised prompt, seconds),
    # ending early (Cancelled) once the event is set; None: none
    enhance: Optional[Callable[[str, int, int, int, threading.Event], Tuple[str, float]]] = None

    @property
    def default_size(self) -> int:
        return self.parts.default_size


@dataclass
class ServeSettings:
    api_key: Optional[str] = None
    max_batch: int = 8
    max_queue: int = 64
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20
    body_timeout: float = 60.0  # seconds for a request's whole body (the headers' bound is connections.py's)
    lora_dir: Optional[str] = None
    loras: List[Tuple[str, float]] = field(default_factory=list)  # --lora FILE:STRENGTH, active at start


class Gate:
    """Generations share it; a LoRA change takes it alone, once the running generations are done, and the
    generations that arrive meanwhile wait behind it (a change is never starved)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._sharing, self._changing, self._waiting = 0, False, 0

    @asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._changing and not self._waiting)
            self._sharing += 1
        try:
            yield
        finally:
            async with self._cond:
                self._sharing -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def alone(self):
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._changing and not self._sharing)
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._changing = True
        try:
            yield
        finally:
            async with self._cond:
                self._changing = False
                self._cond.notify_all()


class ClientGone(Exception):
    """The client closed the connection before its answer (the metrics count it as 499)."""


async def _until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (call it after the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _all_done(futures: List[concurrent.futures.Future]) -> None:
    """Waits, without blocking the event loop, until every future of the batcher's is done."""
    loop = asyncio.get_running_loop()
    event, left = asyncio.Event(), [len(futures)]

    def one_more():
        left[0] -= 1
        if left[0] == 0:
            event.set()

    def finished(_):  # on the batcher's thread
        try:
            loop.call_soon_threadsafe(one_more)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass
    for f in futures:
        f.add_done_callback(finished)
    if futures:
        await event.wait()


def _png_b64(image) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class ImageServer:
    """What ``sgld serve`` holds while it runs: the served model, its batcher (submit / cancel / close / stats),
    the settings, the LoRA state, the images in flight against --max-batch + --max-queue, and the gate between
    sampling and LoRA changes. Closing its app closes the batcher."""

    def __init__(self, served: ServedModel, batcher, settings: ServeSettings):
        self.served, self.batcher, self.settings = served, batcher, settings
        self.in_flight = 0  # images admitted and not answered
        self.capacity = settings.max_batch + settings.max_queue
        self.gate = Gate()
        cache = getattr(batcher, "loras", None)  # the per-request LoRA cache (None: several ranks)
        if cache is not None:
            for lf, _ in active_loras(served.engine.model):  # --lora's files: requests naming them get these
                cache.adopt(lf)
        self.loras = Loras(served.engine, settings.lora_dir, settings.loras, cache)
        self.metrics = Metrics(batcher.stats, lambda: self.in_flight, cache.metrics if cache is not None else None)
        self.created = int(time.time())
        self._encode_lock = threading.Lock()  # one text-encoder call at a time, even after its request was cancelled
        # one PE call at a time (its seconds are read under the lock), and never beside a text-encoder call: each
        # brings its 3B weights onto the GPU for the call (the whole pipeline's budget has room for one of them)
        self._pe_lock = self._encode_lock
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, "sgld-prepare")

    # -- admission -------------------------------------------------------------------------------------
    def admit(self, images: int) -> None:
        """Count ``images`` in flight, or 429 when they do not fit; ``release`` them when answered."""
        if self.in_flight + images > self.capacity:
            raise ApiError(429, f"the server is full ({self.in_flight} images in flight, room for {self.capacity}: "
                                "--max-batch + --max-queue); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        self.in_flight += images

    def release(self, images: int) -> None:
        self.in_flight -= images

    async def answer(self, request: Request, images: int, work) -> dict:
        """Runs ``work`` (a coroutine) for an admitted request until it is done, the client leaves or the
        deadline passes; whatever happens, its jobs are cancelled and its place is freed before this returns."""
        self.admit(images)
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=self.settings.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn's shutdown, past --shutdown-grace: a clear answer, not a 500
            raise ApiError(503, "the server is shutting down; the request was cancelled", "server_error",
                           code="shutting_down") from None
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            self.release(images)
        if task in done:
            return task.result()
        if gone in done:
            raise ClientGone()
        raise ApiError(503, f"the request took longer than --request-timeout {self.settings.request_timeout:g} s; its "
                            "work was cancelled", "server_error", code="timeout", headers={"x-should-retry": "false"})

    # -- the work --------------------------------------------------------------------------------------
    def _encode_alone(self, prompt: str) -> torch.Tensor:
        with self._encode_lock:
            return self.served.parts.encode(prompt)

    async def encode(self, prompt: str) -> torch.Tensor:
        return await asyncio.to_thread(self._encode_alone, prompt)

    def _enhance_alone(self, prompt: str, width: int, height: int, seed: int, stop: threading.Event):
        with self._pe_lock:
            return self.served.enhance(prompt, width, height, seed, stop)

    async def enhance(self, gen: Generation, seed: int):
        """The PE's (revised prompt, seconds). When the request ends first (timeout, client gone), ``stop`` ends
        the PE's generation at its next token, so the lock is free for the next request; a prompt over the
        PE's limit is a 400 naming the field."""
        stop = threading.Event()
        try:
            return await asyncio.to_thread(self._enhance_alone, gen.prompt, gen.width, gen.height, seed, stop)
        except InputError as e:
            raise bad_field("prompt", str(e)) from None
        finally:
            stop.set()

    async def resolve_loras(self, loras) -> Optional[list]:
        """A request's loras by name -> the job's lora_set (None: the active set): the cache's entries, each
        checked from its header, then read, against the model now (off the event loop): a 400 naming ``loras``
        before any work. The job holds the entries, not the files' data."""
        lora_set = self.loras.resolve(loras)
        if lora_set is None:
            return None
        try:
            return await asyncio.to_thread(self.batcher.check_loras, lora_set)
        except USER_ERRORS as e:
            raise bad_field("loras", str(e)) from None

    async def submit(self, jobs: List[Job]) -> List[concurrent.futures.Future]:
        """The jobs to the batcher (all checked before any is queued), prepared (checks, noise, mask) in one of
        PREPARE_THREADS threads so the event loop keeps answering; a request that leaves meanwhile has its jobs
        cancelled once they are queued. Call it under ``gate.shared()``."""
        pending = asyncio.get_running_loop().run_in_executor(self._prepare_pool, self._submit_now, jobs)
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            pending.add_done_callback(self._cancel_submitted)
            raise

    def _submit_now(self, jobs: List[Job]) -> List[concurrent.futures.Future]:
        """A bad job is a 400, a closed batcher a 503 ``shutting_down``, anything else (memory for the noise or
        the mask) a 503 naming the jobs' sizes."""
        try:
            return self.batcher.submit_many(jobs)
        except USER_ERRORS as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        except BatcherClosed:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down") from None
        except (MemoryError, RuntimeError) as e:  # torch's "can't allocate memory" is a RuntimeError
            raise ApiError(503, f"preparing {_sizes(jobs)} failed: {type(e).__name__}: {e}"[:500], "server_error",
                           code="prepare_failed") from None

    def _cancel_submitted(self, pending: asyncio.Future) -> None:
        if not pending.cancelled() and pending.exception() is None:
            for future in pending.result():
                self.batcher.cancel(future)

    async def sample(self, jobs: List[Job]) -> list:
        """The jobs through the batcher, under the shared gate; their latents and run stats."""
        async with self.gate.shared():
            futures = []
            try:
                futures = await self.submit(jobs)
                await _all_done(futures)
            finally:
                for f in futures:
                    if not f.done():
                        self.batcher.cancel(f)
        return [_outcome(f) for f in futures]

    async def generate(self, gen: Generation) -> dict:
        served = self.served
        started = time.perf_counter()
        seed = random.randrange(MAX_SEED + 1) if gen.options.seed is None else gen.options.seed
        lora_set = await self.resolve_loras(gen.loras)  # its 400 before any work
        revised, pe_s = None, 0.0
        if gen.enhance_prompt:  # once per request (diffusers: once per prompt): every image shows the same text
            revised, pe_s = await self.enhance(gen, seed)
        picture = Picture([gen.prompt if revised is None else revised], [gen.negative_prompt], gen.width, gen.height,
                          dataclasses.replace(gen.options, seed=seed), cache=gen.cache, latent_shape=gen.latent_shape)
        request = await asyncio.to_thread(sample_request, served.parts, picture, self._encode_alone)
        seeds = [(seed + i) % (MAX_SEED + 1) for i in range(gen.n)]  # image i: the request's seed + i
        results = await self.sample([Job.of(dataclasses.replace(request, seed=s), lora_set=lora_set) for s in seeds])
        images = await asyncio.to_thread(lambda: [_png_b64(served.parts.decode(z)[0]) for z, _ in results])
        self.metrics.images.inc(gen.n)
        stats = [s for _, s in results if s]
        data = [{"b64_json": b, "seed": s} for b, s in zip(images, seeds)]
        if revised is not None:  # OpenAI's field: the prompt the picture was made from
            for item in data:
                item["revised_prompt"] = revised
        out = {"created": int(time.time()), "data": data, "model": served.id, "size": f"{gen.width}x{gen.height}",
               "num_inference_steps": gen.options.steps, "guidance_scale": gen.options.cfg,
               "inference_time_s": round(time.perf_counter() - started, 4)}
        if revised is not None:
            out["pe_time_s"] = round(pe_s, 4)
        if len(stats) == len(results):  # model calls (heun: two a step), not steps; computed: not Cache-DiT reuse
            for item, s in zip(data, stats):  # samples_per_forward: the mean batch of the forwards it was in
                item.update(model_calls=s["model_calls"], calls_computed=s["calls_computed"],
                            samples_per_forward=round(s["samples_per_forward"], 4))
            out["model_calls"] = sum(s["model_calls"] for s in stats)  # all images'
            out["calls_computed"] = sum(s["calls_computed"] for s in stats)
            out["samples_per_forward"] = round(sum(s["samples_per_forward"] for s in stats) / len(stats), 4)
            out["steps_computed"] = out["calls_computed"]  # its first, wrong name (deprecated): model calls, all images
        return out

    async def tiny_generation(self) -> dict:
        """One image of one step at the default size, through the batcher: the whole path works (a DiT served
        alone: one token's latent, empty text, nothing decoded)."""
        started = time.perf_counter()
        parts, mc = self.served.parts, self.served.engine.model_config
        if parts.pictures:
            cond = await self.encode("")
            latent = parts.empty_latent(parts.default_size, parts.default_size)
        else:  # a DiT alone: the smallest latent, no text
            cond, latent = torch.zeros(1, mc.text_in_dim), torch.zeros(1, mc.in_channels, mc.patch_size, mc.patch_size)
        (z, _), = await self.sample([Job(latent=latent, cond=cond, uncond=None, seed=0, steps=1, cfg=1.0)])
        if parts.pictures:
            await asyncio.to_thread(parts.decode, z)
        return {"status": "ok", "inference_time_s": round(time.perf_counter() - started, 4)}

    def card(self) -> dict:
        served, mc = self.served, self.served.engine.model_config
        return {"id": served.id, "object": "model", "created": self.created, "owned_by": "sgld", "root": served.root,
                "default_size": f"{served.default_size}x{served.default_size}", "default_steps": served.default_steps,
                "default_guidance_scale": served.default_cfg, "max_batch": self.settings.max_batch,
                "latent_channels": mc.in_channels, "text_dim": mc.text_in_dim}  # for POST /v1/sample's tensors

    async def change_loras(self, plan) -> dict:
        async with self.gate.alone():
            messages = await asyncio.to_thread(self.loras.apply, plan)
        return {"status": "ok", "message": "active LoRAs: " + (", ".join(n for n, _, _ in plan) or "none"),
                "warnings": messages, **self.loras.listing()}

    # -- the app ---------------------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app):
        yield
        # uvicorn has stopped listening and let the running requests finish (or cancelled them after
        # --shutdown-grace): cancel what is left, stop the batcher's worker and the engine's workers
        await asyncio.to_thread(self._prepare_pool.shutdown, True)
        await asyncio.to_thread(self.batcher.close, True)


def _sizes(jobs: List[Job]) -> str:
    """The jobs' inputs that cost memory to prepare, for an error message."""
    job = jobs[0]
    sizes = f"latent {list(job.latent.shape)}"
    if job.noise_mask is not None:
        sizes += f", noise_mask {list(job.noise_mask.shape)}"
    if job.batch_index:
        sizes += f", batch_index up to {max(job.batch_index)}"
    return f"{len(jobs)} job(s) of {sizes}" if len(jobs) > 1 else f"the job ({sizes})"


def _outcome(future: concurrent.futures.Future):
    if future.cancelled() or isinstance(future.exception(), concurrent.futures.CancelledError):
        raise ApiError(503, "the server is shutting down; the request was cancelled", "server_error",
                       code="shutting_down")
    error = future.exception()
    if isinstance(error, USER_ERRORS):
        raise ApiError(400, str(error), code="invalid_value")
    if error is not None:
        raise error
    return future.result(), getattr(future, "run_stats", None)

