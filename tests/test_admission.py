"""Admission (`server/infer.py`, issue 23) with injected timings: a queue is predicted as the merged
forwards it will become, so the queue that cross-request batching feeds on is admitted; by
default a request is refused only when it cannot meet its own deadline (429 when the queue makes
it late, 504 when its own run does); `max_queue_ms` is an explicit, tighter budget; nothing is
refused while the cost model is cold.

The model node is a real `BatchingNode` whose cost model learned the CPU demo server's shape
(13 ms a forward + 18 µs a token: one 272-token request ~18 ms, 16 merged ~91 ms); no batch runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed")

from boundgen.runtime.batching import BatchingNode
from boundgen.server.errors import Overloaded, Timeout
from boundgen.server.infer import Infer
from boundgen.server.metrics import Metrics

FIXED_NS = 13_000_000
PER_TOKEN_NS = 18_000
REQUEST = 272  # tokens: the demo benchmark's score request (16-token query, 16 items × 16)


def node(warm: bool = True, **kw) -> BatchingNode:
    n = BatchingNode(
        "forward",
        lambda batch: batch,
        inputs=["x"],
        outputs=["y"],
        merge=lambda items: (items, None),
        split=lambda out, sizes: out,
        clock=lambda: 0,
        **kw,
    )
    if warm:
        for tokens in (272, 272, 1088, 4352, 544, 2176):  # the first run teaches nothing
            n.cost.observe(tokens, FIXED_NS + PER_TOKEN_NS * tokens)
    return n


class FakeRuntime:
    """What `Infer` uses of `EngineRuntime`: one pipeline whose model node is `node`; submitted
    work stays pending until the test finishes it."""

    def __init__(self, model: BatchingNode) -> None:
        plan = [SimpleNamespace(node=model)]
        self.pipelines = {"score": SimpleNamespace(plan=plan)}
        self.work: list[concurrent.futures.Future] = []

    def submit(self, kind, request, timeout_ms):
        work = concurrent.futures.Future()
        work.timings, work.total_ms = [], None
        work.cancel = lambda: False
        self.work.append(work)
        return work


def infer_for(model: BatchingNode, **kw) -> tuple[Infer, Metrics]:
    metrics = Metrics()
    return Infer(FakeRuntime(model), metrics=metrics, **kw), metrics


def shed(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("boundgen_shed_total", {"reason": reason}) or 0.0


async def admit(infer: Infer, n: int, tokens: int = REQUEST, timeout_ms: int = 10_000) -> list:
    """`n` requests admitted and waiting for the model (their tasks, not finished)."""
    tasks = [asyncio.create_task(infer("score", {}, timeout_ms, tokens)) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


async def finish(infer: Infer, tasks: list) -> None:
    for work in infer.runtime.work:
        if not work.done():
            work.set_result("ok")
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_queue_is_predicted_as_the_forwards_it_becomes():
    model = node()
    infer, _ = infer_for(model)

    async def run():
        tasks = await admit(infer, 15)
        predicted = infer.predicted_ms(model, REQUEST, 1)
        await finish(infer, tasks)
        return predicted

    # 16 requests merged into one forward, not 16 single-request times (~18 ms each)
    merged = (FIXED_NS + PER_TOKEN_NS * 16 * REQUEST) / 1e6
    assert asyncio.run(run()) == pytest.approx(merged, rel=0.01)
    assert merged < 0.35 * 16 * (FIXED_NS + PER_TOKEN_NS * REQUEST) / 1e6
    # beyond the token budget the queue is several forwards, each with its fixed cost
    budget = node(token_budget=1000)
    assert budget.queue_ms(2500) == pytest.approx((3 * FIXED_NS + PER_TOKEN_NS * 2500) / 1e6)
    capped = node(max_batch=4)
    assert capped.queue_ms(16 * REQUEST, 16) == pytest.approx(
        (4 * FIXED_NS + PER_TOKEN_NS * 16 * REQUEST) / 1e6
    )


def test_sixteen_clients_are_admitted_by_default():
    infer, metrics = infer_for(node())

    async def run():
        tasks = await admit(infer, 64)  # 64 waiting: ~0.4 s of merged forwards, deadline 10 s
        admitted = infer.admitted
        await finish(infer, tasks)
        return admitted, [t.result() for t in tasks]

    admitted, results = asyncio.run(run())
    assert admitted == 64 and results == ["ok"] * 64
    assert infer.queue_budget_ms() is None
    assert sum(shed(metrics, r) for r in ("predicted_wait", "deadline", "not_run")) == 0
    assert infer.admitted == 0 and infer.predicted_wait_ms() == 0.0


def test_a_request_the_queue_makes_late_gets_429_with_retry_after():
    model = node()
    infer, metrics = infer_for(model)

    async def run():
        tasks = await admit(infer, 100, tokens=4000)  # 49 forwards: ~7.8 s of model work
        with pytest.raises(Overloaded, match="timeout_ms=1000 cannot be met") as err:
            await infer("score", {}, 1000, REQUEST)
        ok = await admit(infer, 1, timeout_ms=10_000)  # a request that can wait is admitted
        await finish(infer, tasks + ok)
        return err.value

    err = asyncio.run(run())
    wait_s = (49 * FIXED_NS + PER_TOKEN_NS * 100 * 4000) / 1e9
    assert err.headers["Retry-After"] == str(int(wait_s))  # until the queue leaves it 1 s
    assert shed(metrics, "deadline") == 1 and shed(metrics, "not_run") == 0


def test_a_request_whose_own_run_is_over_its_deadline_is_not_run():
    infer, metrics = infer_for(node())

    async def run():
        with pytest.raises(Timeout, match="request not run: timeout_ms=50 is shorter"):
            await infer("score", {}, 50, 4000)  # 13 + 72 ms alone

    asyncio.run(run())
    assert shed(metrics, "not_run") == 1 and infer.admitted == 0


def test_max_queue_ms_is_an_explicit_tighter_budget():
    infer, metrics = infer_for(node(), max_queue_ms=50)

    async def run():
        tasks = await admit(infer, 2, tokens=1000)  # 13 + 36 ms: under the budget
        infer.check_load()
        tasks += await admit(infer, 1, tokens=1000)  # admitted: it was the one over
        with pytest.raises(Overloaded, match="max_queue_ms=50") as err:
            infer.check_load()
        await finish(infer, tasks)
        return err.value

    err = asyncio.run(run())
    assert 1 <= int(err.headers["Retry-After"]) <= 30
    assert shed(metrics, "predicted_wait") == 1


def test_a_cold_cost_model_refuses_nothing_but_max_queue():
    infer, metrics = infer_for(node(warm=False), max_queue=8, max_queue_ms=1)

    async def run():
        tasks = await admit(infer, 8, tokens=100_000, timeout_ms=1)
        with pytest.raises(Overloaded, match="at capacity"):
            infer.check_load()
        await finish(infer, tasks)
        return [t.result() for t in tasks]

    assert asyncio.run(run()) == ["ok"] * 8
    assert shed(metrics, "capacity") == 1


# ---- a request's outcome (`Infer.start`, what `__call__` awaits and the frontend link runs) -----


def outcome(work_end, timeout_ms: int = 1000) -> tuple:
    """Start one request on a cold model (nothing refused), end its work with `work_end(work)`
    (None: never), and wait for `on_done`: → (result, error, times, the request's work, infer)."""
    infer, _ = infer_for(node(warm=False))

    async def main():
        answered = asyncio.get_running_loop().create_future()
        work = infer.start("score", {}, timeout_ms, 10, lambda *args: answered.set_result(args))
        assert infer.admitted == 1
        if work_end is not None:
            work_end(work)
        result, error, times = await asyncio.wait_for(answered, 5)
        return result, error, times, work

    return (*asyncio.run(main()), infer)


def test_the_runtimes_outcomes_become_the_servers_answers():
    from boundgen.runtime.executor import DeadlineExceeded
    from boundgen.server.errors import BadRequest

    result, error, times, _, infer = outcome(lambda w: w.set_result([[0.5, 0.5]]))
    assert (result, error, times) == ([[0.5, 0.5]], None, [])
    assert infer.admitted == 0
    # dropped by the runtime before a node: its own 504 message (a DeadlineExceeded is a
    # TimeoutError: it must not read as the server's own wait running out)
    dropped = DeadlineExceeded("deadline of 1000 ms cannot be met before node 'forward'")
    _, error, times, _, _ = outcome(lambda w: w.set_exception(dropped))
    assert isinstance(error, Timeout) and times is None
    assert error.message.startswith("request dropped: timeout_ms=1000 cannot be met (deadline")
    stopped = DeadlineExceeded("deadline passed while node 'forward' ran", started=True)
    _, error, _, _, _ = outcome(lambda w: w.set_exception(stopped))
    assert error.message.startswith("request did not finish within timeout_ms=1000: deadline")
    _, error, _, _, _ = outcome(lambda w: w.set_exception(ValueError("bad token id 7")))
    assert isinstance(error, BadRequest) and error.message == "bad token id 7"
    boom = RuntimeError("boom")
    _, error, _, _, _ = outcome(lambda w: w.set_exception(boom))
    assert error is boom  # the endpoint answers it 500 and logs it


def test_a_request_past_its_deadline_is_answered_and_its_slot_freed_when_the_work_ends():
    cancelled = []
    infer, _ = infer_for(node(warm=False))

    async def main():
        answered = asyncio.get_running_loop().create_future()
        work = infer.start("score", {}, 20, 10, lambda *args: answered.set_result(args))
        work.cancel = lambda: cancelled.append(True) or False  # the work goes on a while
        _, error, _ = await asyncio.wait_for(answered, 5)
        assert isinstance(error, Timeout)
        assert error.message == "request did not finish within timeout_ms=20"
        assert cancelled == [True] and infer.admitted == 1  # not free before the work ends
        work.set_result("late")
        await asyncio.sleep(0.01)
        assert infer.admitted == 0

    asyncio.run(main())


def test_a_caller_that_cancels_gets_cancelled_and_frees_the_slot():
    infer, _ = infer_for(node(warm=False))

    async def main():
        answered = asyncio.get_running_loop().create_future()
        work = infer.start("score", {}, 1000, 10, lambda *args: answered.set_result(args))
        del work.cancel  # the Future's own: cancelled at once, as the runtime's request is
        assert work.cancel()
        _, error, _ = await asyncio.wait_for(answered, 5)
        assert isinstance(error, asyncio.CancelledError) and infer.admitted == 0

    asyncio.run(main())


def test_a_finished_request_is_freed_without_the_cyclic_collector():
    """Nothing `Infer.start` leaves behind keeps a finished request alive in a reference cycle:
    its inputs and results go when it ends, not at the next full collection (those collections
    paused the server > 10 ms under `/v1/beam` load while they did)."""
    import gc
    import weakref

    infer, _ = infer_for(node(warm=False))

    async def main() -> weakref.ref:
        answered = asyncio.get_running_loop().create_future()
        work = infer.start("score", {}, 1000, 10, lambda *args: answered.set_result(args))
        gone = weakref.ref(work)
        infer.runtime.work.clear()
        work.set_result([[0.5, 0.5]])
        del work
        await asyncio.wait_for(answered, 5)
        await asyncio.sleep(0)
        return gone

    gc.disable()
    try:
        assert asyncio.run(main())() is None
    finally:
        gc.enable()
