"""`sgld serve --ray`: the server as a Ray Serve application (pip install '.[cluster]'), docs/serve.md.

* ``Engine``: one whole `sgld serve` per replica (its engine, queue, step-level batcher, routes and metrics: the app
  ``make_app`` builds, called in-process through ASGI), GPUs or CPUs declared per replica, autoscaling bounds as the
  deployment's. A request naming LoRAs carries them as Serve's multiplexed model id, so Serve's router sends it
  preferably to a replica that holds them (``@serve.multiplexed`` records which).
* ``Front``: the ingress, engine/serve/front.py's app (the same routes, guard and error shapes as one server and the
  ``--dp-size`` front) over a ``RayReplicas`` backend.
* ``Board``: one small actor: the replicas' metrics and health as each last reported them, and the LoRA changes made
  so far (each replica makes the ones it has not made before its next request; a replacement makes them all).

Faults: Serve's router keeps requests that have not started; one whose replica died while it ran is sent once more
(the front fixed its seed: the same picture); a stream cut after it began ends with a 503 line; Serve starts a new
replica and ``/health`` says what is up.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from .front import RETRY_AFTER_S, create_front_app
from .protocol import ApiError
from .replicas import clears_all, dumps

GONE = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached: its request was not answered
REPORT_S = 2.0  # how often a replica reports its metrics to the board between requests
FRESH_S = 10.0  # a replica not heard from for this long is no longer listed as up
HEALTH_CHECK_S = 2.0  # Serve's health check of a replica (a replica that failed a LoRA change says so)
LORA_SETS_PER_REPLICA = 16  # LoRA sets Serve's router remembers per replica (the data is the server's LoRA cache's)
APP_NAME = "sgld"


@ray.remote(num_cpus=0)
class Board:
    """What the front knows past one request: the replicas' last reports, the LoRA changes, deaths seen."""

    def __init__(self):
        self.replicas: Dict[str, dict] = {}
        self.changes: List[Tuple[int, str, bytes]] = []
        self.seq = 0
        self.deaths: List[float] = []  # when a request found its replica dead, not yet replaced
        self.replaced_s: List[float] = []

    def report(self, actor: str, info: dict) -> None:
        if actor not in self.replicas and self.deaths:  # a new replica after a death: its replacement
            self.replaced_s.append(time.time() - self.deaths.pop(0))
        self.replicas[actor] = {**self.replicas.get(actor, {}), **info, "seen": time.time()}  # a part keeps the rest

    def died(self, actor: Optional[str]) -> None:
        if self.replicas.pop(actor or "", None) is not None or actor is None:
            self.deaths.append(time.time())

    def record(self, path: str, body: bytes) -> List[Tuple[int, str, bytes]]:
        """A change every replica is to make (an unset of every LoRA makes those before it moot); the log."""
        if clears_all(path, body):
            self.changes.clear()
        self.seq += 1
        self.changes.append((self.seq, path, body))
        return self.changes

    def state(self) -> dict:
        now = time.time()
        up = {a: r for a, r in self.replicas.items() if now - r["seen"] < FRESH_S and "rank" in r}  # a whole report
        return {"replicas": up, "changes": self.changes, "seq": self.seq,
                "last_replacement_s": round(self.replaced_s[-1], 3) if self.replaced_s else None,
                "restarts": len(self.replaced_s)}


def board_of(app_name: str):
    return Board.options(name=f"{app_name}-board", namespace="serve", get_if_exists=True,
                         lifetime="detached").remote()


class Lifespan:
    """An ASGI app's lifespan run by hand (no server around it): startup at ``start``, shutdown at ``stop``."""

    def __init__(self, app):
        self.app, self.inbox, self.outbox = app, asyncio.Queue(), asyncio.Queue()
        self.task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, self.inbox.get,
                                            self.outbox.put))

    async def start(self) -> "Lifespan":
        await self.inbox.put({"type": "lifespan.startup"})
        await self.outbox.get()
        return self

    async def stop(self) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await asyncio.gather(self.task, return_exceptions=True)


