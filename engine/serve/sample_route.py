"""POST /v1/sample: one sampling run of a client's own latent and text features (the ComfyUI nodes'
remote KSampler), as a Job on the server's batcher, its progress streamed back. The run takes everything
``Engine.sample`` takes (docs/serve.md has the table).

Request: the body is safetensors bytes (never a pickle: anything else is a 400) with the tensors ``latent``
[C, h, w] or [B, C, h, w], ``cond`` [T, C_text], optionally ``uncond`` [T', C_text], ``noise_mask`` (a LATENT's
mask, any size) and ``sigmas`` [steps + 1], all float32, and in the safetensors metadata the key ``sgld``: a
JSON object {seed, steps, cfg, sampler, scheduler, denoise, shift, batch_index, cache} (cache: a preset name,
"off", an object of CacheConfig fields, or null for the server's).

Answer: 200 with newline-delimited JSON (application/x-ndjson), one event a line: ``{"step": i, "total": n}``
after each step; an empty line every second without one (a keepalive: clients skip it); then the last line,
``{"latent": <base64 safetensors with the tensor "latent" of the request's latent shape, float32>,
"model_calls", "calls_computed", "timeline", "warnings"}`` or ``{"error": {OpenAI error}, "status": code}`` when
the run failed after the answer began. Everything checkable before the run (body, fields, shapes, a batch
past --max-batch, batch_index past the draws the server makes, a full server) is refused with its status and
the OpenAI error body instead. A client that closes the connection
cancels the job (its batcher slot is freed)."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import List, Optional, Tuple, Union

import torch
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..errors import USER_ERRORS, CheckpointError
from ..features.cache import CacheConfig, CacheConfigError
from ..features.cache.config import config_from_dict
from ..io.safetensors import load_json_object
from ..sampling import DEFAULT_SHIFT, cfg_on
from ..sampling_options import DEFAULT_DENOISE, DEFAULT_SAMPLER, DEFAULT_SCHEDULER
from .batcher import Job
from .protocol import ApiError, bad_field, parse, parse_cache

PATH = "/v1/sample"
METADATA_KEY = "sgld"
TENSORS = ("latent", "cond", "uncond", "noise_mask", "sigmas")
KEEPALIVE_S = 1.0
MAX_HEADER = 100_000  # bytes of safetensors header: five tensors and a few settings need far less


class SampleSettings(BaseModel):
    """The run's settings (the safetensors metadata's ``sgld`` object); the names and defaults of
    ``Engine.sample``'s. Unknown fields are refused with their name; no coercion of "5" into 5."""
    model_config = ConfigDict(extra="forbid", strict=True)
    seed: int
    steps: int
    cfg: float
    sampler: str = DEFAULT_SAMPLER
    scheduler: str = DEFAULT_SCHEDULER
    denoise: float = DEFAULT_DENOISE
    shift: float = DEFAULT_SHIFT
    batch_index: Optional[List[int]] = None
    cache: Union[str, dict, None] = None


def _bad_body(message: str) -> ApiError:
    return ApiError(400, f"the body of {PATH} must be safetensors bytes (latent, cond, optional uncond, noise_mask, "
                         f"sigmas; settings in the metadata key '{METADATA_KEY}'): {message}", code="invalid_body")


def _header(body: bytes) -> dict:
    """The safetensors header, read strictly (its length, JSON without repeated keys) before any tensor is."""
    if len(body) < 8:
        raise _bad_body(f"{len(body)} bytes is too short")
    size = int.from_bytes(body[:8], "little")
    if size < 2 or body[8:9] != b"{":
        raise _bad_body("no safetensors header at the start (a pickle or another format?)")
    if size > MAX_HEADER:
        raise _bad_body(f"its header is {size} bytes, more than the {MAX_HEADER} this endpoint reads (three tensors "
                        "and the settings need a few hundred)")
    if size > len(body) - 8:
        raise _bad_body(f"its header length {size} does not fit the {len(body)}-byte body (a truncated body?)")
    try:
        return load_json_object(body[8:8 + size], "the safetensors header")
    except CheckpointError as e:
        raise _bad_body(str(e)) from None


def _cache(value) -> Optional[CacheConfig]:
    if value is None or isinstance(value, str):
        return parse_cache(value)
    try:
        return config_from_dict(value)
    except (CacheConfigError, TypeError, ValueError) as e:
        raise bad_field("cache", f"cache: {e}") from None


def parse_sample(body: bytes) -> Job:
    """The body as a Job (its on_step set later); a 400 naming what is wrong."""
    header = _header(body)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise _bad_body(f"'__metadata__' must be a JSON object of strings (got {json.dumps(metadata)[:40]})")
    unknown = sorted(set(header) - set(TENSORS))
    if unknown:
        raise _bad_body(f"unknown tensor(s) {', '.join(unknown)[:200]}")
    for name in ("latent", "cond"):
        if name not in header:
            raise _bad_body(f"the tensor '{name}' is missing")
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") != "F32":
            raise _bad_body(f"the tensor '{name}' must be float32 (F32), not {info.get('dtype') if isinstance(info, dict) else info!r:.20}")
    if METADATA_KEY not in metadata:
        raise _bad_body(f"the metadata key '{METADATA_KEY}' (the run's settings as JSON) is missing")
    try:
        settings = parse(SampleSettings, load_json_object(metadata[METADATA_KEY], f"metadata '{METADATA_KEY}'"))
    except CheckpointError as e:
        raise _bad_body(str(e)) from None
    try:
        tensors = load_tensors(body)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise _bad_body(str(e)[:200]) from None
    return Job(tensors["latent"], tensors["cond"], tensors.get("uncond"), settings.seed, settings.steps, settings.cfg,
               sampler=settings.sampler, scheduler=settings.scheduler, denoise=settings.denoise, shift=settings.shift,
               sigmas=tensors.get("sigmas"), noise_mask=tensors.get("noise_mask"), batch_index=settings.batch_index,
               cache=_cache(settings.cache))


