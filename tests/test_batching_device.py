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
        out = fn()
        flight = FakeFlight(list(out), self.auto)
        self.flights.append(flight)
        return out, flight


@pytest.fixture
def device():
    fake = FakeDevice()
    device_queue.set_queue_factory(lambda executor: fake)
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
            clock=lambda: 0,  # the host's time is nothing: a launch returns at once
            **node_kw,
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
    device_queue.set_queue_factory(lambda executor: fake)
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


def test_host_outputs_nodes_are_not_paced_and_hand_no_event(device):
    """The beam node waits for its own device work inside `fn`: its batch already lasted that
    long, so it neither waits again nor hands the requests an event."""
    h = Harness(host_outputs=True)
    for rid in range(3):
        h.start(rid).join(10)
        h.wait_done(1)
    assert h.batches == [[0], [1], [2]] and set(h.events.values()) == {None}
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
