"""No CPU worker waits for the device: a CPU node that reads a device node's outputs is held by
`DeviceWaits` until the device work has completed, then runs on a worker. The executor's CUDA
path is driven here with fake streams and events that complete when the test says (the same code
runs on the GPU with CUDA's)."""

from __future__ import annotations

import contextlib
import threading
import types

import pytest

from boundgen.runtime import Executor, Pipeline, node
from boundgen.runtime.device_waits import DeviceWaits


class FakeEvent:
    def __init__(self) -> None:
        self.done = threading.Event()

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10), "the device never finished"


class FakeStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def test_waits_run_their_continuations_once_the_events_completed():
    waits = DeviceWaits()
    a, b = FakeEvent(), FakeEvent()
    ran: list[str] = []
    finished = threading.Semaphore(0)

    def then(name):
        ran.append(name)
        finished.release()

    waits.after([a], lambda: then("a"))
    waits.after([b], lambda: then("b"))
    assert not finished.acquire(timeout=0.05) and ran == []
    a.done.set()
    assert finished.acquire(timeout=10) and ran == ["a"]
    b.done.set()
    assert finished.acquire(timeout=10) and ran == ["a", "b"]
    waits.close()
    with pytest.raises(RuntimeError, match="closed"):
        waits.after([], lambda: None)


def test_a_failing_continuation_does_not_stop_the_thread():
    waits = DeviceWaits()
    done = threading.Event()
    waits.after([], lambda: 1 / 0)
    waits.after([], done.set)
    assert done.wait(10)
    waits.close()


@pytest.fixture(params=[1])
def fake_cuda_executor(request):
    """An executor on its CUDA path: events and streams are fakes; `param` CPU workers."""
    events: list[FakeEvent] = []

    def make_event(*a, **kw):
        ev = FakeEvent()
        events.append(ev)
        return ev

    cuda = types.SimpleNamespace(
        Event=make_event,
        stream=lambda s: contextlib.nullcontext(),
        default_stream=lambda device=None: FakeStream(),
    )
    ex = Executor(cpu_workers=request.param, device="cpu")
    ex.cuda, ex._torch, ex.streams = True, types.SimpleNamespace(cuda=cuda), [FakeStream()]
    yield ex, events
    for ev in events:
        ev.done.set()
    ex.close()


@node(outputs="y", kind="device")
def on_device(x: int) -> int:
    return x * 10


@node(outputs="z")
def on_host(y: int) -> int:
    return y + 1


def test_a_cpu_node_after_device_work_does_not_hold_the_worker(fake_cuda_executor):
    ex, events = fake_cuda_executor
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    first = ex.submit(pipe, {"x": 1}, unwrap=True)
    for _ in range(1000):
        if events:
            break
        threading.Event().wait(0.005)
    assert len(events) == 1  # the first request's device node ran and recorded its event
    # the only worker is free while that device work runs: the second request's device node runs
    second = ex.submit(pipe, {"x": 2}, unwrap=True)
    for _ in range(1000):
        if len(events) == 2:
            break
        threading.Event().wait(0.005)
    assert len(events) == 2 and not first.done() and not second.done()
    events[0].done.set()
    assert first.result(timeout=10) == 11
    assert not second.done()  # its device work has not run yet
    events[1].done.set()
    assert second.result(timeout=10) == 21


def test_run_on_the_callers_thread_waits_for_the_device(fake_cuda_executor):
    ex, events = fake_cuda_executor
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    threading.Timer(0.05, lambda: [ev.done.set() for ev in list(events)]).start()
    assert ex.run(pipe, {"x": 3}, unwrap=True) == 31


def _until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("fake_cuda_executor", [2], indirect=True)
def test_at_most_half_the_workers_wait_for_the_device(fake_cuda_executor):
    """With 2 workers one may wait for the device itself (no hand-off at low load); the next
    request's wait goes to the waiting thread, so the other worker stays free."""
    ex, events = fake_cuda_executor
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    futures = []
    for k in range(3):
        futures.append(ex.submit(pipe, {"x": k}, unwrap=True))
        _until(lambda n=k + 1: len(events) == n, f"device node {k}")
    # three device nodes ran while no device work had completed: one worker waits, one is free
    assert ex._waiting_workers == 1 and not any(f.done() for f in futures)
    for ev in events:
        ev.done.set()
    assert [f.result(timeout=10) for f in futures] == [1, 11, 21]
    assert ex._waiting_workers == 0


@pytest.mark.parametrize("fake_cuda_executor", [2], indirect=True)
def test_a_worker_s_own_device_wait_counts_as_the_node_s_wait_not_its_run(fake_cuda_executor):
    """A worker that waits for the device itself (few are waiting) records that time as the
    node's wait (start − ready), as the waiting thread's path does: not as its run, whose
    average decides where a quick node resumes and feeds the deadlines."""
    ex, events = fake_cuda_executor
    ex.tracer.keep_requests = 4
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    threading.Timer(0.2, lambda: [ev.done.set() for ev in list(events)]).start()
    assert ex.submit(pipe, {"x": 1}, unwrap=True).result(timeout=10) == 11
    (trace,) = ex.tracer.recent()
    span = next(s for s in trace.spans if s.node == "on_host")
    assert span.start_ns - span.ready_ns >= 150e6  # the 0.2 s the device "ran"
    assert span.end_ns - span.start_ns < 50e6
    assert ex.tracer.histogram("p", "on_host").snapshot()["max_us"] < 50e3


class _CountedEvent(FakeEvent):
    def __init__(self) -> None:
        super().__init__()
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1
        super().synchronize()