def admitted_samples(job: Job, settings) -> Tuple[int, int]:
    """(the job's samples, the noise draws its batch_index implies), both counted against the server's admission
    (the draws only while the job is prepared); a 400 naming --max-batch for a batch that cannot share one forward
    (a single sample always can), or the limit on batch_index, before any of it is allocated or drawn."""
    latent = job.latent
    samples = latent.shape[0] if latent.dim() == 4 else 1  # another shape is prepare's 400
    rows = samples * (2 if cfg_on(job.cfg, job.uncond) else 1)
    if samples > 1 and rows > settings.max_batch:
        cfg = f" (twice with CFG: {rows} per model call)" if rows > samples else ""
        raise ApiError(400, f"the latent is a batch of {samples} samples{cfg}, more than this server's --max-batch "
                            f"{settings.max_batch} samples per forward: send at most {settings.max_batch} samples "
                            f"per request{' with CFG counting twice' if cfg else ''}, or raise --max-batch",
                       param="latent", code="batch_too_large")
    draws = max(job.batch_index) + 1 if job.batch_index else 0
    most = settings.max_batch + settings.max_queue
    if draws > most:
        raise ApiError(400, f"batch_index {draws - 1} means drawing the seed's noise for {draws} samples; this server "
                            f"draws at most {most} (--max-batch + --max-queue): batch_index values from 0 to {most - 1}",
                       param="batch_index", code="batch_index_too_large")
    return samples, draws


def _line(event: dict) -> bytes:
    return (json.dumps(event) + "\n").encode()


def latent_bytes(latent: torch.Tensor) -> str:
    return base64.b64encode(save_tensors({"latent": latent.contiguous()})).decode("ascii")


def sample_router(server) -> APIRouter:
    """The route, built from the server (engine/serve/server.py's ``ImageServer``): the job admitted as its samples
    (``admitted_samples``) against the generations' bound, under their shared gate while it runs, on their
    batcher."""
    router = APIRouter()

    @router.post(PATH)
    async def sample(request: Request):
        job = await asyncio.to_thread(parse_sample, await request.body())
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_step(step: int, total: int) -> None:  # the job's thread
            loop.call_soon_threadsafe(events.put_nowait, {"step": step, "total": total})
        job.on_step = on_step
        samples, draws = admitted_samples(job, server.settings)
        held = max(samples, draws)  # while prepared: the noise draws batch_index implies, if more than the samples
        server.admit(held)
        shared = server.gate.shared()
        try:
            await shared.__aenter__()
            try:
                future, = await server.submit([job])  # prepared off the event loop
            except BaseException:
                await shared.__aexit__(None, None, None)
                raise
        except BaseException:
            server.release(held)
            raise
        server.release(held - samples)  # the noise is drawn: the job holds its own samples
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        return _Stream(_stream(server, job, future, events, shared, samples), media_type="application/x-ndjson")

    return router


def _shutting_down() -> dict:
    return {"status": 503, **ApiError(503, "the server is shutting down; the run was cancelled", "server_error",
                                      code="shutting_down").body()}


class _Stream(StreamingResponse):
    """A stream that, cancelled by uvicorn past --shutdown-grace, still ends whole with the 503 line (as the
    generations get their 503): the client reads a last line, not a cut chunked body; nothing is logged."""

    async def __call__(self, scope, receive, send):
        started, ended = False, False

        async def tracked(message):
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            await send(message)
        try:
            await super().__call__(scope, receive, tracked)
        except asyncio.CancelledError:  # the stream's own cleanup (the job cancelled, its place freed) has run
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not ended:
                await send({"type": "http.response.body", "body": _line(_shutting_down()), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _stream(server, job, future, events, shared, samples: int):
    """The progress lines, then the result's; whatever ends it (the end, a failure, the deadline, the client
    leaving: the stream is cancelled), the job is cancelled and its place freed."""
    request_timeout = server.settings.request_timeout
    deadline = time.monotonic() + request_timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                yield _line({"status": 503, **ApiError(503, f"the run took longer than --request-timeout "
                                                            f"{request_timeout:g} s; it was cancelled", "server_error",
                                                       code="timeout").body()})
                return
            try:
                event = await asyncio.wait_for(events.get(), min(KEEPALIVE_S, left))
            except asyncio.TimeoutError:
                yield b"\n"
                continue
            if event is None:
                break
            yield _line(event)
        yield _line(_outcome(job, future, server.metrics))
    finally:
        if not future.done():
            server.batcher.cancel(future)
        await shared.__aexit__(None, None, None)
        server.release(samples)


def _outcome(job, future, metrics) -> dict:
    if future.cancelled():
        return _shutting_down()
    error = future.exception()
    if error is not None:
        status, kind = (400, "invalid_request_error") if isinstance(error, USER_ERRORS) else (500, "server_error")
        return {"status": status, **ApiError(status, f"{type(error).__name__}: {error}"[:500] if status == 500 else
                                             str(error), kind, code="run_failed").body()}
    metrics.images.inc()
    stats = getattr(future, "run_stats", None) or {}
    return {"latent": latent_bytes(future.result()), "model_calls": stats.get("model_calls"),
            "calls_computed": stats.get("calls_computed"), "timeline": [bool(c) for c in job.stats.step_mask],
            "warnings": list(job.stats.warnings) + list(job.stats.cache.get("warnings", []))}
