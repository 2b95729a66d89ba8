"""An HTTP frontend process (`boundgen serve --frontends N`): the whole HTTP API — guard,
routes, parsing, validation, tokenization, replies — served by uvicorn on the port the engine's
process bound, with the model work sent to that process over the link (`link.py`).

`FrontendState` is what a handler reads, as `ServerState` is in the engine's process: the same
facts (sent once at connection), the tokenizer (loaded from the checkpoint), the tries by name
(`TrieRef`), and three stand-ins that go over the link — `RemoteInfer` for `Infer`,
`ForwardedMetrics` and `ForwardedStats` for the engine's metrics and KServe statistics (sent as
observations, batched per event-loop turn). Readiness is the engine's (its warm-up), pushed on
change; draining is this process's own (its SIGTERM) or the engine's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from boundgen.server import loop_lag
from boundgen.server.config import ServerConfig
from boundgen.server.errors import Unavailable
from boundgen.server.handler_state import EngineFacts, HandlerState
from boundgen.server.link import TrieRef, Wire, encode, read_frame, rebuild_error
from boundgen.server.timing import SERVER_TIMES
from boundgen.text.tokenizer import Tokenizer

log = logging.getLogger("boundgen.server")

CPU_REPORT_S = 1.0  # how often a frontend sends the engine its CPU time


class FrontendLink:
    """The frontend's end of the link: requests by id, their futures, observations batched."""

    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        # what to do once the engine's process is gone (the process: SIGTERM itself, `main`)
        self.on_lost = on_lost
        self.wire: Wire | None = None
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._observations: list[tuple] = []
        self._flush_scheduled = False
        self.status: tuple = (False, "connecting to the engine", False)
        self.lost = False

    async def attach(self, sock: socket.socket) -> None:
        """Serve the handshaken `sock` on the running loop."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        _, wire = await loop.create_unix_connection(
            lambda: Wire(self._on_message, self._on_close), sock=sock
        )
        self.wire = wire

    def _on_message(self, wire: Wire, message: tuple) -> None:
        kind = message[0]
        if kind in ("done", "error", "answer"):
            fut = self._pending.pop(message[1], None)
            if fut is None or fut.done():
                return
            if kind == "error":
                fut.set_exception(rebuild_error(message[2]))
            elif kind == "done":
                fut.set_result((message[2], message[3]))
            else:
                fut.set_result(message[2])
        elif kind == "status":
            self.status = tuple(message[1:])

    def _on_close(self, wire: Wire) -> None:
        self.lost = True
        self.status = (False, "the engine process is gone", True)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable("the engine process is gone"))
        self._pending.clear()
        log.error("the link to the engine process closed")
        if self.on_lost is not None:
            self.on_lost()

    def _send(self, message: tuple) -> None:
        if self.wire is None or self.lost:
            raise Unavailable("the engine process is gone")
        self.wire.send(message)

    async def request(self, message: tuple) -> Any:
        """Send `message` with a fresh id after its kind, and await the reply to that id."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self._send((message[0], rid, *message[1:]))
            return await fut
        except asyncio.CancelledError:  # the client went away: the engine drops the work
            if self._pending.pop(rid, None) is not None and not self.lost:
                self.wire.send(("cancel", rid))
            raise
        finally:
            self._pending.pop(rid, None)  # (a send that failed leaves no waiter behind)

    def observe(self, observation: tuple) -> None:
        """Queue a metrics observation; those of one event-loop turn go as one message."""
        self._observations.append(observation)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._observations = self._observations, []
        if batch and self.wire is not None and not self.lost:
            self.wire.send(("observe", batch))


class RemoteInfer:
    """`Infer`'s call and `check_load`, over the link: admission, deadline and cancellation happen
    in the engine's `Infer`; its errors come back as the same `ServerError`s."""

    def __init__(self, link: FrontendLink) -> None:
        self.link = link
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def check_load(self) -> None:
        if self.closed or self.link.lost:
            raise Unavailable("server is shutting down")

    async def __call__(
        self, kind: str, request: dict[str, Any], timeout_ms: int, tokens: int = 0
    ) -> Any:
        self.check_load()
        out, times = await self.link.request(("infer", kind, request, timeout_ms, tokens))
        SERVER_TIMES.set(times)
        return out


class _ForwardedItems:
    def __init__(self, link: FrontendLink) -> None:
        self.link = link

    def labels(self, endpoint: str) -> _ForwardedItem:
        return _ForwardedItem(self.link, endpoint)


class _ForwardedItem:
    def __init__(self, link: FrontendLink, endpoint: str) -> None:
        self.link, self.endpoint = link, endpoint

    def inc(self, n: float = 1) -> None:
        self.link.observe(("items", self.endpoint, n))


