"""POST /v1/sample: one sampling run of a client's own latent and text features (the ComfyUI nodes'
remote KSampler), as a Job on the server's batcher, its progress streamed back. The run takes everything
``Engine.sample`` takes (docs/serve.md has the table).

Request: the wire format of engine/sample_wire.py (safetensors bytes: the tensors, and the settings in the
metadata key ``sgld``), decoded there; anything else is a 400.

Answer: 200 with newline-delimited JSON (application/x-ndjson), one event a line: ``{"step": i, "total": n}``
after each step; an empty line every second without one (a keepalive: clients skip it); then the last line,
``{"latent": <the request's latent shape, float32, as sample_wire.encode_latent writes it>,
"model_calls", "calls_computed", "timeline", "warnings"}`` or ``{"error": {OpenAI error}, "status": code}`` when
the run failed after the answer began. Everything checkable before the run (body, fields, shapes, a batch
past --max-batch, batch_index past the draws the server makes, a full server) is refused with its status and
the OpenAI error body instead. A client that closes the connection
cancels the job (its batcher slot is freed)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Tuple

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..errors import USER_ERRORS
from ..sample_wire import PATH, WireError, decode, encode_latent
from ..sampling import cfg_on
from .batcher import Job
from .protocol import ApiError

KEEPALIVE_S = 1.0


def parse_sample(body: bytes) -> Job:
    """The body as a Job (its on_step set later; engine/sample_wire.py decodes it); a 400 naming what is wrong."""
    try:
        return Job.of(decode(body))
    except WireError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


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
        server.admit(held)  # a full server's 429 before any file is read
        shared = server.gate.shared()
        try:
            job.lora_set, job.loras = await server.resolve_loras(job.loras), None  # names -> entries, checked (400s)
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
    return {"latent": encode_latent(future.result()), "model_calls": stats.get("model_calls"),
            "calls_computed": stats.get("calls_computed"), "timeline": [bool(c) for c in job.stats.step_mask],
            "warnings": list(job.stats.warnings) + list(job.stats.cache.get("warnings", []))}
