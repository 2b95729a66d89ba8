"""Deadlines that cancel (issue 19): a cancelled request ends at once and runs no further node; a
node that works in pieces drops a dead request's rest (`ctx.alive()`, the batching node's `alive`
list, `Forward` and `ModelRunner.rows`); the batching node's cost model."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from boundgen.runtime import BatchingNode, DeadlineExceeded, Executor, Pipeline, node
from boundgen.runtime.batching import CostModel
from boundgen.text.packing import SequenceGroup
from boundgen.workloads.forward import Forward

# ---- the executor


def test_cancel_ends_the_request_and_runs_no_later_node():
    started, release, later = threading.Event(), threading.Event(), []

    @node(outputs="y")
    def slow(x: int) -> int:
        started.set()
        release.wait(5)
        return x + 1

    @node(outputs="z")
    def after(y: int) -> int:
        later.append(y)
        return y

    pipe = Pipeline("p", {"x": int}, [slow, after], ["z"])
    with Executor(cpu_workers=2) as ex:
        fut = ex.submit(pipe, {"x": 1})
        assert started.wait(5)
        assert fut.cancel() and fut.cancelled()
        assert not fut.cancel()  # ended already
        release.set()
        deadline = time.monotonic() + 5
        while ex.stats()["inflight"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.stats()["inflight"] == 0  # settled by a worker, not by the caller
        assert later == []
        assert ex.run(pipe, {"x": 2}) == {"z": 3}  # the executor serves on


def test_alive_fails_a_request_past_its_deadline_between_pieces():
    pieces = []

    @node(outputs="n")
    def in_pieces(ctx, x: int) -> int:
        for k in range(100):
            if not ctx.alive():
                return k
            pieces.append(k)
            time.sleep(0.01)
        return 100

    pipe = Pipeline("p", {"x": int}, [in_pieces], ["n"])
    stopped = pytest.raises(DeadlineExceeded, match="passed while node 'in_pieces' ran")
    with Executor(cpu_workers=1, fail_fast=False) as ex, stopped as err:
        ex.run(pipe, {"x": 0}, timeout_ms=100)
    assert err.value.started
    assert 3 <= len(pieces) < 30  # stopped within one piece of its deadline, not after all 100


# ---- the batching node


def _alive_pipeline(seen: list, max_wait_ms: float) -> tuple[Pipeline, BatchingNode]:
    """A batching node whose function takes `alive`, and records it per merged batch."""

    def fn(xs: list[int], alive):
        time.sleep(0.05)
        seen.append([f() for f in alive])
        return xs

    return _merging_pipeline(fn, max_wait_ms=max_wait_ms)


def _merging_pipeline(fn, **kwargs) -> tuple[Pipeline, BatchingNode]:
    """One batching node `x → y` that runs `fn` over the merged list of xs."""
    batch = BatchingNode(
        "b",
        fn,
        ["x"],
        ["y"],
        merge=lambda items: ([it["x"] for it in items], len(items)),
        split=lambda out, n: out,
        **kwargs,
    )
    return Pipeline("p", ["x"], [batch], ["y"]), batch


def test_batching_node_passes_each_request_its_alive_in_merge_order():
    seen: list = []
    pipe, batch = _alive_pipeline(seen, max_wait_ms=20)
    with Executor(cpu_workers=4) as ex:
        futs = [ex.submit(pipe, {"x": i}) for i in range(3)]
        assert [f.result(5) for f in futs] == [{"y": i} for i in range(3)]
        assert seen and all(all(flags) for flags in seen)
        assert sum(len(flags) for flags in seen) == 3
    batch.close()


def test_a_cancelled_request_reads_dead_and_a_waiting_one_is_never_run():
    seen: list = []
    pipe, batch = _alive_pipeline(seen, max_wait_ms=0)
    with Executor(cpu_workers=4) as ex:
        first = ex.submit(pipe, {"x": 0})  # leads a batch of its own
        time.sleep(0.01)
        waiting = ex.submit(pipe, {"x": 1})  # waits for the next batch
        assert waiting.cancel()
        assert first.result(5) == {"y": 0}
        time.sleep(0.2)
    assert seen == [[True]]  # the cancelled request never reached the model
    batch.close()


def test_a_slow_first_batch_refuses_no_later_request():
    """A node's first batch may compile (seconds on a GPU): neither the executor's deadline
    estimate nor the batching node may learn it, or every later request with a shorter deadline
    would be dropped as too slow, and never run to show otherwise."""
    runs = []

    def fn(xs: list[int]) -> list[int]:
        time.sleep(1.0 if not runs else 0.001)  # the first run "compiles"
        runs.append(len(xs))
        return xs

    pipe, batch = _merging_pipeline(fn)
    with Executor(cpu_workers=2) as ex:
        assert ex.run(pipe, {"x": 0}) == {"y": 0}
        for i in range(1, 4):
            assert ex.run(pipe, {"x": i}, timeout_ms=250) == {"y": i}
        assert ex.estimate_ms(pipe) < 250
    assert batch.cost.skipped["first_of_shape"] == 1 and len(runs) == 4
    batch.close()


def test_cost_model_fits_fixed_and_per_unit_cost():
    cost = CostModel(warm_batches=2, warm_units=100)
    assert cost.predict_ms(100) is None  # cold
    for units in (10, 50, 200, 400, 30, 300):
        cost.observe(units, int((2.0 + 0.01 * units) * 1e6))  # 2 ms + 10 µs per unit
    assert cost.predict_ms(1000) == pytest.approx(12.0, rel=1e-6)
    same = CostModel(warm_batches=2, warm_units=10)
    for _ in range(3):
        same.observe(100, 5_000_000)
    assert same.predict_ms(200) == pytest.approx(10.0)  # sizes alike: time per unit


# ---- the forward node and the runner


def test_forward_skips_pieces_whose_requests_are_all_dead(engine_for):
    runner = engine_for().runner
    long = [[5 + (i + j) % 50 for j in range(400)] for i in range(12)]  # 4800 tokens: 3+ pieces
    short = [[7, 8, 9]]
    (batch, sizes) = Forward.merge(
        [
            {"groups": [SequenceGroup([1, 2], long)], "pooling": "last"},
            {"groups": [SequenceGroup([3], short)], "pooling": "last"},
        ]
    )
    fwd = Forward(runner)
    full = fwd(batch)
    rows = fwd(batch, alive=[lambda: False, lambda: True])
    assert rows.shape == full.shape and sizes == [12, 1]
    torch.testing.assert_close(rows[12:], full[12:])  # the live request's row, as computed alone
    assert rows[:2].abs().sum() == 0  # the dead request's first piece was skipped
    asked = []
    runner.rows([SequenceGroup([1, 2], long)], "last", lambda a, b: asked.append((a, b)) or True)
    assert asked[0][0] == 0 and asked[-1][1] == 12 and len(asked) >= 3  # per piece, in row order


def test_beam_node_skips_a_search_nobody_waits_for(engine_for):
    """Merged beam requests: a (width, steps, trie) group whose requests all stopped waiting runs
    no search (its rows come back empty); the other group's search runs as usual."""
    from boundgen.workloads.beam import BeamRequest, _Beam

    engine = engine_for()
    calls = []
    real = engine.runner.beam_search

    class Runner:
        def beam_search(self, prompts, width, steps, trie=None, banned=()):
            calls.append((len(prompts), width))
            return real(prompts, width, steps, trie, banned)

    context = engine.workload_context()
    context.runner = Runner()
    node = _Beam(context)
    items = [
        {"request": BeamRequest([[11, 12]], 2, 2), "prompts": [[11, 12]]},
        {"request": BeamRequest([[13]], 3, 2), "prompts": [[13]]},
        {"request": BeamRequest([[14, 15]], 2, 2), "prompts": [[14, 15]]},
    ]
    batch, sizes = node.merge(items)
    launched = node(batch, alive=[lambda: False, lambda: True, lambda: False])
    out = node.split(node.finish(launched), sizes)
    assert calls == [(1, 3)]  # the width-2 search had no live request
    assert out[0] == [[]] and out[2] == [[]]  # no rows for the requests nobody waited for
    (rows,) = out[1]
    assert len(rows) == 3 and all(len(t) == 2 and math.isfinite(s) for t, s in rows)


def test_forward_split_gives_each_request_a_view_of_its_rows():
    """The merged forward's rows back per request, in order, as views (slices keep the GIL,
    where `torch.split` gives it up), a request of no rows included."""
    rows = torch.arange(14.0).view(7, 2)
    parts = Forward.split(rows, [3, 0, 4])
    assert [p.shape[0] for p in parts] == [3, 0, 4]
    for got, want in zip(parts, torch.split(rows, [3, 0, 4])):
        assert torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr() or got.numel() == 0


def test_forward_split_gives_a_lone_request_every_row_as_is():
    """A batch of one request that owns every row gets the rows themselves (no slice); one that
    owns fewer rows than there are gets its slice."""
    rows = torch.arange(14.0).view(7, 2)
    (whole,) = Forward.split(rows, [7])
    assert whole is rows
    (part,) = Forward.split(rows, [5])
    assert torch.equal(part, rows[:5])
