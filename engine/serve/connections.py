"""Bounds on connections, below the app, where uvicorn's h11 protocol has none: a client has --header-timeout
seconds to send a request's headers (counted from its connection, or from its first byte after the previous
answer), else 408 and the connection closed; past --max-connections open connections a new one is answered
503 and closed at once. An idle keep-alive connection is uvicorn's (--keep-alive-timeout); the body's time
is the Guard's (--body-timeout), where the app reads it. docs/serve.md "Connections"."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body


def raw_answer(status: int, reason: str, body: dict, *headers: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for a client no request cycle exists for."""
    data = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(data)}",
            "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def bounded_h11(header_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol (its ``http=`` class) with the two bounds."""
    late = raw_answer(408, "Request Timeout", error_body(
        f"the request's headers took longer than --header-timeout {header_timeout:g} s", code="request_timeout"))
    full = raw_answer(503, "Service Unavailable", error_body(
        f"the server has --max-connections {max_connections} connections open; retry later", "server_error",
        code="too_many_connections"), "retry-after: 1")

    class BoundedH11Protocol(H11Protocol):
        _refused = False
        _header_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused, self.transport = True, transport  # never counted; connection_lost needs it
                transport.write(full)
                transport.close()
                return
            super().connection_made(transport)
            self._start_header_clock()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._header_timer is None and self._between_requests():
                self._start_header_clock()  # the first byte of the next request on a kept-alive connection
            cycle = self.cycle
            super().data_received(data)
            self._stop_header_clock_if_new(cycle)

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            self._stop_header_clock_if_new(cycle)  # a pipelined request, already whole

        def connection_lost(self, exc) -> None:
            self._stop_header_clock()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_header_clock(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_late)

        def _stop_header_clock(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _stop_header_clock_if_new(self, before) -> None:
            if self.cycle is not before:  # a request's headers are in
                self._stop_header_clock()

        def _headers_too_late(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.write(late)
                self.transport.close()

    return BoundedH11Protocol
