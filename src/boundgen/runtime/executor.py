"""The executor: runs pipelines for many concurrent requests on CPU worker threads and CUDA streams.

Scheduling, per request:
- A node starts as soon as its inputs are ready. The thread that finishes a node runs its first
  ready successor inline (no thread hop for a chain); further ready successors go to the worker
  pool, so independent branches overlap. `run()` makes the calling thread work for its own request,
  so a synchronous request normally touches no other thread at all (except inside a batching node).
- Joins are counted with `itertools.count` (atomic under the GIL): no lock on the hot path.
- DEVICE nodes run under a stream from the stream pool; each records an event, which is the edge: a
  device successor on another stream waits on it (`stream.wait_event`); a CPU successor whose
  events have not completed yet waits for them on its worker while fewer than half the workers
  wait so, else it is handed to one waiting thread (`device_waits.DeviceWaits`) and runs once they
  have: the device never holds more than half the CPU workers. Without CUDA, device nodes are
  plain calls.
- Deadlines: before a node starts, the request fails with `DeadlineExceeded` when the time left is
  less than the estimated time of the rest of its critical path (running averages per node; a
  batch its batching node did not take as steady state, e.g. one that compiled, is left out), so
  work that cannot make it is not started. An exception in a node fails that request only
  (`NodeError` names the node).
- Cancellation: `RequestFuture.cancel()` ends a request at once (its Future is cancelled); a node
  that runs long asks `ctx.alive()` between its pieces of work and drops the rest of a request
  that was cancelled or passed its deadline (the batching node hands each request's `alive` to
  its function), so a dead request holds the device for one piece at most.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, NamedTuple

from boundgen.host_cores import usable_cores
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.device_waits import DeviceWaits
from boundgen.runtime.memory import Lease, MemoryPools
from boundgen.runtime.node import NodeKind
from boundgen.runtime.trace import RequestTrace, Span, Tracer

_now = time.perf_counter_ns
_get_ident = threading.get_ident


class RuntimeRequestError(RuntimeError):
    """Base of the errors a request can fail with."""


class DeadlineExceeded(RuntimeRequestError, TimeoutError):
    """The request could not finish within its `timeout_ms`; it was dropped before starting more
    work. `started`: it was stopped while a node ran its work (between two pieces of it), rather
    than refused before a node."""

    def __init__(
        self,
        message: str,
        pipeline: str = "",
        node: str = "",
        request_id: int = -1,
        started: bool = False,
    ):
        super().__init__(message)
        self.pipeline, self.node, self.request_id = pipeline, node, request_id
        self.started = started


class NodeError(RuntimeRequestError):
    """A node raised; `node`, `pipeline`, `request_id` say where, `__cause__` is the original
    exception."""

    def __init__(self, message: str, pipeline: str = "", node: str = "", request_id: int = -1):
        super().__init__(message)
        self.pipeline, self.node, self.request_id = pipeline, node, request_id


class ExecutorClosed(RuntimeRequestError):
    pass


class NodeTime(NamedTuple):
    """One node run of one request: time from ready to started (a free worker/stream) and
    running."""

    node: str
    wait_ms: float
    run_ms: float
    info: dict[str, Any] | None = (
        None  # what the node annotated (a batching node: its batch, its wait)
    )


class RequestFuture(Future):
    """The Future `Executor.submit` returns. Once it is done, `timings` lists the request's node
    runs in completion order and `total_ms` its time in the runtime (what a server reports as
    `Server-Timing`).

    `cancel()` ends the request, not only this Future: nodes not started yet never run, and a
    node that is running drops the request's remaining work at its next piece (`ctx.alive()`).
    It returns False once the request has ended."""

    def __init__(self) -> None:
        super().__init__()
        self._spans: list[tuple] = []  # the request's span records, converted only when asked for
        self.total_ms: float | None = None
        self._request: RequestContext | None = None

    def cancel(self) -> bool:
        req = self._request
        if req is None:
            return super().cancel()
        return req._executor._cancel(req)

    @property
    def timings(self) -> list[NodeTime]:
        return [NodeTime(n, (s - r) / 1e6, (e - s) / 1e6, a) for n, s, e, _, r, a in self._spans]


class _PipelineStats:
    """Running per-node duration estimates and the derived rest-of-critical-path estimate per
    node: each node's run (`ema_ns`) and, before a host node, its wait for the device work it
    reads (`wait_ns`) — an async device node (a batching node) answers once its batch is
    launched, so the batch's GPU time is only seen as the wait of the node that reads it."""

    __slots__ = ("ema_ns", "finished", "pipeline", "refresh_every", "rest_ns", "wait_ns")

    def __init__(self, pipeline: Pipeline, refresh_every: int = 16):
        self.pipeline = pipeline
        self.ema_ns = [0.0] * len(pipeline.plan)
        self.wait_ns = [0.0] * len(pipeline.plan)
        self.rest_ns: list[float] = [0.0] * len(pipeline.plan)
        self.finished = 0
        self.refresh_every = refresh_every

    def observe(self, i: int, ns: int) -> None:
        _ema_update(self.ema_ns, i, ns)

    def observe_wait(self, i: int, ns: int) -> None:
        """Node i waited `ns` for its inputs' device work (0: it had run already)."""
        _ema_update(self.wait_ns, i, ns)

    def refresh(self) -> None:
        plan = self.pipeline.plan
        rest = [0.0] * len(plan)
        for p in reversed(plan):  # plan is topologically ordered
            tail = max((rest[s] for s in p.successors), default=0.0)
            rest[p.index] = self.wait_ns[p.index] + self.ema_ns[p.index] + tail
        self.rest_ns = rest


