"""Cross-request batching: one node merges ready model inputs from concurrent requests into one
call.

Leader/follower: a request that reaches the node while no batch is being formed or run becomes
the leader and runs the batch on its own thread (no thread hop at low load). Requests that arrive
while a batch runs wait; when it ends, a batcher thread leads the next batch with everything that
waited (so batches grow with load). A leader takes everything already waiting, then waits for
more up to `max_wait_ms` (counted from the first request's arrival, and never past what the
earliest deadline in the batch allows) until `token_budget`. It calls `merge(list[inputs]) ->
(batch, sizes)`, runs `fn(batch)` once (under its own CUDA stream when the executor has CUDA),
and `split(output, sizes)` gives each request its outputs back. The token budget and max wait are
the knob between throughput (large forwards, DESIGN §11) and latency (not waiting for them).

A request that arrives while a batch runs is taken into the very next batch, which starts as soon
as the running one ends (with `max_wait_ms=0`, the default, nothing ever waits for more). With a
`latency_target_ms`, the token budget adapts to the measured cost: a batch may take at most the
tokens the cost model predicts to run in half the target (a request that arrives meanwhile waits
for the running batch, then runs in the next: about the target in all), and never more than let
its oldest request finish before its deadline; the first request always runs. The budget is
recomputed for every batch from the recent batches' fit, so it shrinks when batches get slower and
grows back (up to `token_budget`) when they get faster.

A function that works in pieces takes an `alive` argument as well: one callable per merged
request, in merge order, true while the request still wants its result (not cancelled, not past
its deadline). It asks between pieces and drops a dead request's rest. Every batch's size and run
time feed a `CostModel`, which predicts the run time of a batch of a given size (what admission
control and deadlines compare against).
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from boundgen.runtime.executor import DeadlineExceeded
from boundgen.runtime.node import Node, NodeKind, PipelineError


class CostModel:
    """Predicted run time of a batch from its size in units (tokens): `fixed + per_unit × units`,
    a least-squares fit over recent batches with exponentially decaying weights (`decay` per
    batch). With sizes too alike to tell the fixed part, it is the mean time per unit. None
    until `warm_batches` batches of `warm_units` in all were seen (a first tiny batch is all
    fixed cost, and would make every large request look far too slow)."""

    def __init__(self, decay: float = 0.05, warm_batches: int = 2, warm_units: int = 2048) -> None:
        self.decay = decay
        self.warm_batches = warm_batches
        self.warm_units = warm_units
        self.batches = 0
        self.units = 0
        # decayed sums: weight, units, ns, units², units·ns
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._fixed_ns = 0.0
        self._per_unit_ns = 0.0

    def observe(self, units: int, ns: int) -> None:
        # NOTE: called by the one thread that runs the node's batches.
        keep = 1.0 - self.decay
        x, y = float(units), float(ns)
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self.batches += 1
        self.units += units
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        cov = self._xy / self._w - mx * my
        slope = cov / var if var > (0.05 * mx) ** 2 else 0.0
        fixed = my - slope * mx
        if slope <= 0.0 or fixed < 0.0:  # sizes too alike (or noise): time per unit
            slope, fixed = my / max(mx, 1.0), 0.0
        self._per_unit_ns, self._fixed_ns = slope, fixed

    @property
    def warm(self) -> bool:
        return self.batches >= self.warm_batches and self.units >= self.warm_units

    def units_within(self, ms: float) -> float | None:
        """Units of one batch predicted to run in `ms` (0 when even the fixed part takes longer;
        None while cold)."""
        if not self.warm:
            return None
        return max(0.0, (ms * 1e6 - self._fixed_ns) / self._per_unit_ns)

    def predict_ms(self, units: float) -> float | None:
        """Run time of one batch of `units` (None while cold)."""
        if not self.warm:
            return None
        return (self._fixed_ns + self._per_unit_ns * units) / 1e6


def _takes_alive(fn: Callable[..., Any]) -> bool:
    try:
        return "alive" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class _Item:
    __slots__ = ("args", "arrival_ns", "done", "req", "size")

    def __init__(
        self, req: Any, args: dict[str, Any], done: Callable[..., None], size: int, now: int
    ):
        self.req, self.args, self.done, self.size = req, args, done, size
        self.arrival_ns = now


class BatchingNode(Node):
    """A node whose calls from concurrent requests are merged into one `fn(batch)` call.

    - `merge(list_of_input_dicts) -> (batch, sizes)`: one dict of this node's inputs per request,
      in order; `sizes` is whatever `split` needs (e.g. output rows per request).
    - `fn(batch) -> output`, run once per merged batch, on the node's own CUDA stream: one forward
      in flight, so requests that arrive meanwhile are merged into the next one. When `fn` has a
      parameter `alive`, it is called as `fn(batch, alive=[...])`: per request, in merge order, a
      callable that is false once the request's result is no longer wanted.
    - `split(output, sizes) -> list` of per-request outputs, in order: the value (one output port)
      or a tuple/dict (several).
    - `size(inputs) -> int`: tokens a request adds to the batch (default 1), counted against
      `token_budget`.
    - `max_batch`: at most this many requests per batch (default unbounded).
    - `latency_target_ms`: adapt the token budget to the cost model (module docstring); None:
      always `token_budget`.
    - `clock`: nanoseconds, monotonic (tests inject one).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Any], Any],
        inputs: dict[str, Any] | Sequence[str],
        outputs: dict[str, Any] | Sequence[str] | str,
        merge: Callable[[list[dict[str, Any]]], tuple[Any, Any]],
        split: Callable[[Any, Any], Sequence[Any]],
        size: Callable[[dict[str, Any]], int] | None = None,
        token_budget: int = 8192,
        max_wait_ms: float = 0.0,
        max_batch: int | None = None,
        latency_target_ms: float | None = None,
        kind: NodeKind | str = NodeKind.DEVICE,
        bind: dict[str, str] | None = None,
        raises: tuple[type[BaseException], ...] = (),
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        super().__init__(
            name=name,
            fn=fn,
            inputs=inputs,
            outputs=outputs,
            kind=kind,
            bind=dict(bind or {}),
            is_async=True,
            raises=raises,
        )
        if token_budget <= 0:
            raise PipelineError(f"batching node {name!r}: token_budget must be positive")
        if latency_target_ms is not None and latency_target_ms <= 0:
            raise PipelineError(f"batching node {name!r}: latency_target_ms must be positive")
        self.merge, self.split, self.size = merge, split, size
        self.token_budget = int(token_budget)
        self.max_wait_ns = int(max_wait_ms * 1e6)
        self.max_batch = max_batch
        self.latency_target_ms = latency_target_ms
        self._clock = clock
        self._waiting: deque[_Item] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._leaders = 0
        self._kick: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._cuda_stream: Any = None
        self._closed = False
        self._run_ema_ns = 0.0
        self._pass_alive = _takes_alive(fn)
        self.cost = CostModel()
        # Counters, updated under the condition's lock.
        self.batches = 0
        self.batched_requests = 0
        self.batched_tokens = 0
        self.max_requests_in_batch = 0
        self.last_budget = self.token_budget  # the budget the last batch was formed under

    # ---- executor side
    # -----------------------------------------------------------------------------------

    def start(self, req: Any, args: dict[str, Any], done: Callable[..., None]) -> None:
        size = self.size(args) if self.size is not None else 1
        item = _Item(req, args, done, size, self._clock())
        with self._cv:
            self._waiting.append(item)
            if self._leaders:
                self._cv.notify()  # a leader that is waiting for more may take it now
                return
            self._leaders += 1
        self._lead()  # this thread runs the batch

    def call_unbatched(self, args: dict[str, Any]) -> tuple[Any, ...]:
        batch, sizes = self.merge([args])
        parts = self.split(self.fn(batch), sizes)
        return self._as_tuple(parts[0])

    def close(self) -> None:
        """Stop the batcher threads; requests still waiting fail with a clear error."""
        with self._cv:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
        for it in left:
            it.done(
                None, RuntimeError(f"batching node {self.name!r} was closed before the request ran")
            )
        for _ in self._threads:
            self._kick.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def stats(self) -> dict[str, float]:
        b = self.batches
        return {
            "batches": b,
            "requests": self.batched_requests,
            "tokens": self.batched_tokens,
            "mean_requests_per_batch": self.batched_requests / b if b else 0.0,
            "max_requests_in_batch": self.max_requests_in_batch,
            "token_budget": self.last_budget,
        }

    # ---- leaders
    # -----------------------------------------------------------------------------------------

    def _as_tuple(self, part: Any) -> tuple[Any, ...]:
        names = self._result_keys
        if len(names) == 1:
            return (part,)
        if isinstance(part, dict):
            return tuple(part[n] for n in names)
        return tuple(part)

    def _lead(self) -> None:
        """Form and run one batch; the caller holds a leader slot, released here. If requests are
        still waiting afterwards, a batcher thread takes the slot and leads the next batch."""
        try:
            batch = self._take()
            if batch:
                self._run_batch(batch)
        finally:
            with self._cv:
                more = bool(self._waiting) and not self._closed
                if not more:
                    self._leaders -= 1
            if more:  # keep the slot and hand it to a batcher thread
                self._ensure_threads()
                self._kick.put(1)

    def _ensure_threads(self) -> None:
        if self._threads:
            return
        with self._cv:
            if self._threads:
                return
            self._threads = [
                threading.Thread(
                    target=self._background, name=f"boundgen-batch-{self.name}", daemon=True
                )
            ]
            threads = list(self._threads)
        for t in threads:
            t.start()

    def _background(self) -> None:
        while True:
            if self._kick.get() is None:
                return
            self._lead()

    def _take(self) -> list[_Item]:
        with self._cv:
            waiting = self._waiting
            while waiting and waiting[0].req.failed:  # cancelled or failed while it waited
                waiting.popleft()
            if not waiting:
                return []
            first = waiting.popleft()
            batch = [first]
            tokens = first.size
            deadline = first.req.deadline_ns
            wait_until = first.arrival_ns + self.max_wait_ns
            budget = self.last_budget = self._budget(first, waiting)
            while tokens < budget and (self.max_batch is None or len(batch) < self.max_batch):
                if waiting:
                    nxt = waiting[0]
                    if nxt.req.failed:
                        waiting.popleft()
                        continue
                    if tokens + nxt.size > budget:
                        break  # starts the next batch
                    waiting.popleft()
                    batch.append(nxt)
                    tokens += nxt.size
                    d = nxt.req.deadline_ns
                    if d is not None and (deadline is None or d < deadline):
                        deadline = d
                    continue
                limit = wait_until
                if deadline is not None:
                    limit = min(limit, deadline - int(self._run_ema_ns))
                remaining = limit - self._clock()
                if remaining <= 0:
                    break
                self._cv.wait(remaining / 1e9)
            return batch

    def _budget(self, oldest: _Item, waiting: deque[_Item]) -> int:
        """Tokens the next batch may take: `token_budget`, or with a latency target what the cost
        model predicts to run in half the target and before the oldest request's deadline (at
        least 1: the oldest request always runs) — unless more is waiting than two such batches
        hold: then the queue cannot drain within the target anyway, and smaller batches would
        only lose throughput (each pays the fixed cost), so the batch takes the whole budget."""
        target = self.latency_target_ms
        if target is None:
            return self.token_budget
        units = self.cost.units_within(target / 2)
        if units is None:  # cold: no measured cost yet
            return self.token_budget
        if oldest.size + sum(it.size for it in waiting) > 2 * units:
            return self.token_budget
        if oldest.req.deadline_ns is not None:
            left_ms = (oldest.req.deadline_ns - self._clock()) / 1e6
            units = min(units, self.cost.units_within(left_ms) or 0.0)
        return max(1, min(self.token_budget, int(units)))

    def _stream(self, executor: Any) -> Any:
        if self._cuda_stream is None:
            with self._cv:
                if self._cuda_stream is None:
                    self._cuda_stream = torch.cuda.Stream(device=executor.device)
        return self._cuda_stream

    def _run_batch(self, batch: list[_Item]) -> None:
        start = self._clock()
        live = []
        for it in batch:
            req = it.req
            if req.failed:
                continue
            d = req.deadline_ns
            if d is not None and start + self._run_ema_ns > d:
                it.done(
                    None,
                    DeadlineExceeded(
                        f"request {req.request_id} (pipeline {req.pipeline!r}): deadline of "
                        f"{req.timeout_ms:g} ms cannot be met in batching node {self.name!r} "
                        "(waited "
                        f"{(start - it.arrival_ns) / 1e6:.2f} ms, batch run "
                        f"~{self._run_ema_ns / 1e6:.2f} ms)",
                        req.pipeline,
                        self.name,
                        req.request_id,
                    ),
                )
            else:
                live.append(it)
        if not live:
            return
        executor = live[0].req.executor
        event = None
        try:
            if executor.cuda and self.kind is NodeKind.DEVICE:
                stream = self._stream(executor)
                # inputs were made by CPU nodes: order after anything they queued on the default
                # stream
                stream.wait_stream(torch.cuda.default_stream(executor.device))
                with torch.cuda.stream(stream):
                    parts = self._run(live)
                event = torch.cuda.Event()
                event.record(stream)
            else:
                parts = self._run(live)
        except Exception as exc:
            for it in live:
                it.done(None, exc)
            return
        ran = self._clock() - start
        self._run_ema_ns = (
            ran if self._run_ema_ns == 0 else self._run_ema_ns + 0.2 * (ran - self._run_ema_ns)
        )
        tokens = sum(it.size for it in live)
        if not any(it.req.failed for it in live):  # a dropped request's work was not all run
            self.cost.observe(tokens, ran)
        with self._cv:
            self._count(len(live), tokens)
        info = {
            "batch_requests": len(live),
            "batch_tokens": tokens,
            "batch_run_us": round(ran / 1e3, 1),
        }
        for it, part in zip(live, parts):
            try:
                outs = self._as_tuple(part)
            except Exception as exc:
                it.done(None, exc)
                continue
            it.done(
                outs, None, dict(info, batch_wait_us=round((start - it.arrival_ns) / 1e3, 1)), event
            )

    def _run(self, live: list[_Item]) -> Sequence[Any]:
        batch, sizes = self.merge([it.args for it in live])
        if self._pass_alive:
            out = self.fn(batch, alive=[it.req.alive for it in live])
        else:
            out = self.fn(batch)
        parts = self.split(out, sizes)
        if len(parts) != len(live):
            raise RuntimeError(f"split returned {len(parts)} parts for {len(live)} requests")
        return parts

    def _count(self, n: int, tokens: int) -> None:
        self.batches += 1
        self.batched_requests += n
        self.batched_tokens += tokens
        self.max_requests_in_batch = max(self.max_requests_in_batch, n)


def _no_rename(self: BatchingNode, *a: Any, **kw: Any) -> Node:
    raise PipelineError(
        f"batching node {self.name!r} cannot be renamed; build another BatchingNode"
    )


BatchingNode.renamed = _no_rename  # type: ignore[method-assign]
