"""`Infer`: the one narrow object HTTP handlers call (text-embeddings-inference style thin handlers).

`await infer(kind, request, timeout_ms)` runs one business request (`kind` in score | classify |
embed | beam, `request` the keyword arguments of the matching `Engine` method) and returns its
result. It owns admission (a bounded count of admitted requests → `Overloaded`/429) and deadlines
(`Timeout`/504).

Two backends, same contract:
- an `Engine`: calls run on a small worker thread pool (never on the event loop); a request whose
  deadline passed while it waited is dropped before it reaches the model;
- an `EngineRuntime` (`runtime.submit(kind, request, timeout_ms) -> concurrent.futures.Future`),
  which batches across requests and enforces deadlines itself (raising `DeadlineExceeded`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from boundgen.server.errors import (
    BadRequest,
    DeadlineExceeded,
    Overloaded,
    ServerError,
    Timeout,
    is_deadline_error,
)
from boundgen.server.metrics import Metrics

log = logging.getLogger("boundgen.server")

KINDS = ("score", "classify", "embed", "beam")
_ENGINE_METHOD = {"score": "score", "classify": "classify", "embed": "embed", "beam": "beam_search"}

# (name, ms) of where the request this task serves spent its time, for the `Server-Timing` header:
# set by
# `Infer` when the work ends, read by the endpoint wrapper in the same task.
SERVER_TIMES: ContextVar[list[tuple[str, float]] | None] = ContextVar(
    "boundgen_server_times", default=None
)


class Infer:
    def __init__(
        self,
        engine: Any,
        *,
        metrics: Metrics,
        max_queue: int = 256,
        workers: int = 1,
        runtime: Any = None,
        owns_runtime: bool = False,
        retry_after_s: int = 1,
        tries: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.runtime = runtime
        self.owns_runtime = owns_runtime  # close it on shutdown (not the engine's own runtime)
        self.metrics = metrics
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.tries = tries or {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="boundgen-model")
        self._admitted = 0  # NOTE: touched only on the event loop thread, so no lock.
        self._waiting = 0  # engine path: admitted but not yet started by a worker
        self.closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

    def _admit(self) -> None:
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
        # its exception as seen, else asyncio logs "Future exception was never retrieved" for each
        # one.
        if fut is not None and fut.done() and not fut.cancelled():
            fut.exception()

    async def __call__(self, kind: str, request: dict[str, Any], timeout_ms: int) -> Any:
        if kind not in KINDS:
            raise BadRequest(f"unknown request kind {kind!r}")
        self._admit()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_ms / 1000.0
        try:
            if self.runtime is not None:
                request = dict(request)
                tokens = request.pop("_tokens", None)
                if tokens:
                    self.metrics.batch_tokens.observe(tokens)
                if kind == "beam":
                    request["prompts"] = [request.pop("prompt")]
                work = self.runtime.submit(kind, request, timeout_ms)
                fut = asyncio.wrap_future(work)
            else:
                self._waiting += 1
                self.metrics.queue_depth.set(self._waiting)
                fut = loop.run_in_executor(
                    self._pool, self._run_engine, kind, request, deadline, time.monotonic()
                )
        except BaseException:
            self._release()
            raise
        # NOTE: the admission slot is freed when the work really ends, not when the client gives up,
        # so a burst of timed-out requests cannot overfill the worker queue.
        fut.add_done_callback(self._release)
        try:
            out = await asyncio.wait_for(
                asyncio.shield(fut), timeout=max(0.0, deadline - time.monotonic())
            )
            if self.runtime is None:
                out, times = out
                SERVER_TIMES.set(times)
                return out
            SERVER_TIMES.set(runtime_times(work))
            if kind == "embed":  # a device tensor: copy it off the event loop
                return await asyncio.to_thread(lambda: out.float().cpu().numpy())
            if kind == "beam":
                return [(list(map(int, toks)), float(score)) for toks, score in out[0]]
            return out
        except TimeoutError:
            raise Timeout(f"request did not finish within timeout_ms={timeout_ms}") from None
        except ServerError:
            raise
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        except Exception as exc:
            if is_deadline_error(exc):
                raise Timeout(
                    f"request did not finish within timeout_ms={timeout_ms}: {exc}"
                ) from None
            raise

    # --- engine path, runs on a worker thread ---
    def _run_engine(
        self, kind: str, request: dict[str, Any], deadline: float, enqueued: float
    ) -> Any:
        start = time.monotonic()
        # NOTE: `_waiting` feeds a gauge only (admission uses `_admitted`); a racy update is
        # harmless.
        self._waiting -= 1
        self.metrics.queue_depth.set(max(0, self._waiting))
        self.metrics.observe_node("queue", start - enqueued)
        if start >= deadline:
            raise DeadlineExceeded("deadline passed while queued")
        tokens = request.pop("_tokens", None)
        if tokens:
            self.metrics.batch_tokens.observe(tokens)
        method = getattr(self.engine, _ENGINE_METHOD[kind])
        if _takes_timeout(method):  # let the engine drop work that cannot make the deadline
            request["timeout_ms"] = max(1.0, (deadline - start) * 1000.0)
        out = method(**request)
        if kind == "embed":
            out = out.float().cpu().numpy()  # tensor work stays off the event loop
        elif kind == "beam":
            out = [(list(map(int, toks)), float(score)) for toks, score in out]
        ran = time.monotonic() - start
        self.metrics.observe_node(kind, ran)
        return out, [("queue", (start - enqueued) * 1e3), (kind, ran * 1e3)]

    def close(self, wait: bool = True) -> None:
        self.closed = True
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        if self.runtime is not None and self.owns_runtime:
            self.runtime.close()


def runtime_times(work: Any) -> list[tuple[str, float]]:
    """`Server-Timing` entries of a finished runtime request: its time in the runtime, then each node's
    run (and its wait for a worker or stream when there was one), in completion order. A batching
    node's run is split further: `<node>-batch-wait` (queued until its merged batch started, e.g.
    behind the
    batch before it) and `<node>-batch-run` (that batch's run, shared with the requests merged into it)."""
    total = getattr(work, "total_ms", None)
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


def _takes_timeout(method: Any) -> bool:
    try:
        return "timeout_ms" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
