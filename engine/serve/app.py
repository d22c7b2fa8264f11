"""The HTTP app of ``sgld serve`` (FastAPI): OpenAI's Images API and SGLang's extras over a batcher.

Prompts are encoded here (the text encoder lives in the server process); each image is one ``Job`` for the
batcher, which owns the DiT. Every request is admitted against a bound (--max-batch + --max-queue images),
waited for with its client and its deadline: a client that leaves or a request past --request-timeout has
its jobs cancelled and its place freed. LoRA changes wait for the running generations and hold new ones
back (``Gate``), so the batcher never samples while the weights change."""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import logging
import random
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import USER_ERRORS, CheckpointError
from ..io.safetensors import load_json_object
from ..sampling import MAX_SEED
from .guard import Guard
from .loras import Loras
from .metrics import CLIENT_GONE, Metrics
from .protocol import (ApiError, Generation, SetLoraRequest, UnsetLoraRequest, error_body, parse, parse_generation)
from .batcher import Job
from .remote import add_sample_route

log = logging.getLogger("sgld")

OPEN_PATHS = ("/health", "/metrics")  # no API key: load balancers and scrapers
ENDPOINTS = ("/v1/images/generations", "/v1/sample", "/v1/models", "/v1/set_lora", "/v1/unset_lora", "/v1/list_loras", "/health",
             "/health_generate", "/metrics")


@dataclass
class ServedModel:
    """What the server needs from a model: its name, its parts and its defaults."""
    id: str
    engine: object
    encode: Callable[[str], torch.Tensor]  # prompt -> text features [T, C]
    empty_latent: Callable[[int, int], torch.Tensor]  # (width, height) -> zeros [C, h, w]
    decode: Callable[[torch.Tensor], object]  # latent [C, h, w] -> uint8 image [H, W, 3]
    check_size: Callable[[int, int], None]  # InputError for a size the model cannot make
    default_size: int
    default_steps: int
    default_cfg: float
    root: str = ""  # the model's file


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


class _ClientGone(Exception):
    pass


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


