"""What every request passes before the handlers, as pure ASGI (a BaseHTTPMiddleware would hide client
disconnects from the handlers): the API key (401), the body size (413), checked on Content-Length before
any byte is read and on the bytes actually received, so a chunked or lying client is bounded too, and the
body's time (408 past --body-timeout seconds for the whole body: a trickling client holds no connection)."""
from __future__ import annotations

import asyncio
import hmac
import json
from typing import Iterable, Optional

from .protocol import error_body


async def send_error(send, status: int, body: dict, headers: Iterable = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """``api_key`` (None: none asked) is wanted as ``Authorization: Bearer KEY`` on every path but ``open_paths``
    (health checks and metrics scrapers); bodies are at most ``max_body_bytes``, in at most ``body_timeout`` s."""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int, open_paths: Iterable[str],
                 body_timeout: float):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.open_paths, self.body_timeout = frozenset(open_paths), body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in self.open_paths and not self._authorized(headers):
            return await send_error(send, 401, error_body(
                "missing or wrong API key: send 'Authorization: Bearer KEY' with the server's --api-key",
                code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(send)
        chunks, received = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:  # the whole body (bounded), then replayed to the app as one message
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                return await send_error(send, 408, error_body(
                    f"the request body took longer than --body-timeout {self.body_timeout:g} s", code="request_timeout"),
                    [(b"connection", b"close")])
            if message["type"] != "http.request":
                return  # the client left while sending
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_body_bytes:
                return await self._too_large(send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the real channel: http.disconnect still reaches the handler
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def _too_large(self, send) -> None:
        await send_error(send, 413, error_body(f"the request body is larger than --max-body-bytes "
                                               f"{self.max_body_bytes} bytes", code="request_too_large"),
                         [(b"connection", b"close")])
