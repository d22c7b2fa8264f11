"""The HTTP app of ``sgld serve`` (FastAPI): OpenAI's Images API and SGLang's extras over the server's state
(``ImageServer``, engine/serve/server.py). One router per concern is built from it (images, sample:
engine/serve/sample_route.py, loras, health and metrics) and ``create_app`` puts them together under the
API-key / body guard and the metrics, with OpenAI-shaped errors."""
from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CheckpointError
from ..io.safetensors import load_json_object
from .guard import Guard
from .metrics import CLIENT_GONE
from .protocol import ApiError, SetLoraRequest, UnsetLoraRequest, error_body, parse, parse_generation
from .sample_route import sample_router
from .server import ClientGone, ImageServer, ServedModel, ServeSettings

log = logging.getLogger("sgld")

OPEN_PATHS = ("/health", "/metrics")  # no API key: load balancers and scrapers
ENDPOINTS = ("/v1/images/generations", "/v1/sample", "/v1/models", "/v1/set_lora", "/v1/unset_lora", "/v1/list_loras", "/health",
             "/health_generate", "/metrics")


def create_app(served: ServedModel, batcher, settings: ServeSettings):
    """The ASGI app over ``batcher`` (submit / cancel / close / stats): every router, OpenAI-shaped errors, the guard
    and the metrics around them; closing the app closes the batcher."""
    server = ImageServer(served, batcher, settings)
    app = FastAPI(title="sgld serve", lifespan=server.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in (images_router(server), sample_router(server), loras_router(server), health_router(server)):
        app.include_router(router)
    guarded = Guard(app, settings.api_key, settings.max_body_bytes, OPEN_PATHS, settings.body_timeout)
    return server.metrics.middleware(guarded, ENDPOINTS)


async def _api_error(request, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request, e):
    kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    message = (f"no endpoint {request.method} {request.url.path}" if kind else str(e.detail))
    return JSONResponse(error_body(message, code=kind), status_code=e.status_code)


async def _internal_error(request, e):
    log.exception("internal error on %s", request.url.path)
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}"[:500], "server_error",
                                   code="internal_error"), status_code=500)


def images_router(server: ImageServer) -> APIRouter:
    """OpenAI's Images API and its model listing."""
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generations(request: Request):
        gen = parse_generation(await read_json(request), server.served)
        try:
            return await server.answer(request, gen.n, server.generate(gen))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)  # nobody reads it; the metrics count it

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.served.id:
            raise ApiError(404, f"The model '{model_id:.80}' does not exist; this server serves '{server.served.id}'",
                           param="model", code="model_not_found")
        return server.card()

    return router


def loras_router(server: ImageServer) -> APIRouter:
    """SGLang's LoRA endpoints: each change waits for the running generations (``Gate``)."""
    router = APIRouter()

    @router.post("/v1/set_lora")
    async def set_lora(request: Request):
        return await server.change_loras(server.loras.plan_set(parse(SetLoraRequest, await read_json(request))))

    @router.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        body = await read_json(request, empty_ok=True)
        return await server.change_loras(server.loras.plan_unset(parse(UnsetLoraRequest, body)))

    @router.get("/v1/list_loras")
    async def list_loras():
        return server.loras.listing()

    return router


def health_router(server: ImageServer) -> APIRouter:
    """Health checks (open: no API key) and the Prometheus scrape."""
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health():
        return {"status": "ok"}

    @router.get("/health_generate")
    async def health_generate(request: Request):
        try:
            return await server.answer(request, 1, server.tiny_generation())
        except ClientGone:
            return Response(status_code=CLIENT_GONE)

    @router.get("/metrics")
    async def scrape():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    return router


async def read_json(request: Request, empty_ok: bool = False):
    body = await request.body()
    if not body.strip() and empty_ok:
        return {}
    try:
        return load_json_object(body, "the request body")  # the one rule: no repeated keys, no deep-nesting crash
    except CheckpointError as e:
        raise ApiError(400, str(e), code="invalid_json") from None
