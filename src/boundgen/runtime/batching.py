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

"While a batch runs" is while the device runs it. A function that only queues its device work
(the forward node: a graph replay returns at once) runs on the node's device queue
(`runtime.device_queue`), and the lane forms its next batch only once all but `device_depth - 1` of
its queued batches have run on the device (default 2: the device always has the next batch queued,
and what arrives while it runs one merges into the one after); its cost model learns the device's
time of each batch (or the host's, when that is longer). A node whose requests want host data (the
beam node: each search's rows as lists) names a `finish`: `fn` queues the device work and its
copies to the host, and the lane's finisher thread waits for each batch to run, calls `finish` on
what `fn` returned and answers the batch's requests, while the leader already forms and queues the
next batch. (Until 2026-12-03 the beam node's `fn` waited for its own search: the device idled
while the host turned each search's results into rows and formed the next merge — on the
development machine's fake GPU 48 % of the time at 64 connections.)

Merge policy (`merge_policy`): a merged batch answers all its requests when it ends, so merging
delays each but the last by the others' work, and pays off only by the forwards' fixed cost it
saves. "all" takes everything waiting that fits (the beam node: its fixed cost dominates); "tail"
(the engine's forward node by default, `EngineConfig.batch_merge`) takes the first forward of the
plan over the queue that minimises its requests' completion times (`runtime.merge_plan`), by the
cost model's fixed and per-token costs once they have been told apart — W2-sized requests,
mostly per-token cost, mostly run alone, short prompts merge as before.

Lanes (`lane`): requests of different keys (the beam node: width, steps, trie) queue and
merge apart, each lane with its own leader, and at most `lane_max` of `count` per batch (the
beam node: the prompts of the largest whole-search graph made for the lane).

A function that works in pieces takes an `alive` argument as well: one callable per merged
request, in merge order, true while the request still wants its result (not cancelled, not past
its deadline). It asks between pieces and drops a dead request's rest. Every batch's size and run
time feed a `CostModel`, which predicts the run time of a batch of a given size, and the node turns
it into the time a queue of requests needs as the merged forwards it will become (what admission
control and deadlines compare against). The model learns from steady-state runs only: not a
node's first batch, not the first batch of each shape it can see (`shapes`), not a batch that
`fn` marked with `mark_not_steady()`, not one during which anything in the process compiled or
captured a graph (`compile.events`), not a run far slower than the recent ones predict.
"""

from __future__ import annotations

import inspect
import math
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from boundgen.compile.events import COMPILES
from boundgen.runtime import merge_plan
from boundgen.runtime.device_queue import DeviceQueue, Flight, queue_for
from boundgen.runtime.executor import DeadlineExceeded
from boundgen.runtime.node import Node, NodeKind, PipelineError


class CostModel:
    """Predicted run time of a batch: `fixed × forwards + per_unit × units` (each forward's fixed
    cost — launches, host work, reading the weights — plus a cost per token), a least-squares fit
    over the recent steady-state batches with exponentially decaying weights (`decay` per batch).
    With sizes too alike to tell the two apart, the per-unit cost last told apart is kept (or,
    never told apart, it is the mean time per unit).

    Steady state only. A run that compiled, or the first run of a shape (where a backend may
    compile), says nothing about the next one: on the H200 a merged beam search's first run took
    5.3 s and later ones ~8 ms, and a model that learned from it refused every request as too
    slow. So `observe` does not learn from
    - a run the caller marks `steady=False` (it knows the run compiled, or was otherwise unusual),
    - the first run of each `shape` (a hashable the caller can see; None for all: the first run),
    - once warm, a run over `outlier` × its prediction (a compile nobody marked, a GC pause, a noisy
      neighbour). When the cost really changes for good — the median of the last 9 runs' ratio
      to their prediction leaves [1/outlier, outlier] — the model starts over from the runs that
      follow, so it neither keeps refusing them nor keeps a cost they no longer have.
    Going warm, the fit is redone from the recent runs without those over `outlier` × the median
    of them, so a compile in the first runs (while there was nothing to judge it by) is dropped.
    None until warm: `warm_batches` steady batches of `warm_units` in all (a first tiny batch is
    all fixed cost, and would make every large request look far too slow)."""

    def __init__(
        self,
        decay: float = 0.05,
        warm_batches: int = 3,
        warm_units: int = 2048,
        outlier: float = 3.0,
        window: int = 32,
    ) -> None:
        self.decay = decay
        self.warm_batches = warm_batches
        self.warm_units = warm_units
        self.outlier = outlier
        self.batches = 0  # steady runs learned from since the model (re)started
        self.units = 0
        self.skipped = {"not_steady": 0, "first_of_shape": 0, "outlier": 0}
        self.restarts = 0  # times the cost changed for good and the model started over
        self._shapes: set[Hashable] = set()
        # recent steady runs as (forwards, units, ns): what the fit is redone from going warm
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=9)  # recent runs' ns / prediction, once warm
        # decayed sums over forwards f, units u and ns y: ff, fu, uu, fy, uy
        self._sums = [0.0] * 5
        self._told_per_unit_ns: float | None = None  # the per-unit cost, once told from fixed
        # (fixed ns, per-unit ns): one tuple, so a reader on another thread sees one fit
        self._fit = (0.0, 0.0)

    def observe(
        self,
        units: float,
        ns: float,
        forwards: int = 1,
        shape: Hashable = None,
        steady: bool = True,
    ) -> bool:
        """One batch ran `units` in `forwards` forwards in `ns`. Returns whether it was taken as
        steady state (learned from). NOTE: called by the one thread that runs the node's
        batches."""
        if not steady:
            self.skipped["not_steady"] += 1
            return False
        if shape not in self._shapes:
            self._shapes.add(shape)
            self.skipped["first_of_shape"] += 1
            return False
        if self.warm and not self._usual(units, ns, forwards):
            return False
        run = (float(forwards), float(units), float(ns))
        self._recent.append(run)
        self._add(run)
        was_warm = self.warm
        self.batches += 1
        self.units += units
        if self.warm and not was_warm:
            self._refit_recent()
        self._solve()
        return True

    def _usual(self, units: float, ns: float, forwards: int) -> bool:
        """Whether a run fits the recent ones; restarts the model when the recent runs, taken
        together, say the cost has changed for good."""
        ratio = ns / max(self.predict_ns(units, forwards), 1.0)
        self._ratios.append(ratio)
        if len(self._ratios) == self._ratios.maxlen and not (
            1 / self.outlier <= statistics.median(self._ratios) <= self.outlier
        ):
            self._restart()
            return True
        if ratio > self.outlier:
            self.skipped["outlier"] += 1
            return False
        return True

    def _restart(self) -> None:
        self.restarts += 1
        self.batches = self.units = 0
        self._recent.clear()
        self._ratios.clear()
        self._sums = [0.0] * 5

    def _add(self, run: tuple[float, float, float]) -> None:
        # one list of the five decayed sums, no loop over them: 0.44 → 0.22 µs a batch on the
        # 2-core dev CPU (2026-12-06)
        f, u, y = run
        keep = 1.0 - self.decay
        ff, fu, uu, fy, uy = self._sums
        self._sums = [
            ff * keep + f * f,
            fu * keep + f * u,
            uu * keep + u * u,
            fy * keep + f * y,
            uy * keep + u * y,
        ]

    def _refit_recent(self) -> None:
        """The sums again from the recent runs, leaving out any whose time is over `outlier` ×
        what the fit of them all predicts, relative to the median run (a run that compiled before
        there was anything to judge it by)."""
        self._sums = [0.0] * 5
        for run in self._recent:
            self._add(run)
        self._solve()
        ratios = [y / max(self.predict_ns(u, f), 1.0) for f, u, y in self._recent]
        typical = statistics.median(ratios)
        kept = [r <= self.outlier * typical for r in ratios]
        if all(kept):
            return
        self.skipped["outlier"] += kept.count(False)
        self._recent = deque((r for r, k in zip(self._recent, kept) if k), self._recent.maxlen)
        self._sums = [0.0] * 5
        for run in self._recent:
            self._add(run)

    def _solve(self) -> None:
        ff, fu, uu, fy, uy = self._sums
        det = ff * uu - fu * fu
        # sizes differ enough (their spread over 10 % of their scale) to tell fixed from per unit
        if det > 0.01 * ff * uu:
            fixed, per_unit = (uu * fy - fu * uy) / det, (ff * uy - fu * fy) / det
            if fixed >= 0.0 and per_unit > 0.0:
                self._fit = (fixed, per_unit)
                self._told_per_unit_ns = per_unit
                return
        per_unit = self._told_per_unit_ns
        if per_unit is not None and fy - per_unit * fu >= 0.0:  # the known slope, through the mean
            self._fit = ((fy - per_unit * fu) / ff, per_unit)
            return
        self._fit = (0.0, uy / uu if uu > 0 else 0.0)

    @property
    def warm(self) -> bool:
        return self.batches >= self.warm_batches and self.units >= self.warm_units

    def predict_ns(self, units: float, forwards: int = 1) -> float:
        """The fit's run time, warm or not (0 before any run)."""
        fixed, per_unit = self._fit
        return fixed * forwards + per_unit * units

    def told_fit(self) -> tuple[float, float] | None:
        """(fixed ns a forward, ns a unit) once warm and the two have been told apart (batches of
        sizes spread enough, once), else None: a fit from sizes all alike puts all the cost per
        unit, and a plan trusting it would never merge (`merge_plan`)."""
        if not self.warm or self._told_per_unit_ns is None:
            return None
        return self._fit

    def units_within(self, ms: float) -> float | None:
        """Units of one forward predicted to run in `ms` (0 when even the fixed part takes
        longer; None while cold)."""
        if not self.warm:
            return None
        fixed, per_unit = self._fit
        if per_unit <= 0.0:
            return math.inf
        return max(0.0, (ms * 1e6 - fixed) / per_unit)

    def predict_ms(self, units: float, forwards: int = 1) -> float | None:
        """Run time of a batch of `units` in `forwards` forwards (None while cold)."""
        if not self.warm:
            return None
        return self.predict_ns(units, forwards) / 1e6

    def stats(self) -> dict[str, Any]:
        fixed, per_unit = self._fit
        return {
            "warm": self.warm,
            "fixed_ms": fixed / 1e6,
            "per_unit_us": per_unit / 1e3,
            "steady_batches": self.batches,
            "skipped": dict(self.skipped),
            "restarts": self.restarts,
        }


_marks = threading.local()


def mark_not_steady() -> None:
    """Called from inside a batching node's `fn` (on the thread that runs the batch), e.g. by
    code that just compiled: the batch in progress is not steady state, and its run time does
    not teach the node's cost model."""
    _marks.unsteady = True


def _takes_alive(fn: Callable[..., Any]) -> bool:
    try:
        return "alive" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


class _Item:
    __slots__ = ("args", "arrival_ns", "count", "done", "req", "size")

    def __init__(
        self,
        req: Any,
        args: dict[str, Any],
        done: Callable[..., None],
        size: int,
        now: int,
        count: int = 1,
    ):
        self.req, self.args, self.done, self.size = req, args, done, size
        self.arrival_ns = now
        self.count = count


class _Lane:
    """One queue of a batching node: its waiting requests, its leader slot, its batcher thread
    (and with `finish` its finisher thread) and the batch it runs now. Requests of different
    lanes never share a batch, and lanes are formed and run side by side (their device work goes
    to the node's CUDA stream — one unless the node's `fn` is safe to run twice at once
    (`batch_streams`): CUDA graphs that share a memory pool must not run concurrently)."""

    __slots__ = (
        "finisher",
        "in_flight",
        "key",
        "kick",
        "leaders",
        "running",
        "thread",
        "to_finish",
        "waiting",
    )

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.waiting: deque[_Item] = deque()
        self.in_flight: deque[_Queued] = deque()  # batches queued on the device, oldest first
        self.leaders = 0
        self.kick: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        # with `finish`: the batches whose results the finisher thread makes, in launch order
        self.to_finish: queue.SimpleQueue = queue.SimpleQueue()
        self.finisher: threading.Thread | None = None
        # (tokens, requests, forwards, start ns) of the batch running now, else None; one tuple
        # so a reader on another thread sees one batch's values
        self.running: tuple[int, int, int, int] | None = None


class _Queued:
    """A batch whose device work is queued: what its cost observation needs once it has run,
    and with `finish` what its requests are answered from (`finish_with`)."""

    __slots__ = ("flight", "forwards", "host_ns", "outputs", "shapes", "steady", "units")

    def __init__(
        self, flight: Flight, units: int, shapes: Sequence[Hashable], host_ns: int, steady: bool
    ) -> None:
        self.flight, self.units, self.host_ns, self.steady = flight, units, host_ns, steady
        self.forwards, self.shapes = len(shapes), frozenset(shapes)
        # with `finish`: (requests, what `fn` returned, `merge`'s sizes, batch start ns)
        self.outputs: tuple[list[_Item], Any, Any, int] | None = None


_OVERFLOW = ("<overflow>",)  # the lane of every key past `max_lanes` (their requests may merge)
# `late_merge`: the share of a running batch's predicted device time a lane waits before forming
# the next one (below 1: a prediction a little long must not leave the device idle), and the least
# time left before its predicted end to form and launch it in. BOUNDGEN_LATE_MERGE_SHARE sets the
# share for an A/B: with two streams (`batch_streams`) a batch formed earlier starts beside the
# running one — fewer requests merged, more overlap (0.5 did not make two beam streams win over
# one, H200 2026-12-04); with one, a later share merges more requests a batch.
LATE_MERGE_SHARE = float(os.environ.get("BOUNDGEN_LATE_MERGE_SHARE", "0.8"))
if not 0.0 <= LATE_MERGE_SHARE <= 1.0:
    raise ValueError(f"BOUNDGEN_LATE_MERGE_SHARE={LATE_MERGE_SHARE}: expected 0 to 1")
LATE_MERGE_MARGIN_NS = 1_000_000
MERGE_POLICIES = ("all", "tail")  # `BatchingNode(merge_policy=...)`


def _drop_failed_heads(waiting) -> None:
    """Pop the requests at the head of a lane's queue that were cancelled or failed while they
    waited."""
    while waiting and waiting[0].req.failed:
        waiting.popleft()


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
    - `shapes(list_of_input_dicts) -> list`: one hashable per forward the merged batch runs, the
      shape it runs at (the beam node: one search per width, steps, trie and prompt count). The
      cost model counts a fixed cost per forward, and does not learn from a batch with a shape
      it has not seen (a backend may compile once per shape). Default: one forward, one shape
      (so only the node's first batch is skipped).
    - `latency_target_ms`: adapt the token budget to the cost model (module docstring); None:
      always `token_budget`.
    - `merge_policy`: "all" (default) — a batch takes everything waiting that fits; "tail" —
      once the cost model has told a forward's fixed cost from its per-token cost, a batch takes
      the first forward of the plan that minimises the waiting requests' completion times
      (`runtime.merge_plan`): it merges where the fixed cost saved outweighs the wait added to
      the requests already in the batch, which all end with it (a W2-sized forward, mostly
      per-token cost: few merges; a short prompt's, mostly fixed: all).
    - `lane(inputs) -> hashable`: requests of different lanes never share a batch; each lane has
      its own queue, leader and batcher thread, so a batch of one lane is never formed behind a
      batch of another, nor answered after it (with `finish`, each lane has its own finisher;
      their device work shares the node's stream). The beam node: one lane per width, steps and
      trie. At most `max_lanes` lanes; requests of further keys share one more lane. Default: one
      lane.
    - `count(inputs) -> int` (default 1) and `lane_max(lane_key, inputs) -> int | None`: a batch
      of a lane takes at most `lane_max` of `count` (the beam node: prompts, up to the largest
      whole-search graph made for the lane; `inputs` are the batch's first request's).
    - `finish(launched) -> output`: `fn` only queues the batch's device work and its copies to
      the host and returns what `finish` needs; once the batch has run on the device, the lane's
      finisher thread calls `finish` (host data: the beam node's rows as lists) and `split`, and
      answers the requests with no CUDA event (their outputs are on the host; a later batch of
      another lane, queued on the same stream, would otherwise hold up their completion). On a
      node without a device queue (CPU) `finish` runs right after `fn`.
    - `device_depth`: a lane forms its next batch once at most `device_depth - 1` of its batches
      are still queued on the device (module docstring; 2: one running, the next one queued
      behind it).
    - `batch_streams`: CUDA streams the node's batches take in turn (default 1: one batch on
      the device at a time). Above 1, a batch queued while another runs starts beside it: only
      for a `fn` whose device work is safe to run at once with itself (the beam node's searches,
      one whole-search graph replica per stream: `compile.search_streams`).
    - `late_merge`: once the cost model is warm, a lane forms its next batch only shortly
      before the batch running on the device is predicted to end (`LATE_MERGE_SHARE` of its
      predicted time, less twice its launch's host time and at least `LATE_MERGE_MARGIN_NS`),
      unless the waiting requests already fill a batch or (with `finish`, whose finisher sees
      it) the running batch has ended: what arrives meanwhile merges into it. For a batch
      whose fixed cost dominates (the beam node: a search of 1 prompt 6.1 ms, of 16 9.7 ms on the
      H200), forming the next batch as soon as the device starts the running one made batches of
      a few requests, each paying the fixed cost. Without `finish` (the forward node, with
      `device_depth` 2: only while one batch is on the device) the prediction alone ends the
      wait, so one too long idles the device for the rest; what it buys there is that a request
      arriving while a batch runs goes into the batch after it, not the one after that.
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
        shapes: Callable[[list[dict[str, Any]]], Sequence[Hashable]] | None = None,
        token_budget: int = 8192,
        max_wait_ms: float = 0.0,
        max_batch: int | None = None,
        latency_target_ms: float | None = None,
        merge_policy: str = "all",
        lane: Callable[[dict[str, Any]], Hashable] | None = None,
        count: Callable[[dict[str, Any]], int] | None = None,
        lane_max: Callable[[Hashable, dict[str, Any]], int | None] | None = None,
        max_lanes: int = 16,
        finish: Callable[[Any], Any] | None = None,
        device_depth: int = 2,
        batch_streams: int = 1,
        late_merge: bool = False,
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
        if device_depth < 1:
            raise PipelineError(f"batching node {name!r}: device_depth must be at least 1")
        if latency_target_ms is not None and latency_target_ms <= 0:
            raise PipelineError(f"batching node {name!r}: latency_target_ms must be positive")
        if merge_policy not in MERGE_POLICIES:
            raise PipelineError(
                f"batching node {name!r}: merge_policy={merge_policy!r}, expected one of "
                f"{', '.join(MERGE_POLICIES)}"
            )
        self.merge, self.split, self.size, self.shapes = merge, split, size, shapes
        self.token_budget = int(token_budget)
        self.max_wait_ns = int(max_wait_ms * 1e6)
        self.max_batch = max_batch
        self.latency_target_ms = latency_target_ms
        self.merge_policy = merge_policy
        self.lane, self.count, self.lane_max = lane, count, lane_max
        self.max_lanes = max(1, int(max_lanes))
        self._clock = clock
        self._cv = threading.Condition(threading.Lock())
        self._lanes: dict[Hashable, _Lane] = {}
        self._queue: DeviceQueue | None = None
        self._queue_made = False
        self.finish = finish
        self.device_depth = int(device_depth)
        self.batch_streams = max(1, int(batch_streams))
        self.late_merge = late_merge
        self._closed = False
        self._pass_alive = _takes_alive(fn)
        self.cost = CostModel()
        # Counters, updated under the condition's lock.
        self.batches = 0
        self.batched_requests = 0
        self.batched_tokens = 0
        self.max_requests_in_batch = 0
        self.planned_cuts = 0  # batches the tail plan ended with requests left that would fit
        # stream time of the paced batches that have run, launch to end: the GPU's busy time plus
        # any wait for the host's launch (a host-bound node reads ~100 % too; compare batch_run)
        self.device_ns = 0.0
        self.paced_wait_ns = 0  # leaders blocked on the device before their next batch
        # host time of forming and launching the batches (merge + the call that queues their
        # device work): with a device queue the device idles for it whenever the batch before
        # ends first, and that idle counts in `device_ns` (a launch's stream time starts before it)
        self.launch_ns = 0
        self.last_budget = self.token_budget  # the budget the last batch was formed under

    # ---- executor side
    # -----------------------------------------------------------------------------------

    def start(self, req: Any, args: dict[str, Any], done: Callable[..., None]) -> None:
        size = self.size(args) if self.size is not None else 1
        count = self.count(args) if self.count is not None else 1
        item = _Item(req, args, done, size, self._clock(), count)
        key = self.lane(args) if self.lane is not None else None
        with self._cv:
            lane = self._lane_of(key)
            lane.waiting.append(item)
            if lane.leaders:
                self._cv.notify_all()  # a leader that is waiting for more may take it now
                return
            lane.leaders += 1
        self._lead(lane)  # this thread runs the batch

    def _lane_of(self, key: Hashable) -> _Lane:
        """The lane of `key` (made on first use); the caller holds the lock."""
        lane = self._lanes.get(key)
        if lane is None:
            if len(self._lanes) >= self.max_lanes:
                key = _OVERFLOW
                lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(key)
        return lane

    def call_unbatched(self, args: dict[str, Any]) -> tuple[Any, ...]:
        batch, sizes = self.merge([args])
        out = self.fn(batch)
        parts = self.split(self.finish(out) if self.finish is not None else out, sizes)
        return self._as_tuple(parts[0])

    def close(self) -> None:
        """Stop the batcher threads; requests still waiting fail with a clear error."""
        with self._cv:
            self._closed = True
            lanes = list(self._lanes.values())
            left = [it for lane in lanes for it in lane.waiting]
            for lane in lanes:
                lane.waiting.clear()
        for it in left:
            it.done(
                None, RuntimeError(f"batching node {self.name!r} was closed before the request ran")
            )
        threads = [lane.thread for lane in lanes if lane.thread is not None]
        for lane in lanes:
            if lane.thread is not None:
                lane.kick.put(None)
        for t in threads:
            t.join(timeout=5)
        # the finishers answer every batch already queued before they stop: nothing is lost
        finishers = [lane.finisher for lane in lanes if lane.finisher is not None]
        for lane in lanes:
            if lane.finisher is not None:
                lane.to_finish.put(None)
        for t in finishers:
            t.join(timeout=30)
        for lane in lanes:
            lane.thread = lane.finisher = None

    def stats(self) -> dict[str, Any]:
        b = self.batches
        return {
            "batches": b,
            "requests": self.batched_requests,
            "tokens": self.batched_tokens,
            "mean_requests_per_batch": self.batched_requests / b if b else 0.0,
            "max_requests_in_batch": self.max_requests_in_batch,
            "merge": self.merge_policy,
            "planned_cuts": self.planned_cuts,
            "device_seconds": self.device_ns / 1e9,
            "launch_seconds": self.launch_ns / 1e9,
            # how long the lanes' leaders waited for the device before forming their next batch:
            # ~0 a batch at saturation says the host, not the device, sets the pace
            "paced_wait_seconds": self.paced_wait_ns / 1e9,
            "token_budget": self.last_budget,
            "lanes": len(self._lanes),
            "cost": self.cost.stats(),
        }

    # ---- predictions
    # -------------------------------------------------------------------------------------

    def _runs(self) -> list[tuple[int, int, int, int]]:
        return [r for lane in list(self._lanes.values()) if (r := lane.running) is not None]

    def running(self) -> tuple[int, int]:
        """(tokens, requests) of the batches running now (one per busy lane); (0, 0) when
        idle."""
        runs = self._runs()
        return (sum(r[0] for r in runs), sum(r[1] for r in runs))

    def rest_ms(self) -> float:
        """Predicted time left of the batches running now, the longest of them (lanes run side
        by side; 0 when idle or while the cost model is cold)."""
        if not self.cost.warm:
            return 0.0
        now, rest = self._clock(), 0.0
        for tokens, _, forwards, start in self._runs():
            rest = max(rest, self.cost.predict_ns(tokens, forwards) - (now - start))
        return rest / 1e6

    def queue_ms(self, units: float, requests: int = 1) -> float | None:
        """Predicted run time of `units` tokens of `requests` requests as the merged forwards
        they become: at most `token_budget` tokens and `max_batch` requests each, one fixed cost
        per forward plus the per-token cost (not a single-request time per request: merging is
        the point; with `merge_policy="tail"` a queue may run as more forwards, but only where
        the plan found their fixed cost small against the waits it saves). None while the cost
        model is cold."""
        if not self.cost.warm:
            return None
        forwards = max(1, math.ceil(units / self.token_budget))
        if self.max_batch is not None:
            forwards = max(forwards, math.ceil(requests / self.max_batch))
        return self.cost.predict_ns(units, forwards) / 1e6

    # ---- leaders
    # -----------------------------------------------------------------------------------------

    def _as_tuple(self, part: Any) -> tuple[Any, ...]:
        names = self._result_keys
        if len(names) == 1:
            return (part,)
        if isinstance(part, dict):
            return tuple(part[n] for n in names)
        return tuple(part)

    def _lead(self, lane: _Lane) -> None:
        """Form and run one batch of `lane`; the caller holds the lane's leader slot, released
        here. If requests are still waiting afterwards, the lane's batcher thread takes the slot
        and leads the next batch."""
        try:
            batch = self._take(lane)
            if batch:
                self._run_batch(lane, batch)
        finally:
            with self._cv:
                more = bool(lane.waiting) and not self._closed
                if not more:
                    lane.leaders -= 1
            if more:  # keep the slot and hand it to a batcher thread
                self._ensure_thread(lane)
                lane.kick.put(1)

    def _ensure_thread(self, lane: _Lane) -> None:
        with self._cv:
            if lane.thread is not None:
                return
            lane.thread = thread = threading.Thread(
                target=self._background,
                args=(lane,),
                name=f"boundgen-batch-{self.name}-{len(self._lanes)}",
                daemon=True,
            )
        thread.start()

    def _background(self, lane: _Lane) -> None:
        while True:
            if lane.kick.get() is None:
                return
            self._lead(lane)

    def _take(self, lane: _Lane) -> list[_Item]:
        with self._cv:
            waiting = lane.waiting
            _drop_failed_heads(waiting)
            if not waiting:
                return []
            first = waiting.popleft()
            batch = [first]
            tokens, count = first.size, first.count
            most = None
            if self.lane_max is not None and lane.key is not _OVERFLOW:
                most = self.lane_max(lane.key, first.args)
            deadline = first.req.deadline_ns
            wait_until = first.arrival_ns + self.max_wait_ns
            budget = self.last_budget = self._budget(first, waiting)
            planned = self._planned(first, waiting, budget)
            while tokens < budget and (self.max_batch is None or len(batch) < self.max_batch):
                if most is not None and count >= most:
                    break
                if planned is not None and len(batch) >= planned:
                    _drop_failed_heads(waiting)  # not a request the cut kept out
                    if waiting and tokens + waiting[0].size <= budget:
                        self.planned_cuts += 1
                    break
                _drop_failed_heads(waiting)
                if waiting:
                    nxt = waiting[0]
                    if tokens + nxt.size > budget:
                        break  # starts the next batch
                    if most is not None and count + nxt.count > most:
                        break  # a search of its own: the lane's largest graph is full
                    waiting.popleft()
                    batch.append(nxt)
                    tokens += nxt.size
                    count += nxt.count
                    d = nxt.req.deadline_ns
                    if d is not None and (deadline is None or d < deadline):
                        deadline = d
                    continue
                limit = wait_until
                if deadline is not None:  # leave the batch time to run
                    limit = min(limit, deadline - int(self._predicted_ns(tokens, batch)))
                remaining = limit - self._clock()
                if remaining <= 0:
                    break
                self._cv.wait(remaining / 1e9)
            return batch

    def _planned(self, first: _Item, waiting: deque[_Item], budget: int) -> int | None:
        """With `merge_policy="tail"` and a told cost model: how many requests (`first`
        included) the batch takes (`merge_plan.first_forward` over the queue's oldest
        `merge_plan.WINDOW`), when that is fewer than the queue holds; None: no plan's limit
        (the caller holds the lock)."""
        if self.merge_policy != "tail" or not waiting:
            return None
        fit = self.cost.told_fit()
        if fit is None:
            return None
        sizes = [first.size]
        for it in waiting:
            if len(sizes) == merge_plan.WINDOW:
                break
            if not it.req.failed:
                sizes.append(it.size)
        k = merge_plan.first_forward(sizes, *fit, budget, self.max_batch, merge_plan.FUTURE)
        return k if k < len(sizes) else None

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

    def _queue_of(self, executor: Any) -> DeviceQueue | None:
        """This node's device queue (made once, for the first executor that runs it; None on
        CPU or for a CPU node)."""
        if not self._queue_made:
            with self._cv:
                if not self._queue_made:
                    self._queue = (
                        queue_for(executor, self.batch_streams)
                        if self.kind is NodeKind.DEVICE
                        else None
                    )
                    self._queue_made = True
        return self._queue

    def _shapes_of(self, items: list[_Item]) -> Sequence[Hashable]:
        return self.shapes([it.args for it in items]) if self.shapes is not None else (None,)

    def _predicted_ns(self, tokens: int, items: list[_Item]) -> float:
        """The cost model's run time for these items merged; 0 while it is cold (a cost that was
        never measured is not assumed)."""
        if not self.cost.warm:
            return 0.0
        return self.cost.predict_ns(tokens, len(self._shapes_of(items)))

    def _run_batch(self, lane: _Lane, batch: list[_Item]) -> None:
        start = self._clock()
        batch = [it for it in batch if not it.req.failed]
        run_ns = self._predicted_ns(sum(it.size for it in batch), batch)
        live = []
        for it in batch:
            req = it.req
            if req.deadline_ns is not None and start + run_ns > req.deadline_ns:
                it.done(
                    None,
                    DeadlineExceeded(
                        f"request {req.request_id} (pipeline {req.pipeline!r}): deadline of "
                        f"{req.timeout_ms:g} ms cannot be met in batching node {self.name!r} "
                        "(waited "
                        f"{(start - it.arrival_ns) / 1e6:.2f} ms, batch run "
                        f"~{run_ns / 1e6:.2f} ms)",
                        req.pipeline,
                        self.name,
                        req.request_id,
                    ),
                )
            else:
                live.append(it)
        if not live:
            return
        tokens = sum(it.size for it in live)
        shapes = self._shapes_of(live)
        queue = self._queue_of(live[0].req.executor)
        _marks.unsteady = False
        compiles = COMPILES.total()  # a compile anywhere in the process meanwhile: not steady
        lane.running = (tokens, len(live), len(shapes), start)
        flight = None
        try:
            if queue is not None:
                (out, sizes), flight = queue.launch(lambda: self._call(live))
            else:
                out, sizes = self._call(live)
                if self.finish is not None:  # no device queue (CPU): its work has run
                    out = self.finish(out)
            deferred = flight is not None and self.finish is not None
            parts = None if deferred else self._parts(out, sizes, len(live))
        except Exception as exc:
            lane.running = None
            for it in live:
                it.done(None, exc)
            return
        ran = self._clock() - start
        # a request dropped while it ran had not all its work run: not the batch's cost
        steady = not _marks.unsteady and not any(it.req.failed for it in live)
        steady = steady and COMPILES.total() == compiles
        if flight is None:  # the call's time is the batch's: learn it now
            steady = self.cost.observe(tokens, ran, len(shapes), frozenset(shapes), steady)
        with self._cv:
            self._count(len(live), tokens)
            self.launch_ns += ran
        if flight is None:
            self._answer(live, parts, start, ran, steady, None)
        elif deferred:
            queued = _Queued(flight, tokens, shapes, ran, steady)
            queued.outputs = (live, out, sizes, start)
            self._to_finisher(lane, queued)
        else:
            self._answer(live, parts, start, ran, steady, flight.event)
            self._pace(lane, _Queued(flight, tokens, shapes, ran, steady))
        lane.running = None

    def _answer(
        self, live: list[_Item], parts: Sequence[Any], start: int, ran: int, steady: bool, event
    ) -> None:
        """Each request its part of the batch's outputs (with `event`, the device work the
        outputs wait for), and the batch's numbers for its trace."""
        info = {
            "batch_requests": len(live),
            "batch_tokens": sum(it.size for it in live),
            "batch_run_us": round(ran / 1e3, 1),
            "batch_steady": steady,  # False: the executor's estimates leave it out too
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

    def _pace(self, lane: _Lane, queued: _Queued) -> None:
        """Queue `queued` on the lane, then wait until at most `device_depth - 1` of its batches
        are left on the device (the lane's leader slot is held meanwhile, so what arrives waits
        for the next batch); each batch that has run teaches the cost model its time."""
        lane.in_flight.append(queued)
        while len(lane.in_flight) >= self.device_depth:
            done = lane.in_flight.popleft()
            t0 = self._clock()
            done.flight.wait()
            self._learn(done, self._clock() - t0)
        if len(lane.in_flight) == 1:  # the batch just queued runs now (its predecessor has run)
            self._merge_late(lane, queued)

    def _learn(self, queued: _Queued, waited_ns: int) -> bool:
        """A queued batch has run: count its device time (and how long a leader waited for it),
        and teach the cost model its time, the device's or the host's when launching it took
        longer. → whether the model took it as steady state."""
        device_ns = queued.flight.device_ns()
        with self._cv:
            self.device_ns += device_ns
            self.paced_wait_ns += waited_ns
        ns = max(device_ns, queued.host_ns)
        return self.cost.observe(queued.units, ns, queued.forwards, queued.shapes, queued.steady)

    def _to_finisher(self, lane: _Lane, queued: _Queued) -> None:
        """Hand a queued batch of a `finish` node to the lane's finisher, then wait until at most
        `device_depth - 1` of the lane's batches are left on the device (as `_pace`: the leader
        slot is held, so what arrives meanwhile merges into the batch after)."""
        with self._cv:
            lane.in_flight.append(queued)
            if lane.finisher is None:
                lane.finisher = threading.Thread(
                    target=self._finishing,
                    args=(lane,),
                    name=f"boundgen-finish-{self.name}-{len(self._lanes)}",
                    daemon=True,
                )
                lane.finisher.start()
        lane.to_finish.put(queued)
        t0 = self._clock()
        with self._cv:
            while len(lane.in_flight) >= self.device_depth:
                self._cv.wait()
            self.paced_wait_ns += self._clock() - t0
        self._merge_late(lane, queued)

    def _merge_late(self, lane: _Lane, running: _Queued) -> None:
        """With `late_merge`: keep the leader slot (so what arrives waits and merges) until shortly
        before `running`, which the device runs now, is predicted to end, until it has ended (the
        finisher took it: a prediction too long must not leave the device idle), or until the
        waiting requests fill a batch (the class docstring). A node without `finish` has no
        finisher to see the batch end: there only the prediction and a full batch end the wait."""
        if not self.late_merge or not self.cost.warm:
            return
        run_ns = self.cost.predict_ns(running.units, running.forwards)
        margin = max(2 * running.host_ns, LATE_MERGE_MARGIN_NS)
        due = self._clock() + int(LATE_MERGE_SHARE * run_ns) - margin
        with self._cv:
            while running in lane.in_flight and not self._closed and not self._fills_a_batch(lane):
                left = due - self._clock()
                if left <= 0:
                    return
                self._cv.wait(left / 1e9)

    def _fills_a_batch(self, lane: _Lane) -> bool:
        """Whether the lane's waiting requests are a whole batch already (the caller holds the
        lock): the token budget, `max_batch`, or the lane's `lane_max`."""
        waiting = lane.waiting
        if not waiting:
            return False
        if self.max_batch is not None and len(waiting) >= self.max_batch:
            return True
        if sum(it.size for it in waiting) >= self.token_budget:
            return True
        if self.lane_max is None or lane.key is _OVERFLOW:
            return False
        most = self.lane_max(lane.key, waiting[0].args)
        return most is not None and sum(it.count for it in waiting) >= most

    def _finishing(self, lane: _Lane) -> None:
        """The finisher thread of a lane: its queued batches, in launch order, each answered once
        it has run on the device."""
        while True:
            queued = lane.to_finish.get()
            if queued is None:
                return
            live, out, sizes, start = queued.outputs
            queued.outputs = None  # the batch's data goes with its requests' answers
            failed = None
            try:
                queued.flight.wait()
            except Exception as exc:  # the device work failed (a CUDA error): so did the batch
                failed = exc
            finally:
                with self._cv:
                    lane.in_flight.remove(queued)
                    self._cv.notify_all()  # a leader waiting for the device's depth
            try:  # nothing may end this thread: every later batch of the lane waits on it
                if failed is not None:
                    raise failed
                steady = self._learn(queued, 0)
                parts = self._parts(self.finish(out), sizes, len(live))
                self._answer(live, parts, start, self._clock() - start, steady, None)
            except Exception as exc:
                for it in live:  # a request already answered ignores a second outcome
                    it.done(None, exc)

    def _call(self, live: list[_Item]) -> tuple[Any, Any]:
        """The merged batch's `fn` call: (its output, `merge`'s sizes)."""
        batch, sizes = self.merge([it.args for it in live])
        if self._pass_alive:
            return self.fn(batch, alive=[it.req.alive for it in live]), sizes
        return self.fn(batch), sizes

    def _parts(self, out: Any, sizes: Any, n: int) -> Sequence[Any]:
        parts = self.split(out, sizes)
        if len(parts) != n:
            raise RuntimeError(f"split returned {len(parts)} parts for {n} requests")
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
