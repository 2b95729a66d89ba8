"""A `BatchingNode` over a fake model on an injected clock, and arrival schedules, for the tests
that drive a node's scheduling directly (`test_batching_adaptive.py`, `test_merge_plan.py`).

The model is a fake whose cost is `FIXED_NS + PER_TOKEN_NS × tokens` (or a given cost) on the
injected clock: it advances the clock by its cost and lets the arrivals scheduled meanwhile in
(`node.start` from inside the batch, as a server thread would), so every run is deterministic and
reads no wall clock.
"""

from __future__ import annotations

import random
import threading

from fake_request import FakeRequest

from boundgen.runtime.batching import BatchingNode

FIXED_NS = 1_000_000  # 1 ms per batch
PER_TOKEN_NS = 10_000  # 10 µs per token


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class Sim:
    """A batching node over the fake model, and a schedule of arrivals (ns, tokens)."""

    def __init__(self, arrivals: list[tuple[int, int]], cost=None, **node_kw) -> None:
        self.clock = Clock()
        self.cost = cost or (lambda tokens: FIXED_NS + PER_TOKEN_NS * tokens)
        self.pending = sorted(arrivals)
        self.arrived: dict[int, int] = {}  # request id → arrival ns
        self.finished: dict[int, int] = {}  # request id → end ns
        self.batches: list[list[int]] = []  # request ids per batch, in order
        self.runs_ns: list[int] = []
        self.budgets: list[int] = []
        self.warm: list[bool] = []  # whether the cost model was warm when each batch formed
        self.tokens: dict[int, int] = {}  # request id → its tokens
        self.predicted: dict[int, float | None] = {}  # request id → predicted ms on arrival
        self._cv = threading.Condition()
        self.node = BatchingNode(
            "forward",
            self._fn,
            inputs=["tokens"],
            outputs=["out"],
            merge=lambda items: ([it["tokens"] for it in items], None),
            split=lambda out, sizes: out,
            size=lambda args: args["tokens"][1],
            kind="cpu",
            clock=self.clock,
            **node_kw,
        )

    def _fn(self, batch: list[tuple[int, int]]) -> list[int]:
        self.budgets.append(self.node.last_budget)
        self.warm.append(self.node.cost.warm)
        self.batches.append([rid for rid, _ in batch])
        run = self.cost(sum(tokens for _, tokens in batch))
        end = self.clock.ns + run
        while self.pending and self.pending[0][0] <= end:  # they arrive while this batch runs
            at, tokens = self.pending.pop(0)
            self.clock.ns = max(self.clock.ns, at)
            self._start(tokens)
        self.clock.ns = end
        self.runs_ns.append(run)
        return [rid for rid, _ in batch]

    def _start(self, tokens: int, deadline_ms: float | None = None) -> None:
        rid = len(self.arrived)
        self.predicted[rid] = self._predict(tokens)
        self.tokens[rid] = tokens
        self.arrived[rid] = self.clock.ns
        deadline = None if deadline_ms is None else self.clock.ns + int(deadline_ms * 1e6)
        req = FakeRequest(rid, deadline, deadline_ms or 0.0)
        self.node.start(req, {"tokens": (rid, tokens)}, self._done)

    def _predict(self, tokens: int) -> float | None:
        """What admission predicts for a request arriving now (`Infer.predicted_ms`): the rest of
        the running batch, then everything not in it, this request included, as merged
        forwards."""
        waiting = [r for r in self.arrived if r not in self.finished]
        running_tokens, running_requests = self.node.running()
        queued = sum(self.tokens[r] for r in waiting) - running_tokens + tokens
        queue = self.node.queue_ms(queued, len(waiting) - running_requests + 1)
        return None if queue is None else self.node.rest_ms() + queue

    def _done(self, outs, exc, info=None, event=None) -> None:
        assert exc is None, exc
        with self._cv:
            self.finished[outs[0]] = self.clock.ns
            self._cv.notify_all()

    def run(self) -> Sim:
        """Until every arrival has finished; an idle node gets its next arrival from here."""
        while self.pending:
            at, tokens = self.pending.pop(0)
            self.clock.ns = max(self.clock.ns, at)
            self._start(tokens)
            with self._cv:  # the batch (and any that followed) ran on this or the batcher thread
                assert self._cv.wait_for(lambda: len(self.finished) == len(self.arrived), 10)
        self.node.close()
        return self

    def latencies_ms(self) -> list[float]:
        return sorted((self.finished[r] - self.arrived[r]) / 1e6 for r in self.arrived)


def poisson(rate_per_s: float, n: int, tokens: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append((int(t * 1e9), tokens))
    return out


def p99(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