async def asgi_messages(app, method: str, path: str, headers: Dict[str, str], body: Optional[bytes]):
    """One HTTP request through ``app`` in this process: its ``http.response.*`` messages as they come. The request
    reads as disconnected once the caller stops reading (the server cancels what it was doing for it)."""
    body = body or b""
    sent, gone, out = [False], asyncio.Event(), asyncio.Queue()

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    route, _, query = path.partition("?")
    raw = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()
           if k.lower() != "content-length"] + [(b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": route, "raw_path": route.encode(), "query_string": query.encode(), "root_path": "",
             "headers": raw, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    task = asyncio.create_task(app(scope, receive, out.put))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            yield message
    finally:
        gone.set()
        await asyncio.gather(task, return_exceptions=True)


async def asgi_call(app, method: str, path: str, headers: Dict[str, str], body: Optional[bytes] = None):
    """(status, headers, body) of one request through ``app``."""
    status, passed, chunks = 500, {}, []
    async for m in asgi_messages(app, method, path, headers, body):
        if m["type"] == "http.response.start":
            status, passed = m["status"], _headers(m)
        elif m["type"] == "http.response.body":
            chunks.append(m.get("body", b""))
    return status, passed, b"".join(chunks)


def _headers(message) -> Dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", [])
            if k.lower() in (b"content-type", b"retry-after")}


@serve.deployment(name="Engine", health_check_period_s=HEALTH_CHECK_S)
class Engine:
    """One `sgld serve` as a Serve replica: ``make_app()`` -> its ASGI app (model loaded, batcher running)."""

    async def __init__(self, make_app: Callable, app_name: str = APP_NAME, cwd: Optional[str] = None):
        if cwd and os.path.isdir(cwd):  # the command's relative file names, where the folder is shared
            os.chdir(cwd)
        self.app = await asyncio.get_running_loop().run_in_executor(None, make_app)
        self.lifespan = await Lifespan(self.app).start()
        self.app_name, self.board = app_name, board_of(app_name)
        context = serve.get_replica_context()
        self.rank = context.rank.rank if context.rank is not None else 0
        self.actor = ray.get_runtime_context().get_actor_id()
        self.made, self.changing, self.broken = 0, asyncio.Lock(), None
        self.served, self.loras, self.in_flight = 0, set(), 0
        await self.report()
        self.reporter = asyncio.create_task(self._report_every())

    @serve.multiplexed(max_num_models_per_replica=LORA_SETS_PER_REPLICA)
    async def holding(self, lora_set: str) -> str:
        """Serve's record that this replica holds ``lora_set`` (its router prefers it for such requests)."""
        return lora_set

    async def call(self, method: str, path: str, headers: Dict[str, str], body: Optional[bytes],
                   changes: Sequence = (), change_seq: int = 0):
        """(status, headers, body, rank) of one request after the LoRA changes this replica has not made;
        ``change_seq``: this request is that change."""
        refusal = await self._catch_up(changes)
        if refusal is not None:
            return (*refusal, self.rank)
        lora_set = serve.get_multiplexed_model_id()
        if lora_set:
            await self.holding(lora_set)
        self.in_flight += 1
        try:
            await self.report(whole=False)
            if change_seq:
                async with self.changing:
                    status, passed, data = await asgi_call(self.app, method, path, headers, body)
                    if status == 200:
                        self.made = change_seq
            else:
                status, passed, data = await asgi_call(self.app, method, path, headers, body)
        finally:
            self.in_flight -= 1
        if status == 200 and path.startswith("/v1/images"):
            self.served += 1
            self.loras |= set(lora_set.split("+")) if lora_set else set()
        await self.report()
        return status, passed, data, self.rank

    async def stream(self, method: str, path: str, headers: Dict[str, str], body: Optional[bytes],
                     changes: Sequence = ()):
        """A streamed answer: ("start", status, content type, rank), then ("line", bytes) chunks."""
        refusal = await self._catch_up(changes)
        if refusal is not None:
            yield ("start", refusal[0], "application/json", self.rank)
            yield ("line", refusal[2])
            return
        async for m in asgi_messages(self.app, method, path, headers, body):
            if m["type"] == "http.response.start":
                yield ("start", m["status"], _headers(m).get("content-type", "application/x-ndjson"), self.rank)
            elif m["type"] == "http.response.body" and m.get("body"):
                yield ("line", m["body"])
        await self.report()

    async def _catch_up(self, changes: Sequence) -> Optional[tuple]:
        """The LoRA changes after the last one made here, in order; a refusal (a 503) if one fails."""
        if self.broken is None and any(seq > self.made for seq, _, _ in changes):
            async with self.changing:
                for seq, path, body in changes:
                    if seq <= self.made:
                        continue
                    status, _, data = await asgi_call(self.app, "POST", path, {"content-type": "application/json"},
                                                      body)
                    if status != 200:
                        self.broken = f"replica {self.rank} could not make the LoRA change {path}: {data[:300]!r}"
                        break
                    self.made = seq
        if self.broken is None:
            return None
        err = ApiError(503, self.broken + "; it is being replaced, ask again", "server_error", code="replica_broken")
        return 503, {"content-type": "application/json", "retry-after": str(RETRY_AFTER_S)}, dumps(err.body())

    async def report(self, whole: bool = True) -> None:
        """This replica's state and metrics (the server's own exposition, no request counted) to the board; a board
        gone (its node lost) is made again and hears from the next report. Not ``whole``: the count in flight only
        (a request's start, which must not wait for the exposition to be written)."""
        info = {"in_flight": self.in_flight}
        if whole:
            info.update(rank=self.rank, pid=os.getpid(), node=ray.get_runtime_context().get_node_id()[:12],
                        served=self.served, loras=sorted(self.loras), metrics=self.app.metrics.render()[0].decode())
        try:
            await self.board.report.remote(self.actor, info)
        except GONE:
            self.board = board_of(self.app_name)

    async def _report_every(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            await self.report()

    def check_health(self) -> None:
        if self.broken:
            raise RuntimeError(self.broken)

    async def __del__(self):  # Serve's graceful stop: the batcher and the engine's workers
        self.reporter.cancel()
        await self.lifespan.stop()



class RayReplicas:
    """front.py's backend over the Engine replicas: Serve's router picks (a LoRA set by its multiplexed id), the
    board remembers; a request whose replica died is sent once more."""

    def __init__(self, engine, board, timeout: float, target: int):
        self.engine, self.board, self.timeout, self.target = engine, board, timeout, target
        self.retried = 0
        self.changes: list = []  # the board's log, kept here too: this front is its only writer
        self.seq = 0
        self.changing = asyncio.Lock()

    async def start(self) -> None:
        state = await self.board.state.remote()
        self.changes, self.seq = state["changes"], state["seq"]

    async def _answer(self, method, path, body, headers, lora_set: str = "", change_seq: int = 0):
        handle = self.engine.options(multiplexed_model_id=lora_set) if lora_set else self.engine
        for _ in range(2):
            response = handle.call.remote(method, path, headers, body, self.changes, change_seq)
            try:
                return await asyncio.wait_for(_awaited(response), self.timeout)
            except GONE as e:
                self.retried += 1
                await self.board.died.remote(getattr(e, "actor_id", None))
            except asyncio.TimeoutError:  # no replica took it in time (none up, or all busy past the timeout)
                response.cancel()
                return None
        return None

    async def send(self, method, path, body, headers, images: int = 1, loras: frozenset = frozenset()):
        return await self._answer(method, path, body, headers, "+".join(sorted(loras)))

    async def open_stream(self, path, body, headers):
        for _ in range(2):
            stream = self.engine.options(stream=True).stream.remote("POST", path, headers, body, self.changes)
            try:
                _, status, content_type, rank = await stream.__anext__()
            except GONE as e:
                self.retried += 1
                await self.board.died.remote(getattr(e, "actor_id", None))
                continue
            return status, content_type, rank, _items(stream), lambda: None
        return None

    async def change(self, path, body, headers):
        async with self.changing:
            answer = await self._answer("POST", path, body, headers, change_seq=self.seq + 1)
            if answer is not None and answer[0] == 200:
                self.seq += 1
                self.changes = await self.board.record.remote(path, body)
            return answer

    async def metrics_texts(self) -> List[str]:
        return [r["metrics"] for r in (await self.board.state.remote())["replicas"].values()]

    async def describe(self) -> dict:
        state = await self.board.state.remote()
        rows = sorted(state["replicas"].values(), key=lambda r: r["rank"])
        up = len(rows)
        return {"status": "ok" if up >= self.target else ("degraded" if up else "down"),
                "replicas": [{"index": r["rank"], "status": "up", "pid": r["pid"], "node": r["node"],
                              "served": r["served"], "loras": r["loras"], "in_flight": r["in_flight"]} for r in rows],
                "retried": self.retried, "restarts": state["restarts"],
                "last_replacement_s": state["last_replacement_s"]}


async def _awaited(response):
    return await response


async def _items(stream):
    """A replica's streamed lines; ("cut", why) if it died after the stream began."""
    try:
        async for item in stream:
            yield item
    except GONE as e:
        yield ("cut", f"{type(e).__name__}")


@serve.deployment(name="Front", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Front:
    """The ingress: front.py's app over the Engine replicas. One replica (it holds the LoRA log's writer)."""

    async def __init__(self, engine, settings: dict, target: int, timeout: float, app_name: str = APP_NAME):
        self.backend = RayReplicas(engine, board_of(app_name), timeout, target)
        await self.backend.start()
        self.settings = settings

    def __serve_build_asgi_app__(self):
        return create_front_app(self.backend, **self.settings)


def application(make_app: Callable, replicas: int, engine_options: dict, front_settings: dict, timeout: float,
                autoscale: Optional[Tuple[int, int]] = None, cwd: Optional[str] = None, app_name: str = APP_NAME):
    """The Serve application: ``replicas`` Engine replicas (or ``autoscale`` = (min, max) of them) with
    ``engine_options`` (``ray_actor_options``, ``max_ongoing_requests``, ``graceful_shutdown_timeout_s``) behind
    one Front with ``front_settings`` (api_key, max_body_bytes, body_timeout)."""
    scale = ({"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                     "target_ongoing_requests": engine_options.get("max_ongoing_requests", 8)}}
             if autoscale else {"num_replicas": replicas})
    engine = Engine.options(**scale, **engine_options).bind(make_app, app_name, cwd)
    return Front.bind(engine, front_settings, autoscale[0] if autoscale else replicas, timeout, app_name)


def remove(app_name: str = APP_NAME) -> None:
    """The application deleted (Serve drains its replicas) and its board with it."""
    try:
        serve.delete(app_name)
    finally:
        try:
            ray.kill(ray.get_actor(f"{app_name}-board", namespace="serve"))
        except ValueError:  # never made
            pass
