"""Issue 24: beam searches merged across requests, answered as each merged search ends.

The runtime's beam pipeline over a fake runner whose searches the test holds and releases one by
one (CPU, deterministic, nothing timed): merged requests each get exactly their own rows; a
request is answered when its own search ends, not when a later one does; searches of another
width run side by side; each merged search comes to the host exactly once."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np
import pytest
import torch

from boundgen import Trie
from boundgen.runtime import BatchingNode
from boundgen.workloads import beam as beam_mod
from boundgen.workloads.beam import BeamRequest, ItemIndex, _Beam
from boundgen.workloads.service import EngineRuntime

WAIT_S = 10.0  # a bound on every wait: a broken test fails, it does not hang


class Held:
    """A fake runner: each `beam_search` call is recorded and, when the test holds it (by call
    number), waits until released. Row j of prompt p is `[p[0], j, 0, ...]` with score -j - p[0]
    / 1000, so every row says whose it is."""

    def __init__(self, real, hold: set[int] = frozenset(), largest: dict | None = None):
        self._real = real
        self.calls: list[tuple[int, list[int]]] = []
        self.started: list[threading.Event] = [threading.Event() for _ in range(16)]
        self.release: list[threading.Event] = [threading.Event() for _ in range(16)]
        for i in range(16):
            if i not in hold:
                self.release[i].set()
        self.wrap = lambda t: t
        # `largest`: (width, steps) → prompts of the largest whole-search graph "made"
        self.largest = largest
        self._lock = threading.Lock()

    def largest_search(self, width, steps, trie=None, banned=()):
        return None if self.largest is None else self.largest.get((width, steps))

    def beam_search(self, prompts, width, steps, trie=None, banned=()):
        with self._lock:
            n = len(self.calls)
            self.calls.append((width, [p[0] for p in prompts]))
        self.started[n].set()
        assert self.release[n].wait(WAIT_S), f"search {n} never released"
        b = len(prompts)
        tokens = torch.zeros(b, width, steps, dtype=torch.long)
        tokens[:, :, 0] = torch.tensor([p[0] for p in prompts]).unsqueeze(1)
        tokens[:, :, 1 % steps] += torch.arange(width) if steps > 1 else 0
        first = torch.tensor([float(p[0]) for p in prompts]).unsqueeze(1)
        scores = -torch.arange(width, dtype=torch.float32).unsqueeze(0) - first / 1000
        return self.wrap(tokens), self.wrap(scores)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def make_runtime(engine_for):
    made = []

    def make(runner: Held) -> EngineRuntime:
        context = engine_for().workload_context()
        context.runner = runner
        rt = EngineRuntime(context, cpu_workers=4)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


def beam_node(rt: EngineRuntime) -> BatchingNode:
    return next(p.node for p in rt.pipelines["beam"].plan if isinstance(p.node, BatchingNode))


def submit(rt: EngineRuntime, first: int, width: int = 4, steps: int = 2):
    return rt.submit("beam", BeamRequest([[first, 3, 4]], width, steps), timeout_ms=60_000)


def wait_queued(node: BatchingNode, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while sum(len(lane.waiting) for lane in node._lanes.values()) < n:
        assert time.monotonic() < deadline, "requests never reached the beam node"
        time.sleep(0.001)


def check_own_rows(result, first: int, width: int) -> None:
    (rows,) = result  # one prompt
    assert len(rows) == width
    for j, (tokens, score) in enumerate(rows):
        assert tokens[0] == first  # its own prompt's search rows, not a neighbour's
        assert score == pytest.approx(-j - first / 1000)


def test_merged_requests_each_get_exactly_their_own_rows(make_runtime, engine_for):
    runner = Held(engine_for().runner, hold={0})
    rt = make_runtime(runner)
    a = submit(rt, 5)
    assert runner.started[0].wait(WAIT_S)  # A's search runs (and is held)
    rest = [submit(rt, first) for first in (6, 7, 8)]
    wait_queued(beam_node(rt), 3)  # they arrived while A's search ran
    runner.release[0].set()
    check_own_rows(a.result(WAIT_S), 5, 4)
    for fut, first in zip(rest, (6, 7, 8)):
        check_own_rows(fut.result(WAIT_S), first, 4)
    assert runner.calls == [(4, [5]), (4, [6, 7, 8])]  # the three merged into the next search


def test_a_request_is_answered_when_its_search_ends_not_a_later_one(make_runtime, engine_for):
    """The lane takes at most the largest graph's prompts (2 here) per search: the third request
    waits for a search of its own, and the first two are answered before it ends."""
    runner = Held(engine_for().runner, hold={0, 2}, largest={(4, 2): 2})
    rt = make_runtime(runner)
    a = submit(rt, 5)
    assert runner.started[0].wait(WAIT_S)
    b, c, d = (submit(rt, first) for first in (6, 7, 8))
    wait_queued(beam_node(rt), 3)
    runner.release[0].set()
    assert runner.started[2].wait(WAIT_S)  # D's search started (held): B's and C's ended
    check_own_rows(b.result(WAIT_S), 6, 4)
    check_own_rows(c.result(WAIT_S), 7, 4)
    assert a.done() and not d.done()
    runner.release[2].set()
    check_own_rows(d.result(WAIT_S), 8, 4)
    assert runner.calls == [(4, [5]), (4, [6, 7]), (4, [8])]


def test_searches_of_another_width_run_side_by_side(make_runtime, engine_for):
    """A width-2 request is neither merged with nor queued behind a width-4 search that runs."""
    runner = Held(engine_for().runner, hold={0})
    rt = make_runtime(runner)
    a = submit(rt, 5, width=4)
    assert runner.started[0].wait(WAIT_S)
    e = submit(rt, 9, width=2)
    check_own_rows(e.result(WAIT_S), 9, 2)  # answered while the width-4 search is still held
    assert not a.done()
    runner.release[0].set()
    check_own_rows(a.result(WAIT_S), 5, 4)
    assert runner.calls == [(4, [5]), (2, [9])]
    assert beam_node(rt).stats()["lanes"] == 2


class Device(torch.Tensor):
    """A stand-in for a device tensor: every torch function applied to it (not a read of its
    metadata: shape, device) is counted, except inside `to_host` (the one transfer a search's
    results are allowed)."""

    reads: ClassVar[list[str]] = []
    in_transfer = threading.local()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        if not getattr(cls.in_transfer, "on", False) and name != "__get__":
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_each_merged_search_comes_to_the_host_exactly_once(make_runtime, engine_for, monkeypatch):
    runner = Held(engine_for().runner, hold={0})
    runner.wrap = lambda t: t.as_subclass(Device)
    transfers = []
    real = beam_mod.to_host

    def counted(tokens, scores):
        assert isinstance(tokens, Device) and isinstance(scores, Device)
        Device.in_transfer.on = True
        try:
            transfers.append(tokens.shape[0])
            tokens, scores, copied = real(tokens, scores)
            # what landed on the host is no device tensor any more
            return tokens.as_subclass(torch.Tensor), scores.as_subclass(torch.Tensor), copied
        finally:
            Device.in_transfer.on = False

    monkeypatch.setattr(_Beam, "to_host", staticmethod(counted))
    Device.reads = []
    rt = make_runtime(runner)
    a = submit(rt, 5)
    assert runner.started[0].wait(WAIT_S)
    merged = [submit(rt, first) for first in (6, 7, 8)]
    wait_queued(beam_node(rt), 3)
    submit(rt, 9, width=2).result(WAIT_S)  # its own lane: runs while A's search is held
    runner.release[0].set()
    for fut in [a, *merged]:
        fut.result(WAIT_S)
    assert sorted(transfers) == [1, 1, 3]  # one per search: A's, the width-2 one, the merged 3
    assert Device.reads == []  # nothing else read the results (no per-request or per-beam sync)


def test_the_item_index_gives_the_tries_ids_and_none_for_no_item():
    seqs = [[1, 2, 3], [1, 2, 4], [7, 0, 9], [300000, 5, 1]]
    trie = Trie.from_sequences(seqs, item_ids=["a", "b", "c", "d"])
    index = ItemIndex(trie)
    rows = np.array([[7, 0, 9], [1, 2, 5], [300000, 5, 1], [1, 2, 3], [0, 0, 0], [1, 2, 4]])
    assert index.lookup(rows) == ["c", None, "d", "a", None, "b"]
    assert index.lookup(np.zeros((0, 3), dtype=np.int64)) == []
    plain = ItemIndex(Trie.from_sequences(seqs))
    assert plain.lookup(np.array(seqs)) == trie_ids(Trie.from_sequences(seqs), seqs)


def trie_ids(trie: Trie, seqs) -> list:
    return [trie.item_ids(s) for s in seqs]


def test_lanes_past_max_lanes_share_one():
    seen = []

    def fn(batch):
        seen.append(sorted(batch))
        return batch

    node = BatchingNode(
        "n",
        fn,
        inputs=["x"],
        outputs="y",
        merge=lambda items: ([it["x"] for it in items], None),
        split=lambda out, sizes: out,
        lane=lambda inputs: inputs["x"],
        max_lanes=2,
        kind="cpu",
    )
    with node._cv:
        lanes = [node._lane_of(k) for k in (1, 2, 3, 4, 1)]
    assert lanes[0] is lanes[4] and lanes[0] is not lanes[1]
    assert lanes[2] is lanes[3] and lanes[2].key == ("<overflow>",)


class _CopiedEvent:
    def __init__(self, done: bool) -> None:
        self.done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def test_a_searchs_landed_copies_are_read_without_a_wait():
    """`on_host` waits on the copies' event only while they are in flight: a `synchronize` gives
    the GIL up (beside the busy event loop, up to the switch interval to take it back), and the
    lane's finisher has mostly waited for the search already."""
    from boundgen.workloads.beam import on_host

    tokens, scores = torch.arange(6).view(1, 2, 3), torch.tensor([[0.5, -1.0]])
    for done, waits in ((True, 0), (False, 1)):
        event = _CopiedEvent(done)
        got_tokens, got_scores = on_host((tokens, scores, event))
        assert event.synchronized == waits
        assert got_tokens.tolist() == tokens.tolist() and got_scores.tolist() == [[0.5, -1.0]]
