"""The front of `sgld serve --dp-size N` and `--ray`: the server's API over replicas, the same routes, guard (API
key, body limits) and error shapes as one server's (engine/serve/app.py). Where the replicas are is the backend's:
``LocalReplicas`` (processes on this machine, engine/serve/replicas.py) or ray_app.py's ``RayReplicas``."""
from __future__ import annotations

import asyncio
import http.client
from typing import AsyncIterator, Callable, List, Optional, Protocol, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling import MAX_SEED
from .app import OPEN_PATHS, read_json
from .guard import Guard
from .protocol import ApiError, error_body
from .replicas import ReplicaGone, Replicas, dumps, fixed_seed, images_of, lora_names, summed_metrics

RETRY_AFTER_S = 5  # a 503 for want of a live replica: when to ask again (a replacement takes seconds)
FORWARDED = ("content-type", "authorization")  # the client's headers a replica needs
GONE = (ReplicaGone, OSError, http.client.HTTPException)  # a local replica's connection failed

Answer = Tuple[int, dict, bytes, int]  # status, passed headers, body, the replica's index
# status, content type, replica index, ("line", bytes) / ("cut", why) items, called when the stream ends
Stream = Tuple[int, str, int, AsyncIterator, Callable[[], None]]


class Backend(Protocol):
    """Where the front's requests go. Each returns None when no replica is up to take it (the front's 503)."""

    async def send(self, method: str, path: str, body: Optional[bytes], headers: dict, images: int = 1,
                   loras: frozenset = frozenset()) -> Optional[Answer]: ...
    async def open_stream(self, path: str, body: bytes, headers: dict) -> Optional[Stream]: ...
    async def change(self, path: str, body: bytes, headers: dict) -> Optional[Answer]: ...  # on every replica
    async def metrics_texts(self) -> List[str]: ...
    async def describe(self) -> dict: ...  # status, replicas, retried, restarts, last_replacement_s


