"""`Infer`: the one narrow object HTTP handlers call (text-embeddings-inference's `Infer`):
admission by expected latency (`Overloaded`/429 + Retry-After, or `Timeout`/504 "not run"), one
queue (the runtime's), deadlines that cancel (`Timeout`/504).

`await infer(kind, request, timeout_ms, tokens)` submits one business request (`kind`: a registered
workload, `request`: its fields as a dict, `tokens`: its size in its model node's units) to the
engine's runtime and returns the pipeline's result.

Admission. Each workload's model node (a `BatchingNode`) has a cost model learned from its
steady-state batches; `Infer` keeps the units and requests admitted and not yet done per node, so
a new request's predicted time is the rest of the batch running now plus the queue, itself
included, as the merged forwards it will become (`BatchingNode.rest_ms`, `queue_ms`). By default
a request is refused only when it cannot meet its own deadline: at once with 504 ("not run") when
its own run alone is predicted over its `timeout_ms` (waiting would not help), with 429 +
Retry-After when the queue ahead of it is what makes it late. A queue is what cross-request
batching feeds on, so it is not shed for being a queue (16 clients are normal traffic: before
issue 23 a budget of 1.5 single-request times shed 16.5 % of them on the CPU demo server).
`max_queue_ms` sets a tighter queue budget explicitly: a request is shed (429) when the model's
predicted busy time is over it. `max_queue` stays a hard cap on admitted requests (their memory),
and is the only check while the cost models are cold: no request is refused for a cost that was
never measured.

Deadlines. The runtime stops a request past its deadline at its model node's next piece of work;
a request whose client went away (its task is cancelled) or whose wait here runs out is cancelled
in the runtime too, so the rest of its work is dropped and the model is free for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.executor import DeadlineExceeded
from boundgen.server.errors import BadRequest, Overloaded, Timeout, Unavailable
from boundgen.server.metrics import Metrics
from boundgen.server.timing import SERVER_TIMES
from boundgen.workloads.service import EngineRuntime

log = logging.getLogger("boundgen.server")

_MAX_RETRY_AFTER_S = 30


class Infer:
    def __init__(
        self,
        runtime: EngineRuntime,
        *,
        metrics: Metrics,
        max_queue: int = 256,
        retry_after_s: int = 1,
        max_queue_ms: float | None = None,
    ):
        self.runtime = runtime
        self.metrics = metrics
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.max_queue_ms = max_queue_ms
        # NOTE: the counters below are touched only on the event loop thread, so no lock.
        self._admitted = 0
        # model node → [units, requests] admitted and not done
        self._pending: dict[BatchingNode, list[float]] = {}
        self._nodes: dict[str, tuple[Pipeline | None, BatchingNode | None]] = {}
        self.closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

    def close(self) -> None:
        """Admit nothing more (the server is shutting down; in-flight requests still finish)."""
        self.closed = True

    # ---- predictions -------------------------------------------------------------------------

    def model_node(self, kind: str) -> BatchingNode | None:
        """The batching node that runs `kind`'s model work (None: unknown kind, or none)."""
        pipe = self.runtime.pipelines.get(kind)
        known = self._nodes.get(kind)
        if known is None or known[0] is not pipe:
            plan = pipe.plan if pipe is not None else ()
            node = next((p.node for p in plan if isinstance(p.node, BatchingNode)), None)
            known = self._nodes[kind] = (pipe, node)
        return known[1]

    def predicted_ms(
        self, node: BatchingNode, units: float = 0.0, requests: int = 0
    ) -> float | None:
        """Predicted time until `node` has run the work admitted for it and not done, and then
        `units` of `requests` new requests: the rest of its running batch, then the queue as the
        merged forwards it will become (None while its cost model is cold)."""
        pending, admitted = self._pending.get(node, (0.0, 0))
        running, running_requests = node.running()
        # what is admitted and not in the running batch waits for a later one (or is still in
        # another node: counted as waiting, which errs on the side of a longer wait)
        queued = max(0.0, pending - running) + units
        queued_requests = max(0, int(admitted) - running_requests) + requests
        if queued_requests == 0:
            return node.rest_ms()
        queue = node.queue_ms(queued, queued_requests)
        return None if queue is None else node.rest_ms() + queue

    def predicted_wait_ms(self) -> float:
        """Time the model nodes need for the work admitted and not done yet (0 while cold)."""
        return sum(self.predicted_ms(node) or 0.0 for node in self._pending)

    def queue_budget_ms(self) -> float | None:
        """The predicted wait beyond which requests are shed (None: only their deadlines)."""
        return self.max_queue_ms

    # ---- admission ---------------------------------------------------------------------------

    def check_load(self) -> None:
        """Refuse a request before any work for it when the server cannot take one now: it is
        shutting down (503), it has `max_queue` requests admitted, or (with `max_queue_ms` set)
        the predicted wait exceeds that budget (429 + Retry-After)."""
        if self.closed:
            raise Unavailable("server is shutting down")
        if self._admitted >= self.max_queue:
            self.metrics.shed.labels("capacity").inc()
            raise Overloaded(
                f"server is at capacity ({self.max_queue} requests admitted); retry after "
                f"{self.retry_after_s}s",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        budget = self.max_queue_ms
        if budget is None:
            return
        wait = self.predicted_wait_ms()
        if wait > budget:
            self.metrics.shed.labels("predicted_wait").inc()
            retry = _retry_after_s(wait - budget)
            raise Overloaded(
                f"server is overloaded: the model is busy for the next {wait:.0f} ms, over "
                f"the queue budget max_queue_ms={budget:g}; retry after {retry}s",
                headers={"Retry-After": str(retry)},
            )

    def _admit(self, node: BatchingNode | None, units: float, timeout_ms: int) -> None:
        self.check_load()  # again: the body was read and parsed since the endpoint checked
        if node is not None:
            self._check_deadline(node, units, timeout_ms)
            pending = self._pending.setdefault(node, [0.0, 0])
            pending[0] += units
            pending[1] += 1
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)

    def _check_deadline(self, node: BatchingNode, units: float, timeout_ms: int) -> None:
        """Refuse a request that is predicted to miss its deadline: 504 when its own run is over
        it, 429 when the queue ahead makes it late (it would make it once that drains)."""
        expected = self.predicted_ms(node, units, 1)
        if expected is None or expected <= timeout_ms:
            return
        alone = node.queue_ms(units) or 0.0
        wait = expected - alone
        if alone > timeout_ms:
            self.metrics.shed.labels("not_run").inc()
            raise Timeout(
                f"request not run: timeout_ms={timeout_ms} is shorter than the {alone:.0f} ms "
                "its model work is expected to take"
            )
        self.metrics.shed.labels("deadline").inc()
        retry = _retry_after_s(expected - timeout_ms)
        raise Overloaded(
            f"server is overloaded: timeout_ms={timeout_ms} cannot be met, the model is busy for "
            f"the next {wait:.0f} ms and this request takes {alone:.0f} ms; retry after {retry}s",
            headers={"Retry-After": str(retry)},
        )

    def _release(self, node: BatchingNode | None, units: float) -> None:
        self._admitted -= 1
        self.metrics.inflight.set(self._admitted)
        if node is not None:
            pending = self._pending[node]
            pending[0] -= units
            pending[1] -= 1

    # ---- one request -------------------------------------------------------------------------

    def start(
        self,
        kind: str,
        request: dict[str, Any],
        timeout_ms: int,
        tokens: int,
        on_done: Callable[[Any, BaseException | None, list | None], None],
    ) -> Any:
        """Admit and submit one request, with no task of its own: what `__call__` awaits, and
        what the engine's side of a frontend link runs for each request. Raises the admission's
        refusals at once. Later, on the event loop, calls `on_done(result, None, server_times)`
        or `on_done(None, error, None)` once: `Timeout` at the deadline or when the runtime
        dropped the request for it, `BadRequest` for the runtime's `ValueError`, its other
        failures as they are, `asyncio.CancelledError` after the caller's `cancel()`. → the
        runtime's request (`cancel()`: the caller went away, its work is dropped).

        Per request: one timer and one hand-over from the thread that ends the work. With a
        task, a wrapped future, `shield` and `wait_for` a request, the engine's event loop spent
        0.090–0.093 ms of CPU a `/v1/beam` request behind a frontend, 0.060–0.070 this way
        (`bench_loop.py --route beam --concurrency 64 --frontend`, the development CPU)."""
        loop = asyncio.get_running_loop()
        node = self.model_node(kind)
        self._admit(node, tokens, timeout_ms)
        try:
            if tokens:
                self.metrics.batch_tokens.observe(tokens)
            work = self.runtime.submit(kind, request, timeout_ms)
        except BaseException:
            self._release(node, tokens)
            raise
        answered = False

        def answer(out: Any, error: BaseException | None) -> None:
            nonlocal answered
            if answered:
                return
            answered = True
            timer.cancel()
            on_done(out, error, runtime_times(work) if error is None else None)

        def expire() -> None:  # the deadline passed with the work still running
            work.cancel()
            answer(None, Timeout(f"request did not finish within timeout_ms={timeout_ms}"))

        def ended() -> None:  # on the loop, once the work has ended (cancelled work at once)
            nonlocal work
            # NOTE: the admission slot is freed when the work really ends, not when the client
            # gives up or times out, so a burst of timed-out requests cannot overfill the queue
            self._release(node, tokens)
            try:
                settle()
            finally:
                # the work holds `on_end`, which holds this closure: without this the request
                # (its inputs, its results) lived on in a cycle until a full collection, and on
                # the development CPU those collections paused the server > 10 ms twice a
                # 6-second `/v1/beam` run (p99 105-135 ms against 25-30)
                work = None

        def settle() -> None:
            if answered:
                return
            if work.cancelled():
                answer(None, asyncio.CancelledError())
                return
            error = work.exception()
            if error is None:
                answer(work.result(), None)
            elif isinstance(error, DeadlineExceeded):  # (a TimeoutError: before ValueError's)
                if error.started:
                    message = f"request did not finish within timeout_ms={timeout_ms}: {error}"
                else:
                    message = f"request dropped: timeout_ms={timeout_ms} cannot be met ({error})"
                answer(None, Timeout(message))
            elif isinstance(error, ValueError):
                answer(None, BadRequest(str(error)))
            else:
                answer(None, error)

        def on_end(_: Any) -> None:  # on the thread that ended the work
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(ended)

        timer = loop.call_later(timeout_ms / 1000.0, expire)
        work.add_done_callback(on_end)
        return work

    async def __call__(
        self, kind: str, request: dict[str, Any], timeout_ms: int, tokens: int = 0
    ) -> Any:
        done = asyncio.get_running_loop().create_future()

        def on_done(out: Any, error: BaseException | None, times: list | None) -> None:
            if done.done():  # the caller went away first
                return
            if error is None:
                done.set_result((out, times))
            else:
                done.set_exception(error)

        work = self.start(kind, request, timeout_ms, tokens, on_done)
        try:
            out, times = await done
        except asyncio.CancelledError:  # the client went away
            work.cancel()
            raise
        SERVER_TIMES.set(times)
        return out


def _retry_after_s(excess_ms: float) -> int:
    """`Retry-After` for a queue predicted `excess_ms` over what was acceptable: about when it
    will have drained that much (whole seconds, 1 to 30)."""
    return min(_MAX_RETRY_AFTER_S, max(1, math.ceil(excess_ms / 1e3)))


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