class _ForwardedLag:
    """The loop-lag probe's histogram and maximum (`loop_lag.probe`): each lag goes to the
    engine's `boundgen_frontend_event_loop_lag_seconds`, which keeps the maximum too."""

    def __init__(self, link: FrontendLink) -> None:
        self.link = link

    def observe(self, lag: float) -> None:
        self.link.observe(("lag", lag))

    def set(self, lag: float) -> None:  # the maximum: the engine keeps it from the observations
        pass


class ForwardedMetrics:
    """What handlers record in `Metrics`, applied to the engine's registry; and this process's
    loop lag and CPU time (`report`), which the engine exports per frontend."""

    def __init__(self, link: FrontendLink) -> None:
        self.link = link
        self.items = _ForwardedItems(link)
        self.loop_lag = self.loop_lag_max = _ForwardedLag(link)

    async def report(self, index: int, every_s: float = CPU_REPORT_S) -> None:
        """Until cancelled: the loop-lag probe, and this process's CPU time every `every_s`."""
        lag = asyncio.create_task(loop_lag.probe(self.loop_lag, self.loop_lag_max))
        try:
            while True:
                self.link.observe(("cpu", index, time.process_time()))
                await asyncio.sleep(every_s)
        finally:
            lag.cancel()

    def observe_request(
        self, endpoint: str, status: int, seconds: float, error_type: str | None = None
    ) -> None:
        self.link.observe(("request", endpoint, status, seconds, error_type))


class ForwardedStats:
    """`InferenceStats.record`, applied to the engine's statistics."""

    def __init__(self, link: FrontendLink) -> None:
        self.link = link

    def record(self, ok: bool, total_ns: int, **phase_ns: int) -> None:
        self.link.observe(("kserve", ok, total_ns, phase_ns))


class FrontendState(HandlerState):
    """A frontend's `HandlerState`: the engine's facts from the link, its own tokenizer, the
    link's stand-ins (the module docstring)."""

    def __init__(self, facts: EngineFacts, config: ServerConfig, link: FrontendLink) -> None:
        self.link = link
        tries = {name: TrieRef(name, depth) for name, depth in facts.trie_depths.items()}
        super().__init__(
            facts,
            config,
            Tokenizer.from_dir(facts.model_path),
            tries,
            RemoteInfer(link),
            ForwardedMetrics(link),
            ForwardedStats(link),
        )
        self._draining = False

    # readiness: the engine's (pushed by it); draining: this process's or the engine's
    @property
    def ready(self) -> bool:
        return bool(self.link.status[0])

    @property
    def unready(self) -> str:
        return str(self.link.status[1])

    @property
    def draining(self) -> bool:
        return self._draining or bool(self.link.status[2])

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value

    async def metrics_text(self) -> tuple[bytes, str]:
        return await self.link.request(("query", "metrics"))

    async def model_stats(self) -> dict[str, Any]:
        return await self.link.request(("query", "model_stats"))


def handshake(path: str, index: int) -> tuple[socket.socket, EngineFacts, tuple]:
    """Connect to the engine's link at `path` and say hello: → the connected socket, the engine's
    facts and its readiness."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(encode(("hello", index)))
    reply = read_frame(sock)
    if reply[0] != "facts":
        raise RuntimeError(f"the engine answered the link's hello with {reply[0]!r}")
    return sock, EngineFacts(**reply[1]), tuple(reply[2][1:])


def connect(
    path: str, index: int, config: ServerConfig, on_lost: Callable[[], None] | None = None
) -> tuple[socket.socket, FrontendState]:
    """Say hello to the engine's link at `path` and make frontend `index`'s state from the answer
    (its facts, its readiness): → the socket, for `state.link.attach` on the frontend's event
    loop, and the state."""
    sock, facts, status = handshake(path, index)
    link = FrontendLink(on_lost=on_lost)
    link.status = status
    return sock, FrontendState(facts, config, link)


def main(index: int, config: ServerConfig, link_path: str, listener: socket.socket) -> None:
    """A frontend process: handshake, then the HTTP API on `listener` until SIGTERM/SIGINT."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[frontend {index}]: %(message)s",
    )
    from boundgen.server.app import build_app
    from boundgen.server.uvicorn import serve

    # without its engine a frontend can serve nothing: it stops (uvicorn drains, then exits)
    sock, state = connect(link_path, index, config, lambda: os.kill(os.getpid(), signal.SIGTERM))
    link = state.link

    reporting: list[asyncio.Task] = []

    async def start() -> None:
        await link.attach(sock)
        reporting.append(asyncio.create_task(state.metrics.report(index)))

    def stop() -> None:
        for task in reporting:
            task.cancel()
        state.infer.close()

    app = build_app(state, config, on_start=start, on_stop=stop)
    if config.gc_freeze:  # as the engine's process: full collections skip the start-up heap
        from boundgen.server.heap import freeze_startup_heap

        freeze_startup_heap()
    serve(app, config, sockets=[listener])
