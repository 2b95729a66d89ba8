"""`Infer`: the one narrow object HTTP handlers call (text-embeddings-inference's `Infer`): a permit
(a bounded count of admitted requests → `Overloaded`/429), one queue (the runtime's), deadlines
(`Timeout`/504).

`await infer(kind, request, timeout_ms)` submits one business request (`kind`: a registered
workload, `request`: its fields as a dict) to the engine's runtime and returns the pipeline's
result.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any

from boundgen.runtime.executor import DeadlineExceeded
from boundgen.server.errors import BadRequest, Overloaded, Timeout, Unavailable
from boundgen.server.metrics import Metrics
from boundgen.workloads.service import EngineRuntime

log = logging.getLogger("boundgen.server")

# (name, ms) of where the request this task serves spent its time, for the `Server-Timing` header:
# set by `Infer` when the work ends, read by the endpoint wrapper in the same task.
SERVER_TIMES: ContextVar[list[tuple[str, float]] | None] = ContextVar(
    "boundgen_server_times", default=None
)


class Infer:
    def __init__(
        self,
        runtime: EngineRuntime,
        *,
        metrics: Metrics,
        max_queue: int = 256,
        retry_after_s: int = 1,
    ):
        self.runtime = runtime
        self.metrics = metrics
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._admitted = 0  # NOTE: touched only on the event loop thread, so no lock.
        self.closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

    def close(self) -> None:
        """Admit nothing more (the server is shutting down; in-flight requests still finish)."""
        self.closed = True

    def _admit(self) -> None:
        if self.closed:
            raise Unavailable("server is shutting down")
        if self._admitted >= self.max_queue:
            self.metrics.shed.inc()
            raise Overloaded(
                f"server is at capacity ({self.max_queue} requests admitted); retry after "
                f"{self.retry_after_s}s",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)

    def _release(self, fut: Any = None) -> None:
        self._admitted -= 1
        self.metrics.inflight.set(self._admitted)
        # A request the client already got a 504 for still ends (often in DeadlineExceeded): mark
        # its exception as seen, else asyncio logs "Future exception was never retrieved".
        if fut is not None and fut.done() and not fut.cancelled():
            fut.exception()

    async def __call__(
        self, kind: str, request: dict[str, Any], timeout_ms: int, tokens: int = 0
    ) -> Any:
        self._admit()
        try:
            if tokens:
                self.metrics.batch_tokens.observe(tokens)
            work = self.runtime.submit(kind, request, timeout_ms)
            fut = asyncio.wrap_future(work)
        except BaseException:
            self._release()
            raise
        # NOTE: the admission slot is freed when the work really ends, not when the client gives
        # up, so a burst of timed-out requests cannot overfill the queue.
        fut.add_done_callback(self._release)
        try:
            out = await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_ms / 1000.0)
        except TimeoutError:
            raise Timeout(f"request did not finish within timeout_ms={timeout_ms}") from None
        except DeadlineExceeded as exc:
            raise Timeout(f"request did not finish within timeout_ms={timeout_ms}: {exc}") from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        SERVER_TIMES.set(runtime_times(work))
        return out


def runtime_times(work: Any) -> list[tuple[str, float]]:
    """`Server-Timing` entries of a finished runtime request: its time in the runtime, then each
    node's run (and its wait for a worker or stream when there was one), in completion order. A
    batching node's run is split further: `<node>-batch-wait` (queued until its merged batch
    started, e.g. behind the batch before it) and `<node>-batch-run` (that batch's run, shared with
    the requests merged into it)."""
    total = work.total_ms
    if total is None:
        return []
    out = [("runtime", total)]
    for t in work.timings:
        if t.wait_ms >= 0.01:
            out.append((f"{t.node}-wait", t.wait_ms))
        out.append((t.node, t.run_ms))
        info = t.info or {}
        if "batch_wait_us" in info and "batch_run_us" in info:
            out.append((f"{t.node}-batch-wait", info["batch_wait_us"] / 1e3))
            out.append((f"{t.node}-batch-run", info["batch_run_us"] / 1e3))
    return out