def create_app(served: ServedModel, batcher, settings: ServeSettings) -> FastAPI:
    """The app over ``batcher`` (submit / cancel / close / stats); closing the app closes the batcher."""
    in_flight = [0]  # images admitted and not answered
    gate = Gate()
    loras = Loras(served.engine, settings.lora_dir, settings.loras)
    metrics = Metrics(batcher.stats, lambda: in_flight[0])
    encode_lock = threading.Lock()  # one text-encoder call at a time, even after its request was cancelled
    capacity = settings.max_batch + settings.max_queue
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped listening and let the running requests finish (or cancelled them after
        # --shutdown-grace): cancel what is left, stop the batcher's worker and the engine's workers
        await asyncio.to_thread(batcher.close, True)
        await asyncio.to_thread(served.engine.release)

    app = FastAPI(title="sgld serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = (f"no endpoint {request.method} {request.url.path}" if kind else str(e.detail))
        return JSONResponse(error_body(message, code=kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}"[:500], "server_error",
                                       code="internal_error"), status_code=500)

    def admit(images: int) -> None:
        if in_flight[0] + images > capacity:
            raise ApiError(429, f"the server is full ({in_flight[0]} images in flight, room for {capacity}: "
                                "--max-batch + --max-queue); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        in_flight[0] += images

    def release(images: int) -> None:
        in_flight[0] -= images

    async def answer(request: Request, images: int, work) -> dict:
        """Runs ``work`` (a coroutine) for an admitted request until it is done, the client leaves or the
        deadline passes; whatever happens, its jobs are cancelled and its place is freed before this returns."""
        admit(images)
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=settings.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn's shutdown, past --shutdown-grace: a clear answer, not a 500
            raise ApiError(503, "the server is shutting down; the request was cancelled", "server_error",
                           code="shutting_down") from None
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            release(images)
        if task in done:
            return task.result()
        if gone in done:
            raise _ClientGone()
        raise ApiError(503, f"the request took longer than --request-timeout {settings.request_timeout:g} s; its work "
                            "was cancelled", "server_error", code="timeout", headers={"x-should-retry": "false"})

    def encode_alone(prompt: str) -> torch.Tensor:
        with encode_lock:
            return served.encode(prompt)

    async def encode(prompt: str) -> torch.Tensor:
        return await asyncio.to_thread(encode_alone, prompt)

    async def sample(jobs: List[Job]) -> list:
        """The jobs through the batcher, under the shared gate; their latents and run stats."""
        async with gate.shared():
            futures = []
            try:
                try:
                    futures = batcher.submit_many(jobs)  # all checked before any is queued
                except USER_ERRORS as e:
                    raise ApiError(400, str(e), code="invalid_value") from None
                except RuntimeError:  # closed: the server is stopping
                    raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down") from None
                await _all_done(futures)
            finally:
                for f in futures:
                    if not f.done():
                        batcher.cancel(f)
        return [_outcome(f) for f in futures]

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

    async def generate(gen: Generation) -> dict:
        started = time.perf_counter()
        cond = await encode(gen.prompt)
        uncond = await encode(gen.negative_prompt)
        seed = random.randrange(MAX_SEED + 1) if gen.seed is None else gen.seed
        seeds = [(seed + i) % (MAX_SEED + 1) for i in range(gen.n)]  # image i: the request's seed + i
        latent = served.empty_latent(gen.width, gen.height)
        results = await sample([Job(latent, cond, uncond, s, gen.steps, gen.cfg, cache=gen.cache) for s in seeds])
        images = await asyncio.to_thread(lambda: [_png_b64(served.decode(z)) for z, _ in results])
        metrics.images.inc(gen.n)
        stats = [s for _, s in results if s]
        out = {"created": int(time.time()), "data": [{"b64_json": b, "seed": s} for b, s in zip(images, seeds)],
               "model": served.id, "size": f"{gen.width}x{gen.height}", "num_inference_steps": gen.steps,
               "guidance_scale": gen.cfg, "inference_time_s": round(time.perf_counter() - started, 4)}
        if len(stats) == len(results):
            out["model_calls"] = sum(s["model_calls"] for s in stats)
            out["steps_computed"] = sum(s["calls_computed"] for s in stats)
        return out

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        gen = parse_generation(await _json(request), served)
        try:
            return await answer(request, gen.n, generate(gen))
        except _ClientGone:
            return Response(status_code=CLIENT_GONE)  # nobody reads it; the metrics count it

    add_sample_route(app, batcher, gate, admit, release, settings.request_timeout, metrics)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.id:
            raise ApiError(404, f"The model '{model_id:.80}' does not exist; this server serves '{served.id}'",
                           param="model", code="model_not_found")
        return card()

    def card() -> dict:
        mc = served.engine.model_config
        return {"id": served.id, "object": "model", "created": created, "owned_by": "sgld", "root": served.root,
                "default_size": f"{served.default_size}x{served.default_size}", "default_steps": served.default_steps,
                "default_guidance_scale": served.default_cfg, "max_batch": settings.max_batch,
                "latent_channels": mc.in_channels, "text_dim": mc.text_in_dim}  # for POST /v1/sample's tensors

    async def change_loras(plan) -> dict:
        async with gate.alone():
            messages = await asyncio.to_thread(loras.apply, plan)
        return {"status": "ok", "message": "active LoRAs: " + (", ".join(n for n, _, _ in plan) or "none"),
                "warnings": messages, **loras.listing()}

    @app.post("/v1/set_lora")
    async def set_lora(request: Request):
        return await change_loras(loras.plan_set(parse(SetLoraRequest, await _json(request))))

    @app.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        body = await _json(request, empty_ok=True)
        return await change_loras(loras.plan_unset(parse(UnsetLoraRequest, body)))

    @app.get("/v1/list_loras")
    async def list_loras():
        return loras.listing()

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """One image of one step at the default size, through the batcher: the whole path works."""
        async def tiny():
            started = time.perf_counter()
            cond = await encode("")
            latent = served.empty_latent(served.default_size, served.default_size)
            (z, _), = await sample([Job(latent, cond, None, 0, 1, 1.0)])
            await asyncio.to_thread(served.decode, z)
            return {"status": "ok", "inference_time_s": round(time.perf_counter() - started, 4)}
        try:
            return await answer(request, 1, tiny())
        except _ClientGone:
            return Response(status_code=CLIENT_GONE)

    @app.get("/metrics")
    async def scrape():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return metrics.middleware(Guard(app, settings.api_key, settings.max_body_bytes, OPEN_PATHS, settings.body_timeout), ENDPOINTS)


async def _json(request: Request, empty_ok: bool = False):
    body = await request.body()
    if not body.strip() and empty_ok:
        return {}
    try:
        return load_json_object(body, "the request body")  # the one rule: no repeated keys, no deep-nesting crash
    except CheckpointError as e:
        raise ApiError(400, str(e), code="invalid_json") from None
