"""The front of `sgld serve --dp-size N` (engine/serve/replicas.py): the server's API over N replicas, the same
routes, guard (API key, body limits) and error shapes as one server's (engine/serve/app.py)."""
from __future__ import annotations

import asyncio
import http.client

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling import MAX_SEED
from .app import OPEN_PATHS, read_json
from .guard import Guard
from .protocol import ApiError, error_body
from .replicas import ReplicaGone, Replicas, dumps, fixed_seed, images_of, lora_names, summed_metrics

RETRY_AFTER_S = 5  # a 503 for want of a live replica: when to ask again (a replacement takes seconds)
FORWARDED = ("content-type", "authorization")  # the client's headers a replica needs


def forwarded(request: Request) -> dict:
    """The client's headers a replica needs (``FORWARDED``)."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}


def create_front_app(replicas: Replicas, api_key, max_body_bytes: int, body_timeout: float):
    app = FastAPI(title="sgld serve (replicas)", docs_url=None, redoc_url=None, openapi_url=None)
    loop_of = asyncio.get_running_loop

    async def call(r, method, path, body=None, headers=None, timeout=None):
        return await loop_of().run_in_executor(replicas.pool, lambda: replicas.call(r, method, path, body, headers,
                                                                                    timeout))

    def answer(r, status, headers, data) -> Response:
        return Response(data, status_code=status, headers={**headers, "x-sgld-replica": str(r.index)})

    def no_replica() -> JSONResponse:
        return JSONResponse(error_body("no replica is up to take the request; ask again shortly", "server_error",
                                       code="no_replica"), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def routed(request: Request, path: str, body: bytes, images: int = 1, loras: frozenset = frozenset()):
        """One request through a chosen replica, sent once more to another if its replica died before answering."""
        headers = forwarded(request)
        tried = []
        for _ in range(2):
            r = replicas.pick(images, loras, tried)
            if r is None:
                break
            tried.append(r.index)
            answered = False
            try:
                status, passed, data = await call(r, request.method, path, body, headers)
                answered = status == 200
                return answer(r, status, passed, data)
            except (ReplicaGone, OSError, http.client.HTTPException):
                replicas.retried += 1
            finally:
                replicas.done(r, images, loras, answered)
        return no_replica()

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        body = fixed_seed(await read_json(request), MAX_SEED)  # a second sending makes the same picture
        return await routed(request, "/v1/images/generations", dumps(body), images_of(body), lora_names(body))

    @app.post("/v1/sample")
    async def sample(request: Request):
        """The remote KSampler's stream: sent once more if its replica died before the first line; cut after it,
        it ends with a 503 line as a draining server's stream does."""
        raw = await request.body()
        headers = forwarded(request)
        tried = []
        for _ in range(2):
            r = replicas.pick(1, frozenset(), tried)
            if r is None:
                break
            tried.append(r.index)
            lines: asyncio.Queue = asyncio.Queue()
            work = loop_of().run_in_executor(replicas.pool, replicas.stream, r, "/v1/sample", raw, headers, lines,
                                             loop_of())
            first = await lines.get()
            if first is None:  # gone before the answer began
                replicas.done(r, 1, frozenset(), False)
                replicas.retried += 1
                await asyncio.gather(work, return_exceptions=True)
                continue
            _, status, content_type = first
            return StreamingResponse(_relay(lines, work, lambda r=r: replicas.done(r, 1, frozenset(), True)),
                                     status_code=status, media_type=content_type,
                                     headers={"x-sgld-replica": str(r.index)})
        return no_replica()

    @app.get("/v1/models")
    async def models(request: Request):
        return await routed(request, "/v1/models", None)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return await routed(request, request.url.path, None)

    @app.get("/v1/list_loras")
    async def list_loras(request: Request):
        return await routed(request, "/v1/list_loras", None)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        return await routed(request, "/health_generate", None)

    changing = asyncio.Lock()  # one LoRA change at a time: every replica sees them in the same order

    async def change_loras(request: Request, path: str):
        """A LoRA change on every replica, the first's answer returned: one it refuses changes none; a replica
        that fails a change the first made is replaced (its replacement replays every change)."""
        body = await request.body()
        headers = forwarded(request)
        async with changing:
            live = [r for r in replicas.replicas if r.state == "up"]
            first = None
            while live and first is None:
                try:
                    first = (live[0], *await call(live[0], "POST", path, body, headers))
                except (ReplicaGone, OSError, http.client.HTTPException):
                    live.pop(0)  # gone: the watcher replaces it, with the changes made so far
            if first is None:
                return no_replica()
            r0, status, passed, data = first
            if status == 200:
                replicas.record_change(path, body)
                for r in live[1:]:
                    try:
                        other = (await call(r, "POST", path, body, headers))[0]
                    except (ReplicaGone, OSError, http.client.HTTPException):
                        other = None
                    if other != 200 and r.proc is not None:
                        r.proc.kill()  # the watcher starts it again, with every change replayed
            return answer(r0, status, passed, data)

    @app.post("/v1/set_lora")
    async def set_lora(request: Request):
        return await change_loras(request, "/v1/set_lora")

    @app.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        return await change_loras(request, "/v1/unset_lora")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        state = replicas.describe()
        return JSONResponse(state, status_code=200 if state["status"] != "down" else 503)

    @app.get("/metrics")
    async def scrape():
        texts = []
        for r in [r for r in replicas.replicas if r.state == "up"]:
            try:
                status, _, data = await call(r, "GET", "/metrics", timeout=10.0)
            except (ReplicaGone, OSError, http.client.HTTPException):
                continue
            if status == 200:
                texts.append(data.decode("utf-8"))
        state = replicas.describe()
        own = ["# HELP sgld_replicas_up Replicas answering requests", "# TYPE sgld_replicas_up gauge",
               f"sgld_replicas_up {sum(r['status'] == 'up' for r in state['replicas'])}",
               "# HELP sgld_replica_restarts_total Replicas started again after they died",
               "# TYPE sgld_replica_restarts_total counter",
               f"sgld_replica_restarts_total {sum(r['restarts'] for r in state['replicas'])}",
               "# HELP sgld_requests_resent_total Requests sent to a second replica after theirs died",
               "# TYPE sgld_requests_resent_total counter", f"sgld_requests_resent_total {state['retried']}"]
        return Response(summed_metrics(texts) + "\n".join(own) + "\n", media_type="text/plain; version=0.0.4")

    @app.exception_handler(404)
    async def _not_found(request, e):
        return JSONResponse(error_body(f"no endpoint {request.method} {request.url.path}", code="not_found"),
                            status_code=404)

    return Guard(app, api_key, max_body_bytes, OPEN_PATHS, body_timeout)


async def _relay(lines: asyncio.Queue, work, finished):
    """The replica's lines as they come; a stream cut by the replica's death ends with a 503 line."""
    try:
        while True:
            item = await lines.get()
            if item is None:
                break
            if item[0] == "line":
                yield item[1]
            elif item[0] == "cut":
                yield dumps({"status": 503, **ApiError(503, "the replica running this stream stopped; run it again",
                                                       "server_error", code="replica_gone").body()}) + b"\n"
    finally:
        finished()
        await asyncio.gather(work, return_exceptions=True)