def _ema_update(values: list[float], i: int, ns: int) -> None:
    # NOTE: racy read-modify-write across threads; losing an update only blurs an estimate.
    ema = values[i]
    if ema <= 0.0:
        values[i] = float(ns)
    else:
        sample = min(float(ns), 4.0 * ema)  # one outlier must not make every request look too slow
        values[i] = ema + 0.1 * (sample - ema)


class RequestContext:
    """One request in flight. Nodes that take a `ctx` parameter receive it.

    Public: `request_id`, `pipeline` (name), `deadline_ns` (perf_counter_ns, or None),
    `remaining_ms()`, `stream` (the CUDA stream of the running device node, else None), `lease`
    (pooled buffers released when the request ends: `ctx.lease.host(shape, dtype)`, `.device(...)`,
    `.stage(cpu_tensor)`),
    `annotate(**kw)`
    (extra fields on the running node's trace span).
    """

    __slots__ = (
        "_annotations",
        "_claimed",
        "_completed",
        "_done",
        "_error",
        "_events",
        "_executor",
        "_failed",
        "_future",
        "_home",
        "_joins",
        "_lease",
        "_node_state",
        "_once",
        "_pipe",
        "_rest",
        "_result",
        "_spans",
        "_stats",
        "_streams",
        "_unwrap",
        "_values",
        "_waited",
        "deadline_ns",
        "pipeline",
        "request_id",
        "start_ns",
        "stream",
        "timeout_ms",
    )  # fmt: skip

    def __init__(
        self, executor: Executor, pipe: Pipeline, stats: _PipelineStats, timeout_ms: float | None
    ):
        self.request_id = next(executor._ids)
        self.pipeline = pipe.name
        self.start_ns = _now()
        self.timeout_ms = timeout_ms
        self.deadline_ns = None if timeout_ms is None else self.start_ns + int(timeout_ms * 1e6)
        self.stream = None
        self._executor = executor
        self._pipe = pipe
        self._stats = stats
        self._rest = stats.rest_ns
        self._values: list[Any] = [None] * pipe.num_slots
        joins = pipe.join_template
        self._joins = [itertools.count() if j else None for j in joins] if pipe.has_joins else joins
        self._completed = itertools.count()
        self._once = itertools.count()
        self._future: Future | None = None  # only for submit(); run() reads _done/_result/_error
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._home: queue.SimpleQueue | None = None
        # (node, start, end, thread, ready, annotations) per node run: the request's Chrome trace
        # when the tracer keeps requests, and its `RequestFuture.timings`
        self._spans: list[tuple] = []
        self._events: list[Any] | None = (
            [None] * len(pipe.plan) if executor.cuda and pipe.has_device_nodes else None
        )
        self._streams: list[Any] | None = (
            [None] * len(pipe.plan) if self._events is not None else None
        )
        self._claimed = bytearray(len(pipe.plan)) if self._events is not None else None
        self._lease: Lease | None = None
        self._failed = False
        self._node_state = bytearray(len(pipe.plan))  # 0 waiting, 1 running, 2 done
        self._annotations: dict[str, Any] | None = None
        # bit i: node i's device wait is observed already (when it resumed), or must not be
        # (every bit: it reads the work of a batch that was not steady, e.g. one that compiled)
        self._waited = 0

    def remaining_ms(self) -> float:
        if self.deadline_ns is None:
            return float("inf")
        return (self.deadline_ns - _now()) / 1e6

    def alive(self) -> bool:
        """Whether work for this request is still wanted: False once it failed or was cancelled,
        or when its deadline has passed (it then fails with `DeadlineExceeded` at once). A node
        that works in pieces asks before each one and drops the rest of a dead request."""
        if self._failed:
            return False
        if self.deadline_ns is not None and _now() > self.deadline_ns:
            running = [p.node.name for p in self._pipe.plan if self._node_state[p.index] == 1]
            node = running[0] if running else ""
            self._executor._fail(
                self,
                DeadlineExceeded(
                    f"request {self.request_id} (pipeline {self.pipeline!r}): deadline of "
                    f"{self.timeout_ms:g} ms passed while node {node or '?'!r} ran; the rest of "
                    "its work was dropped",
                    self.pipeline,
                    node,
                    self.request_id,
                    started=True,
                ),
            )
            return False
        return True

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def lease(self) -> Lease:
        if self._lease is None:
            self._lease = Lease(self._executor.pools)
        return self._lease

    def annotate(self, **fields: Any) -> None:
        if self._annotations is None:
            self._annotations = {}
        self._annotations.update(fields)

    @property
    def failed(self) -> bool:
        return self._failed