def test_a_cuda_flight_that_has_run_is_not_synchronized():
    """A batch's flight is waited on with `synchronize` only while it runs: `synchronize` gives
    the GIL up (beside a busy thread, up to the switch interval to take it back)."""
    from boundgen.runtime.device_queue import _CudaFlight

    end = _CountedEvent()
    flight = _CudaFlight(FakeEvent(), end)
    threading.Timer(0.05, end.done.set).start()
    flight.wait()  # still running: waits
    assert end.synchronized == 1 and end.query()
    flight.wait()  # has run: no wait
    assert end.synchronized == 1


class _Flight:
    """A device queue's flight that has run (the batching node's launch, faked)."""

    def __init__(self) -> None:
        self.event = FakeEvent()
        self.event.done.set()

    def wait(self) -> None:
        pass

    def device_ns(self) -> float:
        return 1e6


class _Queue:
    def launch(self, fn):
        return fn(), _Flight()


class RecordingStream(FakeStream):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def wait_stream(self, other) -> None:
        self.calls.append((self.name, "wait_stream"))

    def wait_event(self, event) -> None:
        self.calls.append((self.name, "wait_event", event))


@pytest.mark.parametrize("producer", ["cpu", "device"])
def test_a_batching_device_node_orders_its_inputs_through_the_default_stream(
    fake_cuda_executor, producer
):
    """A batching node launches on its own queue, after the default stream: after a CPU node it
    needs no stream call a request (it made two on a pool stream that no launch used), and a
    device producer's event becomes a wait of the default stream, not of an unused pool stream."""
    from boundgen.runtime import device_queue
    from boundgen.runtime.batching import BatchingNode

    ex, events = fake_cuda_executor
    calls: list = []
    default = RecordingStream("default", calls)
    ex._torch.cuda.default_stream = lambda device=None: default
    ex.streams = [RecordingStream("pool", calls)]
    batched = BatchingNode(
        "batched",
        lambda xs: [x * 10 for x in xs],
        inputs=["y"],
        outputs=["out"],
        merge=lambda items: ([it["y"] for it in items], None),
        split=lambda out, sizes: out,
    )
    first = on_device if producer == "device" else node(outputs="y")(lambda x: x * 10)
    device_queue.set_queue_factory(lambda executor, streams: _Queue())
    try:
        pipe = Pipeline("p", {"x": int}, [first, batched], ["out"])
        threading.Timer(0.05, lambda: [ev.done.set() for ev in list(events)]).start()
        assert ex.run(pipe, {"x": 2}, unwrap=True) == 200
    finally:
        device_queue.set_queue_factory(None)
    if producer == "cpu":
        assert calls == []
    else:  # the device node ran on the pool stream (its own prologue waited for host inputs)
        assert calls == [("pool", "wait_stream"), ("default", "wait_event", events[0])]


@pytest.mark.parametrize("fake_cuda_executor", [1, 2], indirect=True)
def test_the_device_wait_counts_in_the_deadline_estimate(fake_cuda_executor):
    """The device work a host node waits for (0.2 s here) is in the executor's estimate of the
    rest of the pipeline, on the waiting thread's path (one worker) and a worker's own wait (two),
    though not in any node's run: a request whose deadline is shorter fails before its device
    work is queued."""
    from boundgen.runtime import DeadlineExceeded

    ex, events = fake_cuda_executor
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    for k in range(2):
        threading.Timer(0.2, lambda: [ev.done.set() for ev in list(events)]).start()
        assert ex.submit(pipe, {"x": k}, unwrap=True).result(timeout=10) == 10 * k + 1
    stats = ex._stats_for(pipe)
    assert max(stats.ema_ns) < 50e6  # no node's run holds the wait
    assert ex.estimate_ms(pipe) >= 150
    queued = len(events)
    with pytest.raises(DeadlineExceeded, match="before node 'on_device'"):
        ex.run(pipe, {"x": 5}, timeout_ms=100)
    assert len(events) == queued  # dropped before its device node ran


def test_a_host_node_whose_device_inputs_have_run_waits_nothing(fake_cuda_executor):
    """A host node whose device inputs have run already: a wait of 0 in the estimate."""
    ex, _ = fake_cuda_executor
    done = FakeEvent()
    done.done.set()
    ex._torch.cuda.Event = lambda *a, **kw: done  # device work that has run when it is asked
    pipe = Pipeline("p", {"x": int}, [on_device, on_host], ["z"])
    stats = ex._stats_for(pipe)
    stats.wait_ns[1] = 200e6  # as if it had waited before
    assert ex.run(pipe, {"x": 1}, unwrap=True) == 11
    assert stats.wait_ns[1] == pytest.approx(0.9 * 200e6)  # one sample of 0 in the average


def test_a_wait_behind_a_batch_that_was_not_steady_is_not_learned(fake_cuda_executor):
    """Device work its node marked not steady (a batch that compiled: `batch_steady=False`) teaches
    neither its run nor the wait of the node that reads it — else one slow first batch would make
    every request with a shorter deadline fail fast, and none would run to show otherwise."""
    ex, events = fake_cuda_executor
    ran = []

    @node(outputs="y", kind="device")
    def compiles_once(x: int, ctx) -> int:
        if not ran:  # the first batch compiled
            ctx.annotate(batch_steady=False)
        ran.append(x)
        return x * 10

    pipe = Pipeline("p", {"x": int}, [compiles_once, on_host], ["z"])
    threading.Timer(0.3, lambda: [ev.done.set() for ev in list(events)]).start()
    assert ex.run(pipe, {"x": 1}, unwrap=True) == 11  # its device work "ran" 0.3 s
    assert ex.estimate_ms(pipe) < 100
    threading.Timer(0.01, lambda: [ev.done.set() for ev in list(events)]).start()
    assert ex.run(pipe, {"x": 2}, unwrap=True, timeout_ms=200) == 21
