"""The engine's side of the frontend link (`link.py`): a Unix socket server on the engine
process's event loop. Each `infer` message runs through the same `Infer` an in-process handler
calls (admission, deadline, cancellation), so a request is admitted, shed and timed out the same
way whichever process read it; each reply carries the request's `Server-Timing` entries. The
frontends' metrics and KServe statistics are applied to the engine's one registry, so /metrics
answered by any frontend counts every request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from boundgen.server.errors import ServerError
from boundgen.server.link import TrieRef, Wire, error_fields, has_tensors, host_floats
from boundgen.server.state import ServerState

log = logging.getLogger("boundgen.server")

STATUS_POLL_S = 0.1  # how often readiness is checked for a change to send the frontends
CLOSE_TIMEOUT_S = 5.0  # at shutdown, the longest wait for the link's connections to end


class EngineLink:
    """The link's server in the engine's process: `start(path)`, then every frontend that says
    hello is served until `close()` (the module docstring)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.wires: set[Wire] = set()  # the frontends that said hello (sent the status)
        self._connections: set[Wire] = set()  # every connection, hello or not
        self._work: dict[tuple, Any] = {}  # (wire, rid) → the runtime's request for it
        # (wire, rid) → a reply being made off the request path (a query, embeddings' host copy)
        self._tasks: dict[tuple, asyncio.Task] = {}
        self._server: asyncio.AbstractServer | None = None
        self._status_task: asyncio.Task | None = None
        self._status: tuple = ()
        self.frontend_cpu: dict[int, float] = {}  # frontend index → its CPU seconds (reported)
        self._frontend_lag_max = 0.0
        state.metrics.watch_frontends(lambda: dict(self.frontend_cpu))

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connect, path)
        self._status_task = asyncio.create_task(self._watch_status())

    async def close(self) -> None:
        if self._status_task is not None:
            self._status_task.cancel()
        # the connections first: from Python 3.12 on, `wait_closed` waits for them all to end
        for wire in list(self._connections):
            wire.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), CLOSE_TIMEOUT_S)

    def _connect(self) -> Wire:
        wire = Wire(self._on_message, self._on_close)
        self._connections.add(wire)
        return wire

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> tuple:
        s = self.state
        return ("status", s.ready, s.unready, s.draining)

    def push_status(self) -> None:
        """Send the readiness to every frontend when it changed (warm-up, drain)."""
        status = self.status()
        if status != self._status:
            self._status = status
            for wire in self.wires:
                wire.send(status)

    async def _watch_status(self) -> None:
        while True:
            self.push_status()
            await asyncio.sleep(STATUS_POLL_S)

    # ---- messages -----------------------------------------------------------------------------

    def _on_close(self, wire: Wire) -> None:
        self.wires.discard(wire)
        self._connections.discard(wire)
        for key in [k for k in self._work if k[0] == id(wire)]:
            self._work.pop(key).cancel()  # nobody waits for them any more
        for key in [k for k in self._tasks if k[0] == id(wire)]:
            self._tasks.pop(key).cancel()

    def _on_message(self, wire: Wire, message: tuple) -> None:
        kind = message[0]
        if kind == "infer":
            self._infer(wire, *message[1:])
        elif kind == "cancel":  # the frontend's client went away
            work = self._work.pop((id(wire), message[1]), None)
            if work is not None:
                work.cancel()
        elif kind == "observe":
            for observation in message[1]:
                self._apply(observation)
        elif kind == "query":
            key = (id(wire), ("query", message[1]))
            self._tasks[key] = asyncio.ensure_future(self._answer(wire, key, message[2]))
        elif kind == "hello":
            self.wires.add(wire)
            wire.send(("facts", self.state.facts.as_dict(), self.status()))
        else:
            log.warning("link: unknown message %r", kind)

    def _infer(
        self, wire: Wire, rid: int, workload: str, fields: dict, timeout_ms: int, units: int
    ) -> None:
        """Admit and submit a frontend's request through `Infer.start` (no task a request); its
        reply goes when the work ends (`_reply`)."""
        key = (id(wire), rid)
        try:
            work = self.state.infer.start(
                workload,
                self._resolve(fields),
                timeout_ms,
                units,
                lambda out, error, times: self._reply(wire, key, out, error, times),
            )
        except ServerError as exc:  # refused by admission
            wire.send(("error", rid, error_fields(exc)))
        except Exception:
            self._internal_error(wire, rid, workload)
        else:
            self._work[key] = work

    def _reply(
        self, wire: Wire, key: tuple, out: Any, error: BaseException | None, times: list | None
    ) -> None:
        self._work.pop(key, None)
        rid = key[1]
        if error is None:
            if has_tensors(out):  # embeddings: their copy to the host waits for the GPU
                self._tasks[key] = asyncio.ensure_future(self._send_floats(wire, key, out, times))
            else:
                wire.send(("done", rid, out, times))
        elif isinstance(error, asyncio.CancelledError):  # the frontend stopped waiting for it
            return
        elif isinstance(error, ServerError):
            wire.send(("error", rid, error_fields(error)))
        else:
            self._internal_error(wire, rid, "a request", error)

    async def _send_floats(self, wire: Wire, key: tuple, out: Any, times: list | None) -> None:
        try:
            wire.send(("done", key[1], await host_floats(out), times))
        finally:
            self._tasks.pop(key, None)

    def _internal_error(
        self, wire: Wire, rid: int, what: str, error: BaseException | None = None
    ) -> None:
        """Log `error` (else the exception being handled) and answer 500, as the endpoint does."""
        log.error("internal error in %s (from a frontend)", what, exc_info=error or True)
        internal = ServerError("internal server error (see the server log)")
        wire.send(("error", rid, error_fields(internal)))

    def _resolve(self, fields: dict) -> dict:
        """A beam request's `TrieRef` → the engine's `Trie` of that name."""
        trie = fields.get("trie")
        if isinstance(trie, TrieRef):
            fields = {**fields, "trie": self.state.tries[trie.name]}
        return fields

    def _apply(self, observation: tuple) -> None:
        kind, *args = observation
        metrics = self.state.metrics
        if kind == "request":
            metrics.observe_request(*args)
        elif kind == "items":
            endpoint, n = args
            metrics.items.labels(endpoint).inc(n)
        elif kind == "kserve":
            ok, total_ns, phases = args
            self.state.kserve_stats.record(ok, total_ns, **phases)
        elif kind == "lag":
            (lag,) = args
            metrics.frontend_loop_lag.observe(lag)
            if lag > self._frontend_lag_max:
                self._frontend_lag_max = lag
                metrics.frontend_loop_lag_max.set(lag)
        elif kind == "cpu":
            index, seconds = args
            self.frontend_cpu[index] = seconds
        else:
            log.warning("link: unknown observation %r", kind)

    async def _answer(self, wire: Wire, key: tuple, what: str) -> None:
        value: Any = None
        try:
            if what == "metrics":
                value = await self.state.metrics_text()
            elif what == "model_stats":
                value = await self.state.model_stats()
        finally:
            self._tasks.pop(key, None)
        wire.send(("answer", key[1][1], value))