class Executor:
    """Runs pipelines: `run(pipeline, inputs, timeout_ms)` (blocking) or `submit(...) -> Future`.

    Results are dicts keyed by the pipeline's output names. Thread-safe; one executor serves every
    pipeline. `cpu_workers` threads serve fan-out branches, `submit()`ed requests and completions of
    async nodes;
    `device_streams` CUDA streams serve device nodes (`device="cpu"` or no CUDA: plain calls).
    """

    def __init__(
        self,
        cpu_workers: int | None = None,
        device_streams: int = 4,
        device: str | None = None,
        pools: MemoryPools | None = None,
        trace_requests: int = 0,
        default_timeout_ms: float | None = None,
        fail_fast: bool = True,
        fanout_us: float = 200.0,
    ) -> None:
        import torch

        from boundgen import cuda_waits

        # two per core this process may use (a container's CPU limit counts, `host_cores`), at
        # most 8
        self.cpu_workers = max(1, cpu_workers or min(8, usable_cores() * 2))
        want_cuda = device is None or str(device).startswith("cuda")
        self.cuda = bool(want_cuda and torch.cuda.is_available())
        self.device = (
            torch.device("cuda" if self.cuda else "cpu") if device is None else torch.device(device)
        )
        if self.device.type == "cuda" and not self.cuda:
            raise RuntimeError("Executor(device='cuda') but CUDA is not available")
        self._torch = torch
        # the events' waits sleep or spin (`BOUNDGEN_CUDA_WAIT`, `cuda_waits`)
        self._blocking = cuda_waits.policy() == "block"
        self.streams = (
            [torch.cuda.Stream(device=self.device) for _ in range(max(1, device_streams))]
            if self.cuda
            else []
        )
        self._stream_rr = itertools.count()
        self._device_waits = DeviceWaits()
        # CPU workers that may wait for the device themselves (at low load a hand-off to the
        # waiting thread only adds latency); past that the waits go to `_device_waits`
        self._inline_waits = self.cpu_workers // 2
        self._waiting_workers = 0
        self._waits_lock = threading.Lock()
        self.pools = pools or MemoryPools(self.device)
        self.tracer = Tracer(keep_requests=trace_requests)
        self.default_timeout_ms = default_timeout_ms
        self.fail_fast = fail_fast
        self.fanout_ns = fanout_us * 1e3
        self._ids = itertools.count(1)
        self._stats: dict[int, _PipelineStats] = {}
        self._stats_lock = threading.Lock()
        self._async_nodes: dict[int, Any] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._workers = [
            threading.Thread(target=self._worker, name=f"boundgen-cpu-{i}", daemon=True)
            for i in range(self.cpu_workers)
        ]
        for t in self._workers:
            t.start()

    # ---- public API
    # -------------------------------------------------------------------------------------

    def submit(
        self,
        pipeline: Pipeline,
        inputs: dict[str, Any],
        timeout_ms: float | None = None,
        unwrap: bool = False,
    ) -> RequestFuture:
        """Start a request on the worker pool; the Future resolves to the outputs dict (the
        single output's value with `unwrap`) or raises `DeadlineExceeded` / `NodeError` / a
        node's pass-through error, and then carries the request's node `timings`."""
        fut = RequestFuture()
        req = self._new_request(pipeline, inputs, timeout_ms, unwrap, fut)
        fut._request = req
        if not req._done:
            now = _now()
            for i in pipeline.sources:
                self._queue.put((req, i, now))
        return fut

    def run(
        self,
        pipeline: Pipeline,
        inputs: dict[str, Any],
        timeout_ms: float | None = None,
        unwrap: bool = False,
    ) -> Any:
        """Run a request, the calling thread doing the work (plus pool threads for parallel
        branches)."""
        req = self._new_request(pipeline, inputs, timeout_ms, unwrap)
        if not req._done:
            home = req._home = queue.SimpleQueue()
            now = _now()
            sources = pipeline.sources
            for i in sources[1:]:
                self._queue.put((req, i, now))
            self._drive(req, sources[0], now)
            while not req._done:
                if req.deadline_ns is None:
                    item = home.get()
                else:
                    # Wait for async nodes (batching) at most until the deadline (+ a grace for the
                    # last step).
                    wait_s = max(0.0, (req.deadline_ns - _now()) / 1e9) + 0.05
                    try:
                        item = home.get(timeout=wait_s)
                    except queue.Empty:
                        running = [
                            p.node.name for p in pipeline.plan if req._node_state[p.index] == 1
                        ]
                        self._fail(
                            req,
                            DeadlineExceeded(
                                f"request {req.request_id} (pipeline {pipeline.name!r}): deadline "
                                "of "
                                f"{req.timeout_ms:g} ms passed while waiting for node(s) "
                                f"{', '.join(running) or '?'}",
                                pipeline.name,
                                running[0] if running else "",
                                req.request_id,
                            ),
                        )
                        break
                if item is None:
                    continue
                self._drive(*item)
        if req._error is not None:
            raise req._error
        return req._result

    def stats(self) -> dict[str, Any]:
        """Node latency histograms per pipeline, memory pool counters and error counts."""
        return {
            "nodes": self.tracer.node_stats(),
            "memory": self.pools.stats(),
            "errors": dict(self.tracer.errors),
            "inflight": self._inflight,
        }

    def estimate_ms(self, pipeline: Pipeline) -> float:
        """Current estimate of the pipeline's critical path (what fail-fast compares with the
        deadline)."""
        st = self._stats_for(pipeline)
        return max(st.rest_ns[i] for i in pipeline.sources) / 1e6

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for node in list(self._async_nodes.values()):
            close = getattr(node, "close", None)
            if close:
                close()
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(timeout=5)
        self._device_waits.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals
    # --------------------------------------------------------------------------------------

    def _stats_for(self, pipeline: Pipeline) -> _PipelineStats:
        st = self._stats.get(id(pipeline))
        if st is None or st.pipeline is not pipeline:
            with self._stats_lock:
                st = self._stats.get(id(pipeline))
                if st is None or st.pipeline is not pipeline:
                    st = self._stats[id(pipeline)] = _PipelineStats(pipeline)
                    for p in pipeline.plan:
                        if p.node.is_async:
                            self._async_nodes[id(p.node)] = p.node
        return st

    def _new_request(
        self,
        pipeline: Pipeline,
        inputs: dict[str, Any],
        timeout_ms: float | None,
        unwrap: bool = False,
        future: Future | None = None,
    ) -> RequestContext:
        if unwrap and len(pipeline.output_slots) != 1:
            raise ValueError(
                f"unwrap needs a pipeline with one output; {pipeline.name!r} has "
                f"{len(pipeline.outputs)}"
            )
        if self._closed:
            raise ExecutorClosed("executor is closed")
        if timeout_ms is None:
            timeout_ms = self.default_timeout_ms
        req = RequestContext(self, pipeline, self._stats_for(pipeline), timeout_ms)
        req._unwrap = unwrap
        req._future = future
        values = req._values
        try:
            for name, slot in pipeline.input_slots:
                values[slot] = inputs[name]
        except KeyError:
            defaults = pipeline.defaults
            for name, slot in pipeline.input_slots:
                if name in inputs:
                    values[slot] = inputs[name]
                elif name in defaults:
                    values[slot] = defaults[name]
                else:
                    raise ValueError(
                        f"pipeline {pipeline.name!r} needs input {name!r} (inputs: "
                        f"{', '.join(pipeline.inputs)})"
                    ) from None
        if len(inputs) != len(pipeline.input_slots):
            extra = sorted(set(inputs) - pipeline.inputs.keys())
            if extra:
                raise ValueError(
                    f"pipeline {pipeline.name!r} got unknown input(s) "
                    f"{', '.join(map(repr, extra))} "
                    f"(inputs: {', '.join(pipeline.inputs)})"
                )
        with self._inflight_lock:
            self._inflight += 1
        if timeout_ms is not None and timeout_ms <= 0:
            self._fail(
                req,
                DeadlineExceeded(
                    f"request {req.request_id} (pipeline {pipeline.name!r}): "
                    f"timeout_ms={timeout_ms:g} leaves no time",
                    pipeline.name,
                    "",
                    req.request_id,
                ),
            )
        return req

    def _worker(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            if type(item) is tuple:
                self._drive(*item)
            else:  # a chore handed over by another thread (settling a cancelled request)
                item()

    def _dispatch(self, req: RequestContext, i: int, ready_ns: int, home: bool) -> None:
        if home and req._home is not None:
            req._home.put((req, i, ready_ns))
        else:
            self._queue.put((req, i, ready_ns))

    def _drive(self, req: RequestContext, i: int, ready_ns: int) -> None:
        """Run node i, then keep running ready successors on this thread; hand a successor to the
        pool only when it is expected to take long enough (`fanout_us`) for overlap to pay for
        the thread hop."""
        try:
            pending = [(i, ready_ns)]
            ema = req._stats.ema_ns
            fanout_ns = self.fanout_ns
            while pending:
                i, ready_ns = pending.pop()
                nxt = self._step(req, i, ready_ns)
                if not nxt:
                    continue
                now = _now()
                for j in reversed(nxt[1:]):
                    if ema[j] < fanout_ns:
                        pending.append((j, now))
                    else:
                        self._dispatch(req, j, now, home=False)
                pending.append((nxt[0], now))
        except BaseException as exc:  # an executor bug must still fail the request, not hang it
            self._fail(
                req, NodeError(f"internal runtime error: {exc!r}", req.pipeline, "", req.request_id)
            )
            if not isinstance(exc, Exception):
                raise

    def _step(self, req: RequestContext, i: int, ready_ns: int) -> list[int] | tuple:
        if req._failed:
            return ()
        pipe = req._pipe
        p = pipe.plan[i]
        node = p.node
        start = _now()
        if (
            req.deadline_ns is not None
            and start + (req._rest[i] if self.fail_fast else 0) > req.deadline_ns
        ):
            self._deadline(req, p, start)
            return ()
        stream = None
        if req._events is not None:
            if node.kind is NodeKind.DEVICE and node.is_async:
                self._async_device_prologue(req, p)
            elif node.kind is NodeKind.DEVICE:
                stream = self._device_prologue(req, p)
            else:
                unfinished = self._unfinished_inputs(req, p)
                if unfinished and not self._reserve_wait():  # run it once they have completed
                    self._device_waits.after(
                        unfinished, functools.partial(self._resume, req, i, ready_ns, start)
                    )
                    return ()
                if unfinished:  # few workers are waiting: wait here, no hand-off
                    try:
                        for ev in unfinished:
                            ev.synchronize()
                    finally:
                        with self._waits_lock:
                            self._waiting_workers -= 1
                    # the device wait counts as the node's wait, as on the `DeviceWaits` path:
                    # counted as its run, a W5 `finish` "took" 14 ms in the slowest 1 % (H100,
                    # 2026-12-05) and its run-time average, which sends a quick node's resume
                    # to the waiting thread (`_resume`), held GPU time. The deadlines take it
                    # as the node's device wait.
                    waited_from, start = start, _now()
                    if not req._waited >> i & 1:
                        req._stats.observe_wait(i, start - waited_from)
                elif not req._waited >> i & 1:  # (resumed: observed in `_resume`)
                    req._stats.observe_wait(i, 0)
        values = req._values
        args = {name: values[slot] for name, slot in zip(p.arg_names, p.arg_slots)}
        req._node_state[i] = 1
        if node.is_async:
            self._start_async(req, p, args, start, ready_ns)
            return ()
        try:
            if stream is not None:
                req.stream = stream
                with self._torch.cuda.stream(stream):
                    outs = node.call(args, req)
                ev = self._torch.cuda.Event(blocking=self._blocking)
                ev.record(stream)
                req._events[i] = ev
                req._streams[i] = stream
                req.stream = None
            else:
                outs = node.call(args, req)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise
            self._node_failed(req, node.name, exc)
            return ()
        end = _now()
        for slot, v in zip(p.out_slots, outs):
            values[slot] = v
        self._record(req, p, start, end, ready_ns)
        return self._complete(req, p)

    def _reserve_wait(self) -> bool:
        """Whether this thread may wait for the device itself (then it counts as waiting)."""
        with self._waits_lock:
            if self._waiting_workers < self._inline_waits:
                self._waiting_workers += 1
                return True
            return False

    def _resume(self, req: RequestContext, i: int, ready_ns: int, waited_from: int) -> None:
        """Node i after the device work it reads has run (on the `DeviceWaits` thread): a node
        expected to be quick (`fanout_us`, a `finish` making lists) runs right there, with its
        quick successors — two thread hand-offs fewer on every request; a longer one goes back to
        the worker pool, so the waits behind it are not held up. The device wait counts as the
        node's wait (from `ready_ns`, when its inputs were queued); the deadlines' estimate takes
        it, from `waited_from`, as the node's device wait."""
        if not req._waited >> i & 1:
            req._stats.observe_wait(i, _now() - waited_from)
        req._waited |= 1 << i
        if req._stats.ema_ns[i] < self.fanout_ns:
            self._drive(req, i, ready_ns)
        else:
            self._dispatch(req, i, ready_ns, home=True)

    def _unfinished_inputs(self, req: RequestContext, p: Any) -> list[Any]:
        """Events of the device work node `p`'s inputs come from that has not completed yet."""
        producers = req._pipe.slot_producer
        events = req._events
        out = []
        for slot in p.arg_slots:
            j = producers[slot]
            if j >= 0 and events[j] is not None and not events[j].query():
                out.append(events[j])
        return out

    def _device_prologue(self, req: RequestContext, p: Any) -> Any:
        """Events as edges for device node `p`: the stream it runs on (its first device
        producer's, unclaimed, else one from the pool) waits on the other producers' events.
        (A CPU node waits for its inputs' events in `_step`.)"""
        producers = req._pipe.slot_producer
        events = req._events
        stream = None
        waits = []
        host_inputs = False
        claimed = req._claimed
        for slot in p.arg_slots:
            j = producers[slot]
            if j >= 0 and events[j] is not None:
                s = req._streams[j]
                if stream is None and s is not None and not claimed[j]:
                    claimed[j] = 1  # the first device successor continues on the producer's stream
                    stream = s
                elif s is None or s is not stream:
                    waits.append(events[j])
            else:
                host_inputs = True
        if stream is None:
            stream = self.streams[next(self._stream_rr) % len(self.streams)]
        for ev in waits:
            stream.wait_event(ev)
        if host_inputs:
            # NOTE: a CPU node (or the caller) may have queued device work on the default
            # stream, e.g. a .to("cuda"); pool streams do not synchronize with it implicitly.
            stream.wait_stream(self._torch.cuda.default_stream(self.device))
        return stream

    def _async_device_prologue(self, req: RequestContext, p: Any) -> None:
        """Events as edges for an async device node (a batching node): it launches each batch on
        its own device queue, ordered after the default stream (`CudaQueue.launch`; without a
        queue the batch runs on the leader's default stream). So work a CPU node queued needs
        nothing here, and a device producer's event becomes a wait of the default stream, which
        the batch's launch then waits behind — per request nothing but that: a pool stream's
        `wait_stream` a request was two torch calls, each a GIL round trip, on every `/v1/beam`
        request (3.9 % of the server's GIL samples on an H100 at ~1,500 req/s)."""
        producers = req._pipe.slot_producer
        events = req._events
        default = None
        for slot in p.arg_slots:
            j = producers[slot]
            if j >= 0 and events[j] is not None:
                if default is None:
                    default = self._torch.cuda.default_stream(self.device)
                default.wait_event(events[j])

    def _start_async(
        self,
        req: RequestContext,
        p: Any,
        args: dict[str, Any],
        start: int,
        ready_ns: int,
    ) -> None:
        def done(
            outs: tuple | None,
            exc: BaseException | None = None,
            span_args: dict | None = None,
            event: Any = None,
        ) -> None:
            if req._failed:
                return
            if exc is not None:
                if isinstance(exc, DeadlineExceeded):
                    self._fail(req, exc)
                else:
                    self._node_failed(req, p.node.name, exc)
                return
            end = _now()
            for slot, v in zip(p.out_slots, outs):
                req._values[slot] = v
            if req._events is not None and event is not None:
                req._events[p.index] = event
                req._streams[p.index] = None
            if span_args:
                req.annotate(**span_args)
            self._record(req, p, start, end, ready_ns)
            now = _now()
            for j in self._complete(req, p):
                self._dispatch(req, j, now, home=True)

        try:
            p.node.start(req, args, done)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise
            self._node_failed(req, p.node.name, exc)

    def _record(self, req: RequestContext, p: Any, start: int, end: int, ready_ns: int) -> None:
        self.tracer.histogram(req.pipeline, p.node.name).record_ns(end - start)
        ann, req._annotations = req._annotations, None
        # a batch its node did not take as steady state (e.g. it compiled) says nothing of the
        # next: a deadline estimate learned from it would drop requests that would have made it
        if ann is None or ann.get("batch_steady", True):
            req._stats.observe(p.index, end - start)
        else:  # nor the device time after it: a wait behind a compile would drop what follows
            req._waited = -1
        req._spans.append((p.node.name, start, end, _get_ident(), ready_ns, ann))

    def _complete(self, req: RequestContext, p: Any) -> list[int]:
        req._node_state[p.index] = 2
        ready = []
        plan = req._pipe.plan
        joins = req._joins
        for s in p.successors:
            c = joins[s]
            if c is None or next(c) == plan[s].num_preds - 1:
                ready.append(s)
        if next(req._completed) == len(plan) - 1:
            self._succeed(req)
        return ready

    def _succeed(self, req: RequestContext) -> None:
        if next(req._once) != 0:
            return
        self._settle(req, "ok", "")
        values = req._values
        if req._unwrap:
            result = values[req._pipe.output_slots[0][1]]
        else:
            result = {name: values[slot] for name, slot in req._pipe.output_slots}
        self._resolve(req, result, None)

    def _deadline(self, req: RequestContext, p: Any, now: int) -> None:
        elapsed = (now - req.start_ns) / 1e6
        est = req._rest[p.index] / 1e6
        node = p.node.name
        msg = (
            f"request {req.request_id} (pipeline {req.pipeline!r}): deadline of {req.timeout_ms:g} "
            "ms cannot be met "
            f"before node {node!r} (elapsed {elapsed:.2f} ms, estimated rest {est:.2f} ms)"
        )
        self._fail(req, DeadlineExceeded(msg, req.pipeline, node, req.request_id))

    def _node_failed(self, req: RequestContext, node: str, exc: BaseException) -> None:
        passthrough = req._pipe.node_by_name[node].raises
        if passthrough and isinstance(exc, passthrough):
            exc.add_note(
                f"(in node {node!r} of pipeline {req.pipeline!r}, request {req.request_id})"
            )
            self._fail(req, exc)
            return
        err = NodeError(
            f"request {req.request_id} (pipeline {req.pipeline!r}): node {node!r} failed: "
            f"{type(exc).__name__}: {exc}",
            req.pipeline,
            node,
            req.request_id,
        )
        err.__cause__ = exc
        self._fail(req, err)

    def _fail(self, req: RequestContext, err: BaseException) -> None:
        req._failed = True
        if next(req._once) != 0:
            return
        self._settle(req, "deadline" if isinstance(err, DeadlineExceeded) else "error", str(err))
        self._resolve(req, None, err)

    def _cancel(self, req: RequestContext) -> bool:
        """End a request for its caller: its Future is cancelled now; its accounting (and the wait
        for device work already queued for it) is left to a worker thread, so that a caller on an
        event loop never blocks."""
        req._failed = True
        if next(req._once) != 0:
            return False
        req._done = True
        Future.cancel(req._future)
        self._queue.put(functools.partial(self._settle, req, "cancelled", "cancelled"))
        return True

    def _settle(self, req: RequestContext, status: str, error: str) -> None:
        """Wait for the request's device work, then account for its end (once per request)."""
        try:
            if req._events is not None:
                for ev in req._events:
                    if ev is not None:
                        ev.synchronize()
        finally:
            self._end(req, status, error)

    def _resolve(self, req: RequestContext, result: Any, error: BaseException | None) -> None:
        """Hand the outcome to whoever waits: the Future of `submit`, the home queue of `run`."""
        req._result, req._error = result, error
        req._done = True
        fut = req._future
        if fut is not None:
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            _unlink(fut)
        if req._home is not None:
            req._home.put(None)

    def _end(self, req: RequestContext, status: str, error: str) -> None:
        with self._inflight_lock:
            self._inflight -= 1
        end = _now()
        if req._lease is not None:
            req._lease.release_all()
        st = req._stats
        st.finished += 1
        if st.finished % st.refresh_every == 1 or st.finished < st.refresh_every:
            st.refresh()
        tracer = self.tracer
        tracer.request_histogram(req.pipeline).record_ns(end - req.start_ns)
        fut = req._future
        if isinstance(
            fut, RequestFuture
        ):  # before the result is set: a waiter may read them at once
            fut._spans = req._spans
            fut.total_ms = (end - req.start_ns) / 1e6
        if status == "cancelled":  # its Future was cancelled before: the last use of the link
            _unlink(fut)
        if status != "ok":
            tracer.count_error(req.pipeline, status)
        if tracer.keep_requests:
            trace = RequestTrace(req.request_id, req.pipeline, req.start_ns, end, status, error)
            trace.spans = [Span(n, s, e, t, r, a) for (n, s, e, t, r, a) in req._spans]
            tracer.keep(trace)


def _unlink(fut: Any) -> None:
    """Drop a finished request's Future → context link. Future and context refer to each other
    while the request runs (`cancel()` needs the context); left in place, every finished request
    is a reference cycle that only the collector frees: the request's whole graph (inputs,
    token lists, outputs) survives into the oldest generation, and on the H200 each full
    collection then walked it for 0.5-1.3 s during W5 load (2026-12-02). Unlinked, a request is
    freed by reference counting the moment its caller lets go of it."""
    if isinstance(fut, RequestFuture):
        fut._request = None


def call_directly(pipeline: Pipeline, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run a pipeline's functions in topological order on this thread, with no executor (the
    baseline the overhead benchmark compares against, and a debugging aid)."""
    values: list[Any] = [None] * pipeline.num_slots
    for name, slot in pipeline.input_slots:
        values[slot] = inputs[name]
    for p in pipeline.plan:
        if p.node.is_async:
            outs = p.node.call_unbatched({n: values[s] for n, s in zip(p.arg_names, p.arg_slots)})
        else:
            outs = p.node.call({n: values[s] for n, s in zip(p.arg_names, p.arg_slots)}, None)
        for slot, v in zip(p.out_slots, outs):
            values[slot] = v
    return {name: values[slot] for name, slot in pipeline.output_slots}
