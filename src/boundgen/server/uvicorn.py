"""Run an app under uvicorn with a graceful drain: on SIGTERM/SIGINT readiness turns 503 at once,
the listening socket closes, in-flight requests finish (up to `drain_timeout_s`), then the model
pool stops.

uvicorn has no read timeout for a request's head (its keep-alive timer runs only between requests,
and any byte cancels it), so a client that never finishes its headers, or trickles them a byte at a
time, would keep its connection forever. `BoundedHttpToolsProtocol` adds one: the head must arrive
whole within `header_timeout_s` of its first byte (or of the connection), a deadline that later
bytes do not extend, and be at most `MAX_HEAD_BYTES`. The body's deadline is the guard's
(`guard.py`, `body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import functools
import socket
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from boundgen.server.config import ServerConfig

MAX_HEAD_BYTES = 64 << 10  # request line + headers; h11's default limit is 16 KiB


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size limit on each request head. When
    the deadline passes with no request in progress, the connection is closed."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._arm_head_timer()  # the first byte of the next head (or of an unread body)
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            # uvicorn answers a parser error with 400 and closes the connection
            raise httptools.HttpParserError(f"request head over {MAX_HEAD_BYTES} bytes")

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True  # /health and /v2/health/ready answer 503 from now on
        super().handle_exit(sig, frame)


def serve(app: Any, config: ServerConfig, sockets: list[socket.socket] | None = None) -> None:
    """Serve `app` on `config`'s host and port, or on `sockets` already bound (a frontend
    process: the engine's process bound the port for all of them)."""
    protocol = functools.partial(BoundedHttpToolsProtocol, header_timeout_s=config.header_timeout_s)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol,  # type: ignore[arg-type]
        log_level=config.log_level,
        access_log=config.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
        timeout_keep_alive=30,
        backlog=max(2048, config.max_queue * 2),
    )
    DrainingServer(uv_config, app.state.boundgen).run(sockets=sockets)