def forwarded(request: Request) -> dict:
    """The client's headers a replica needs (``FORWARDED``)."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}


def create_front_app(backend: Backend, api_key, max_body_bytes: int, body_timeout: float):
    app = FastAPI(title="sgld serve (replicas)", docs_url=None, redoc_url=None, openapi_url=None)

    def answered(a: Optional[Answer]) -> Response:
        if a is None:
            return JSONResponse(error_body("no replica is up to take the request; ask again shortly", "server_error",
                                           code="no_replica"), status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        status, headers, data, index = a
        return Response(data, status_code=status, headers={**headers, "x-sgld-replica": str(index)})

    async def routed(request: Request, path: str, body=None, images: int = 1, loras: frozenset = frozenset()):
        return answered(await backend.send(request.method, path, body, forwarded(request), images, loras))

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
        opened = await backend.open_stream("/v1/sample", await request.body(), forwarded(request))
        if opened is None:
            return answered(None)
        status, content_type, index, items, finished = opened
        return StreamingResponse(_relay(items, finished), status_code=status, media_type=content_type,
                                 headers={"x-sgld-replica": str(index)})

    @app.get("/v1/models")
    async def models(request: Request):
        return await routed(request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return await routed(request, request.url.path)

    @app.get("/v1/list_loras")
    async def list_loras(request: Request):
        return await routed(request, "/v1/list_loras")

    @app.get("/health_generate")
    async def health_generate(request: Request):
        return await routed(request, "/health_generate")

    @app.post("/v1/set_lora")
    async def set_lora(request: Request):
        return answered(await backend.change("/v1/set_lora", await request.body(), forwarded(request)))

    @app.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        return answered(await backend.change("/v1/unset_lora", await request.body(), forwarded(request)))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        state = await backend.describe()
        return JSONResponse(state, status_code=200 if state["status"] != "down" else 503)

    @app.get("/metrics")
    async def scrape():
        texts = await backend.metrics_texts()
        state = await backend.describe()
        own = ["# HELP sgld_replicas_up Replicas answering requests", "# TYPE sgld_replicas_up gauge",
               f"sgld_replicas_up {sum(r['status'] == 'up' for r in state['replicas'])}",
               "# HELP sgld_replica_restarts_total Replicas started again after they died",
               "# TYPE sgld_replica_restarts_total counter", f"sgld_replica_restarts_total {state['restarts']}",
               "# HELP sgld_requests_resent_total Requests sent to a second replica after theirs died",
               "# TYPE sgld_requests_resent_total counter", f"sgld_requests_resent_total {state['retried']}"]
        return Response(summed_metrics(texts) + "\n".join(own) + "\n", media_type="text/plain; version=0.0.4")

    @app.exception_handler(404)
    async def _not_found(request, e):
        return JSONResponse(error_body(f"no endpoint {request.method} {request.url.path}", code="not_found"),
                            status_code=404)

    return Guard(app, api_key, max_body_bytes, OPEN_PATHS, body_timeout)


async def _relay(items: AsyncIterator, finished: Callable[[], None]):
    """The replica's lines as they come; a stream cut by the replica's death ends with a 503 line."""
    try:
        async for item in items:
            if item[0] == "line":
                yield item[1]
            elif item[0] == "cut":
                yield dumps({"status": 503, **ApiError(503, "the replica running this stream stopped; run it again",
                                                       "server_error", code="replica_gone").body()}) + b"\n"
    finally:
        finished()


class LocalReplicas:
    """The backend of `--dp-size`: ``Replicas``' processes on this machine, reached over HTTP in its thread pool;
    the front's own choice of replica (``Replicas.pick``), a request whose replica died sent once more."""

    def __init__(self, replicas: Replicas):
        self.replicas = replicas
        self.changing = asyncio.Lock()  # one LoRA change at a time: every replica sees them in the same order

    async def _call(self, r, method, path, body=None, headers=None, timeout=None):
        pool = self.replicas.pool
        return await asyncio.get_running_loop().run_in_executor(
            pool, lambda: self.replicas.call(r, method, path, body, headers, timeout))

    async def _once_more_if_gone(self, images, loras, attempt):
        """``attempt(replica)`` on the least busy replica (``Replicas.pick``), once more on another when that one was
        gone (``GONE``); None when no replica is left to ask."""
        tried = []
        for _ in range(2):
            r = self.replicas.pick(images, loras, tried)
            if r is None:
                break
            tried.append(r.index)
            try:
                return await attempt(r)
            except GONE:
                self.replicas.retried += 1
        return None

    async def send(self, method, path, body, headers, images=1, loras=frozenset()):
        async def attempt(r):
            ok = False
            try:
                status, passed, data = await self._call(r, method, path, body, headers)
                ok = status == 200
                return status, passed, data, r.index
            finally:
                self.replicas.done(r, images, loras, ok)
        return await self._once_more_if_gone(images, loras, attempt)

    async def open_stream(self, path, body, headers):
        loop = asyncio.get_running_loop()

        async def attempt(r):
            lines: asyncio.Queue = asyncio.Queue()
            work = loop.run_in_executor(self.replicas.pool, self.replicas.stream, r, path, body, headers, lines, loop)
            first = await lines.get()
            if first is None:  # gone before the answer began
                self.replicas.done(r, 1, frozenset(), False)
                await asyncio.gather(work, return_exceptions=True)
                raise ReplicaGone(r.index)
            _, status, content_type = first

            def finished():
                self.replicas.done(r, 1, frozenset(), True)
                work.add_done_callback(lambda f: f.exception())  # the reader thread ends with the connection
            return status, content_type, r.index, _drained(lines), finished
        return await self._once_more_if_gone(1, frozenset(), attempt)

    async def change(self, path, body, headers):
        """A LoRA change on every replica, one at a time, the first's answer returned: one it refuses changes none;
        a replica that fails a change the first made is replaced (its replacement replays every change)."""
        async with self.changing:
            live = [r for r in self.replicas.replicas if r.state == "up"]
            first = None
            while live and first is None:
                try:
                    first = (live[0], *await self._call(live[0], "POST", path, body, headers))
                except GONE:
                    live.pop(0)  # gone: the watcher replaces it, with the changes made so far
            if first is None:
                return None
            r0, status, passed, data = first
            if status == 200:
                self.replicas.record_change(path, body)
                for r in live[1:]:
                    try:
                        other = (await self._call(r, "POST", path, body, headers))[0]
                    except GONE:
                        other = None
                    if other != 200 and r.proc is not None:
                        r.proc.kill()  # the watcher starts it again, with every change replayed
            return status, passed, data, r0.index

    async def metrics_texts(self):
        texts = []
        for r in [r for r in self.replicas.replicas if r.state == "up"]:
            try:
                status, _, data = await self._call(r, "GET", "/metrics", timeout=10.0)
            except GONE:
                continue
            if status == 200:
                texts.append(data.decode("utf-8"))
        return texts

    async def describe(self):
        return self.replicas.describe()


async def _drained(lines: asyncio.Queue):
    while (item := await lines.get()) is not None:
        yield item
