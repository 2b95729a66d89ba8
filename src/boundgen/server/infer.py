"""`Infer`: the one narrow object HTTP handlers call (text-embeddings-inference's `Infer`):
admission by expected latency (`Overloaded`/429 + Retry-After, or `Timeout`/504 "not run"), one
queue (the runtime's), deadlines that cancel (`Timeout`/504).

`await infer(kind, request, timeout_ms, tokens)` submits one business request (`kind`: a registered
workload, `request`: its fields as a dict, `tokens`: its size in its model node's units) to the
engine's runtime and returns the pipeline's result.

Admission. Each workload's model node (a `BatchingNode`) predicts the run time of a batch from its
size (`CostModel`); `Infer` keeps the units admitted and not yet done per node, so the predicted
wait of a new request is the time those need. A request is shed (429) when that wait exceeds the
queue budget (`max_queue_ms`; by default 1.5 × the median recent unqueued service time of the
slowest workload, at least 10 ms: one request's work ahead is admitted, so the model never idles
between batches; two are not, so an accepted request waits about one service time at most). That
holds under overload, when requests arrive faster than the model serves them; below that a queue is
a burst that drains again, and is shed only beyond 3 × the budget (with Poisson arrivals at half
load, a budget of 1.5 services alone would shed ~1 request in 7).
A request is refused at once (504, "not run") when the wait plus its own predicted run time exceeds
its deadline. `max_queue` stays a hard cap on admitted requests (their memory), and is the only
check while the cost models are cold.

Deadlines. The runtime stops a request past its deadline at its model node's next piece of work;
a request whose client went away (its task is cancelled) or whose wait here runs out is cancelled
in the runtime too, so the rest of its work is dropped and the model is free for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
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

_SERVICE_SAMPLES = 256  # recent unqueued service times the automatic queue budget is taken from
_MIN_SAMPLES = 8  # fewer: no automatic budget yet (admission by count only)
_BUDGET_SERVICES = 1.5  # the automatic budget in typical service times: more than 1, less than 2
_MIN_BUDGET_MS = 10.0
# Requests arrive faster than the model serves them (their rate × the typical service time > 1,
# over the last _RATE_WINDOW_S): overload, shed beyond the budget. Else the queue is a burst that
# will drain, shed only beyond _BURST × the budget.
_RATE_WINDOW_S = 1.0
_BURST = 3
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
        self._pending: dict[BatchingNode, float] = {}  # model node → units admitted, not done
        self._service_ms: dict[str, deque[float]] = {}  # per workload
        self._nodes: dict[str, tuple[Pipeline | None, BatchingNode | None]] = {}
        self._rate, self._rate_at = 0.0, time.monotonic()  # arrivals per second, and when
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

    def predicted_wait_ms(self) -> float:
        """Time the model needs for the work admitted and not done yet (0 while cold)."""
        total = 0.0
        for node, units in self._pending.items():
            if units > 0:
                total += node.cost.predict_ms(units) or 0.0
        return total

    def queue_budget_ms(self) -> float | None:
        """The predicted wait beyond which requests are shed (None: no service times yet)."""
        if self.max_queue_ms is not None:
            return self.max_queue_ms
        known = [statistics.median(d) for d in self._service_ms.values() if len(d) >= _MIN_SAMPLES]
        if not known:
            return None
        # the slowest workload's: a small request may wait behind one large one
        return max(_MIN_BUDGET_MS, _BUDGET_SERVICES * max(known))

    # ---- admission ---------------------------------------------------------------------------

    def check_load(self) -> None:
        """Refuse a request before any work for it when the server cannot take one now: it is
        shutting down (503), it has `max_queue` requests admitted, or the predicted wait exceeds
        the queue budget (429 + Retry-After). Call it once per arriving request: it counts the
        arrival rate that tells overload from a burst."""
        self._check(arrived=True)

    def _check(self, arrived: bool) -> None:
        if self.closed:
            raise Unavailable("server is shutting down")
        if self._admitted >= self.max_queue:
            self.metrics.shed.labels("capacity").inc()
            raise Overloaded(
                f"server is at capacity ({self.max_queue} requests admitted); retry after "
                f"{self.retry_after_s}s",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        budget = self.queue_budget_ms()
        if budget is None:
            return
        wait = self.predicted_wait_ms()
        overloaded = self._arrival_rate(arrived) * budget / _BUDGET_SERVICES / 1e3 > 1.0
        limit = budget if overloaded else _BURST * budget
        if wait > limit:
            self.metrics.shed.labels("predicted_wait").inc()
            retry = min(_MAX_RETRY_AFTER_S, max(1, math.ceil((wait - budget) / 1e3)))
            raise Overloaded(
                f"server is overloaded: the model is busy for the next {wait:.0f} ms, over "
                f"{limit:.0f} ms (queue budget max_queue_ms={budget:.0f}"
                f"{'' if overloaded else f', ×{_BURST} for a burst'}); retry after {retry}s",
                headers={"Retry-After": str(retry)},
            )

    def _arrival_rate(self, arrived: bool) -> float:
        """Requests per second arriving lately (`arrived`: one more now): an exponentially
        decaying count over `_RATE_WINDOW_S`."""
        now = time.monotonic()
        decay = math.exp((self._rate_at - now) / _RATE_WINDOW_S)
        self._rate = self._rate * decay + (1.0 / _RATE_WINDOW_S if arrived else 0.0)
        self._rate_at = now
        return self._rate

    def _admit(self, node: BatchingNode | None, units: float, timeout_ms: int) -> None:
        self._check(arrived=False)  # the endpoint counted it in `check_load`
        if node is not None:
            pending = self._pending.get(node, 0.0)
            expected = node.cost.predict_ms(pending + units)
            if expected is not None and expected > timeout_ms:
                self.metrics.shed.labels("not_run").inc()
                wait = node.cost.predict_ms(pending) if pending > 0 else 0.0
                raise Timeout(
                    f"request not run: timeout_ms={timeout_ms} is shorter than the "
                    f"{expected:.0f} ms it is expected to take ({wait:.0f} ms waiting for the "
                    f"model, {expected - wait:.0f} ms running)"
                )
            self._pending[node] = pending + units
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)

    def _release(self, node: BatchingNode | None, units: float, fut: Any = None) -> None:
        self._admitted -= 1
        self.metrics.inflight.set(self._admitted)
        if node is not None:
            self._pending[node] -= units
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
        self._learn(kind, work)
        return out

    def _learn(self, kind: str, work: Any) -> None:
        """A service time for the automatic queue budget: the model batch of a request that had
        it to itself."""
        for t in work.timings:
            info = t.info or {}
            if info.get("batch_requests") == 1 and "batch_run_us" in info:
                samples = self._service_ms.setdefault(kind, deque(maxlen=_SERVICE_SAMPLES))
                samples.append(info["batch_run_us"] / 1e3)


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
