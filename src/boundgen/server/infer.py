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
import logging
import math
from contextvars import ContextVar
from typing import Any

from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
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

    def _release(self, node: BatchingNode | None, units: float, fut: Any = None) -> None:
        self._admitted -= 1
        self.metrics.inflight.set(self._admitted)
        if node is not None:
            pending = self._pending[node]
            pending[0] -= units
            pending[1] -= 1
        # A request the client already got a 504 for still ends (often in DeadlineExceeded): mark
        # its exception as seen, else asyncio logs "Future exception was never retrieved".
        if fut is not None and fut.done() and not fut.cancelled():
            fut.exception()

    # ---- one request -------------------------------------------------------------------------

    async def __call__(
        self, kind: str, request: dict[str, Any], timeout_ms: int, tokens: int = 0
    ) -> Any:
        node = self.model_node(kind)
        self._admit(node, tokens, timeout_ms)
        try:
            if tokens:
                self.metrics.batch_tokens.observe(tokens)
            work = self.runtime.submit(kind, request, timeout_ms)
            fut = asyncio.wrap_future(work)
        except BaseException:
            self._release(node, tokens)
            raise
        # NOTE: the admission slot is freed when the work really ends (cancelled work ends at once),
        # not when the client gives up, so a burst of timed-out requests cannot overfill the queue.
        fut.add_done_callback(lambda f: self._release(node, tokens, f))
        try:
            out = await asyncio.wait_for(asyncio.shield(fut), timeout=timeout_ms / 1000.0)
        except TimeoutError:
            work.cancel()
            raise Timeout(f"request did not finish within timeout_ms={timeout_ms}") from None
        except asyncio.CancelledError:  # the client went away
            work.cancel()
            raise
        except DeadlineExceeded as exc:
            if exc.started:
                message = f"request did not finish within timeout_ms={timeout_ms}: {exc}"
            else:
                message = f"request dropped: timeout_ms={timeout_ms} cannot be met ({exc})"
            raise Timeout(message) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        SERVER_TIMES.set(runtime_times(work))
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
