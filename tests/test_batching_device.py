"""A batching node whose function only queues device work (the forward node: a CUDA graph replay
returns at once) forms its next batch by the device's time, not the call's: requests that arrive
while the device runs a batch merge into one batch after it, and the cost model learns what a
batch costs the device. The device is a fake queue whose batches "run" until the test releases
them, so every schedule is exact and reads no wall clock."""

from __future__ import annotations

import threading

import pytest
from fake_request import FakeRequest

from boundgen.runtime import device_queue
from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.node import PipelineError

DEVICE_NS = 5_000_000  # what every fake batch costs the device: 5 ms


class FakeFlight:
    def __init__(self, batch: list[int], auto: bool) -> None:
        self.batch = batch
        self.event = ("ran", tuple(batch))
        self.ran = threading.Event()
        if auto:
            self.ran.set()

    def wait(self) -> None:
        assert self.ran.wait(10), f"batch {self.batch} never ran"

    def device_ns(self) -> float:
        return DEVICE_NS


class FakeDevice:
    """A device queue: `launch` runs the node's function (which "queues" the batch) and returns a
    flight that has run once the test sets it (or at once with `auto`)."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.flights: list[FakeFlight] = []

    def launch(self, fn):
        out = fn()  # the node's call: (what its function returned, merge's sizes)
        flight = FakeFlight(list(out[0]), self.auto)
        self.flights.append(flight)
        return out, flight


@pytest.fixture
def device():
    fake = FakeDevice()
    device_queue.set_queue_factory(lambda executor, streams: fake)
    yield fake
    device_queue.set_queue_factory(None)


class Harness:
    def __init__(self, **node_kw) -> None:
        self.batches: list[list[int]] = []
        self.events: dict[int, object] = {}
        self.finished = threading.Semaphore(0)
        self.node = BatchingNode(
            "forward",
            self._fn,
            inputs=["x"],
            outputs=["out"],
            merge=lambda items: ([it["x"] for it in items], None),
            split=lambda out, sizes: out,
            **{"clock": lambda: 0, **node_kw},  # default: a launch takes no host time
        )

    def _fn(self, batch: list[int]) -> list[int]:
        self.batches.append(list(batch))
        return list(batch)

    def _done(self, outs, exc, info=None, event=None) -> None:
        assert exc is None, exc
        self.events[outs[0]] = event
        self.finished.release()

    def start(self, rid: int) -> threading.Thread:
        """Request `rid` reaches the node on a thread of its own (an executor worker)."""
        t = threading.Thread(
            target=self.node.start, args=(FakeRequest(rid), {"x": rid}, self._done), daemon=True
        )
        t.start()
        return t

    def waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.node._lanes.values())

    def until(self, cond, what: str) -> None:
        for _ in range(10_000):
            if cond():
                return
            threading.Event().wait(0.001)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_done(self, n: int) -> None:
        for _ in range(n):
            assert self.finished.acquire(timeout=10)


def test_arrivals_while_the_device_runs_merge_into_the_batch_after(device):
    h = Harness(device_depth=2)
    h.start(0).join(10)  # alone: queued, and nothing else is on the device, so it returns
    h.wait_done(1)
    leader = h.start(1)  # queued behind batch 0; its leader waits until batch 0 has run
    h.until(lambda: len(device.flights) == 2, "batch 1 queued")
    for rid in (2, 3, 4):
        h.start(rid)
    h.until(lambda: h.waiting() == 3, "2, 3, 4 waiting")
    assert leader.is_alive()  # the lane is still busy: batch 0 has not run
    device.flights[0].ran.set()
    h.until(lambda: len(device.flights) == 3, "the next batch")
    device.flights[1].ran.set()
    h.wait_done(4)
    assert h.batches == [[0], [1], [2, 3, 4]]
    # each request's outputs are readable once its own batch has run: that batch's event
    assert h.events[3] == ("ran", (2, 3, 4)) and h.events[1] == ("ran", (1,))
    device.flights[2].ran.set()
    h.node.close()


def test_a_node_that_does_not_wait_runs_every_request_alone(device):
    """What the forward node did before: with the device never waited for, requests that arrive
    one after another while the device is still busy each get a batch (a forward) of their own."""
    h = Harness(device_depth=1000)
    for rid in range(5):
        h.start(rid).join(10)
        h.wait_done(1)
    assert h.batches == [[0], [1], [2], [3], [4]]
    assert not any(f.ran.is_set() for f in device.flights)  # none had run on the device
    h.node.close()


def test_the_wait_for_the_device_is_counted(device):
    """`paced_wait_seconds`: how long a leader was blocked on the device before it could form its
    next batch (what tells a device-bound node from a host-bound one at saturation)."""
    now = [0]
    h = Harness(device_depth=2)
    h.node._clock = lambda: now[0]
    h.start(0).join(10)  # nothing before it on the device: no wait
    h.wait_done(1)
    leader = h.start(1)  # batch 1 queued behind batch 0: its leader waits for batch 0
    h.until(lambda: len(device.flights) == 2, "batch 1 queued")
    assert h.node.stats()["paced_wait_seconds"] == 0
    now[0] = 3_000_000  # batch 0 runs 3 ms more on the device
    device.flights[0].ran.set()
    leader.join(10)
    h.wait_done(1)
    assert h.node.stats()["paced_wait_seconds"] == pytest.approx(0.003)
    device.flights[1].ran.set()
    h.node.close()


def test_the_host_time_of_launching_a_batch_is_counted(device):
    """`launch_seconds`: the host time from forming a batch to its device work being queued
    (merge + the call), what a device queued behind nothing idles for."""
    now = [0]
    h = Harness(device_depth=2)
    h.node._clock = lambda: now[0]
    fn = h.node.fn

    def slow_launch(batch):
        now[0] += 2_000_000  # 2 ms of host work before the device work is queued
        return fn(batch)

    h.node.fn = slow_launch
    h.start(0).join(10)
    h.wait_done(1)
    assert h.node.stats()["launch_seconds"] == pytest.approx(0.002)
    device.flights[0].ran.set()
    h.node.close()


def test_depth_one_waits_for_its_own_batch(device):
    h = Harness(device_depth=1)
    leader = h.start(0)
    h.until(lambda: len(device.flights) == 1, "batch 0 queued")
    h.start(1)
    h.until(lambda: h.waiting() == 1, "1 waiting")
    assert leader.is_alive()
    device.flights[0].ran.set()
    h.until(lambda: len(device.flights) == 2, "batch 1")
    device.flights[1].ran.set()
    h.wait_done(2)
    assert h.batches == [[0], [1]]
    h.node.close()


def test_the_cost_model_learns_the_device_time_not_the_launch():
    fake = FakeDevice(auto=True)
    device_queue.set_queue_factory(lambda executor, streams: fake)
    try:
        h = Harness(device_depth=2)
        h.node.cost.warm_units = 1
        for rid in range(8):
            h.start(rid).join(10)
            h.wait_done(1)
        # the launches took 0 ns on the host clock; each batch ran 5 ms on the device
        assert h.node.cost.warm
        assert h.node.cost.predict_ms(1) == pytest.approx(DEVICE_NS / 1e6, rel=1e-6)
        # 7 of the 8 batches have been waited for (the last is still "queued"): the GPU busy time
        assert h.node.stats()["device_seconds"] == pytest.approx(7 * DEVICE_NS / 1e9)
        h.node.close()
    finally:
        device_queue.set_queue_factory(None)


def finish_harness(fail_on: int | None = None, **node_kw) -> Harness:
    """A node whose function queues a batch and whose `finish` makes its host outputs (each id
    + 100) once the batch has run; `finish` raises for a batch holding `fail_on`."""
    h = Harness(finish=lambda out: finish(out), **node_kw)
    h.finishes, h.errors = [], {}

    def finish(out):
        h.finishes.append(list(out))
        if fail_on in out:
            raise RuntimeError(f"finish of {out} failed")
        return [x + 100 for x in out]

    def done(outs, exc, info=None, event=None):
        if exc is not None:
            h.errors[len(h.errors)] = exc
        else:
            h.events[outs[0]] = event
        h.finished.release()

    h._done = done
    return h


def test_finish_nodes_queue_the_next_batch_before_answering_the_last(device):
    """The beam node's shape: the leader queues batch n + 1 while batch n still runs, and the
    lane's finisher answers batch n (`finish` on its outputs, no event: they are on the host) once
    it has run; what arrives while two batches are queued merges into the one after."""
    h = finish_harness(device_depth=2)
    h.start(0).join(10)  # queued; one batch on the device: the leader returns at once
    assert h.batches == [[0]] and h.finishes == [] and not h.finished.acquire(timeout=0.05)
    leader = h.start(1)  # queued behind batch 0 before batch 0 has run or been answered
    h.until(lambda: len(device.flights) == 2, "batch 1 queued")
    assert h.finishes == []
    for rid in (2, 3):
        h.start(rid)
    h.until(lambda: h.waiting() == 2, "2, 3 waiting")
    assert leader.is_alive()  # two batches on the device: the leader waits for the first
    device.flights[0].ran.set()
    h.wait_done(1)
    assert h.events == {100: None} and h.finishes == [[0]]
    h.until(lambda: len(device.flights) == 3, "the batch after")
    device.flights[1].ran.set()
    device.flights[2].ran.set()
    h.wait_done(3)
    assert h.batches == [[0], [1], [2, 3]] and h.finishes == [[0], [1], [2, 3]]
    assert h.events == {100: None, 101: None, 102: None, 103: None}
    # every batch's device time was learned, as the paced forward node's
    assert h.node.stats()["device_seconds"] == pytest.approx(3 * DEVICE_NS / 1e9)
    h.node.close()


def test_a_failed_finish_fails_its_batch_only(device):
    device.auto = True
    h = finish_harness(fail_on=1)
    for rid in range(3):
        h.start(rid).join(10)
        h.wait_done(1)
    assert sorted(h.events) == [100, 102]
    assert [str(e) for e in h.errors.values()] == ["finish of [1] failed"]
    h.node.close()


def test_close_answers_the_batches_still_on_the_device(device):
    """Nothing is lost: closing waits for the queued batches and answers them."""
    h = finish_harness()
    h.start(0).join(10)
    closing = threading.Thread(target=h.node.close, daemon=True)
    closing.start()
    assert not h.finished.acquire(timeout=0.05)
    device.flights[0].ran.set()
    h.wait_done(1)
    closing.join(10)
    assert not closing.is_alive() and h.events == {100: None}


def warm_up(h: Harness, device, requests: int) -> None:
    """`requests` lone batches run at once (5 ms of device time each), so the node's cost model
    is warm; then the device runs batches only when the test says."""
    h.node.cost.warm_units = 1
    device.auto = True
    for rid in range(requests):
        h.start(rid).join(10)
        h.wait_done(1)
    assert h.node.cost.warm
    device.auto = False


def late_merging(device, now: list[int], first: int) -> tuple[Harness, threading.Thread]:
    """A `finish` node of batches of at most 3 with `late_merge`, its cost model warm (each batch
    5 ms of device time) and the device's batches run only when the test says; request `first`
    queued as the batch the device runs, and its leader's thread."""
    h = finish_harness(max_batch=3, clock=lambda: now[0])
    warm_up(h, device, 4)
    h.node.late_merge = True
    leader = h.start(first)
    h.until(lambda: len(device.flights) == 5, f"batch {first} queued")
    return h, leader


def drain(h: Harness, device, answers: int) -> None:
    """Every queued batch runs; `answers` requests are answered; the node closes."""
    for f in device.flights:
        f.ran.set()
    h.wait_done(answers)
    h.node.close()


def test_late_merge_forms_the_next_batch_shortly_before_the_running_one_ends(device):
    """The leader keeps its slot while batch 10 runs, until 80 % of its predicted 5 ms less 1 ms
    of launch margin (3 ms on the node's clock): what arrives meanwhile merges into one batch."""
    now = [0]
    h, leader = late_merging(device, now, 10)
    h.start(11)
    h.start(12)
    h.until(lambda: h.waiting() == 2, "11, 12 waiting")
    assert leader.is_alive() and len(device.flights) == 5  # held: nothing more is formed
    now[0] = 3_000_000  # due: its next wake-up (at most 3 ms of real time) lets go
    leader.join(10)
    assert not leader.is_alive()
    h.until(lambda: len(device.flights) == 6, "the batch after")
    assert h.batches[-1] == [11, 12]
    drain(h, device, 3)


def test_late_merge_stops_waiting_once_a_batch_is_full(device):
    now = [0]
    h, leader = late_merging(device, now, 20)
    for rid in (21, 22, 23):  # a whole batch of 3: no reason to wait on
        h.start(rid)
    leader.join(10)
    assert not leader.is_alive()
    h.until(lambda: len(device.flights) == 6, "the full batch")
    assert h.batches[-1] == [21, 22, 23] and now[0] == 0
    drain(h, device, 4)


def test_late_merge_stops_waiting_once_the_running_batch_has_run(device):
    """A prediction too long must not leave the device idle: the batch's end ends the wait."""
    now = [0]
    h, leader = late_merging(device, now, 30)
    h.start(31)
    h.until(lambda: h.waiting() == 1, "31 waiting")
    assert leader.is_alive()
    device.flights[4].ran.set()  # batch 30 ends before its predicted 3 ms on the node's clock
    h.wait_done(1)
    leader.join(10)
    assert not leader.is_alive() and now[0] == 0
    h.until(lambda: len(device.flights) == 6, "31's batch")
    device.flights[5].ran.set()
    h.wait_done(1)
    assert h.batches[-2:] == [[30], [31]]
    h.node.close()


@pytest.mark.parametrize("late", [False, True])
def test_a_node_without_finish_merges_late_by_the_prediction(device, late):
    """The forward node's late merge (no finisher): once batch 10 runs alone on the device, the
    leader keeps its slot until 80 % of its predicted 5 ms less 1 ms of margin (3 ms on the
    node's clock), so 11 and 12, arriving meanwhile, merge into the batch after it. Without it,
    11 forms a batch at once and 12 waits behind both."""
    now = [0]
    h = Harness(device_depth=2, clock=lambda: now[0])
    warm_up(h, device, 8)  # (a node without finish learns a batch once the next one is queued)
    h.node.late_merge = late
    leader = h.start(10)
    h.until(lambda: len(device.flights) == 9, "batch 10 queued")
    h.wait_done(1)  # answered at once (with the batch's event)
    if late:
        assert leader.is_alive()  # held: the running batch is predicted to end at 5 ms
    else:
        leader.join(10)
        assert not leader.is_alive()
    h.start(11)
    if not late:
        h.until(lambda: len(device.flights) == 10, "11 alone, at once")
    h.start(12)
    h.until(lambda: h.waiting() == (2 if late else 1), "the later requests waiting")
    now[0] = 3_000_000  # due: the held leader's next wake-up (at most 3 ms of real time) lets go
    leader.join(10)
    assert not leader.is_alive()
    device.flights[8].ran.set()  # batch 10 has run: the next leader's pace moves on
    h.until(lambda: len(device.flights) == (10 if late else 11), "the batch after")
    for f in device.flights:
        f.ran.set()
    h.wait_done(2)
    assert h.batches[8:] == ([[10], [11, 12]] if late else [[10], [11], [12]])
    h.node.close()


def test_finish_runs_in_the_call_without_a_device_queue():
    """On CPU the batch has run when the function returns: `finish` follows it on the leader's
    thread, and no finisher thread is made."""
    h = finish_harness()
    h.start(0).join(10)
    h.wait_done(1)
    assert h.events == {100: None} and h.finishes == [[0]]
    assert all(lane.finisher is None for lane in h.node._lanes.values())
    h.node.close()


def test_no_queue_on_cpu():
    """Without CUDA (and no simulated device) a batch's call is its run: nothing is paced."""
    h = Harness()
    h.start(0).join(10)
    h.wait_done(1)
    assert h.node._queue is None and h.events[0] is None
    h.node.close()


def test_depth_must_be_positive():
    with pytest.raises(PipelineError, match="device_depth"):
        Harness(device_depth=0)
