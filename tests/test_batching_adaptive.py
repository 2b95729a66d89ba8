"""`BatchingNode` scheduling, driven directly with an injected clock: a request that arrives while a
batch runs is in the very next batch, with no wait; with a latency target the token budget follows
the cost model (half the target per batch, the oldest request's deadline, the whole budget when the
queue cannot drain within the target anyway), shrinks when batches get slower and grows back when
they get faster. The fake model and its clock: `batching_sim.py`.
"""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from batching_sim import FIXED_NS, PER_TOKEN_NS, Sim, p99, poisson
from fake_request import FakeRequest

from boundgen.runtime.batching import CostModel, mark_not_steady
from boundgen.runtime.node import PipelineError

# ---- arrivals while a batch runs ----------------------------------------------------------------


def test_a_request_arriving_while_a_batch_runs_is_in_the_very_next_batch():
    # request 0 alone; 1 and 2 arrive while it runs (2 ms in), 3 after everything
    sim = Sim([(0, 100), (500_000, 100), (1_500_000, 100), (50_000_000, 100)]).run()
    assert sim.batches == [[0], [1, 2], [3]]
    batch_1_end = sim.runs_ns[0]
    # the next batch started the moment the first one ended: no wait beyond the running batch
    assert sim.finished[1] == sim.finished[2] == batch_1_end + sim.runs_ns[1]


def test_arrivals_beyond_the_budget_start_the_batch_after():
    arrivals = [(0, 100)] + [(10_000 * i, 100) for i in range(1, 6)]  # 5 arrive during batch 0
    sim = Sim(arrivals, token_budget=300).run()
    assert sim.batches == [[0], [1, 2, 3], [4, 5]]


# ---- the cost model ------------------------------------------------------------------------------


def test_cost_model_units_within_inverts_predict():
    cost = CostModel(warm_batches=2, warm_units=0)
    assert cost.units_within(10.0) is None  # cold
    for units in (100, 400, 200, 800):
        cost.observe(units, FIXED_NS + PER_TOKEN_NS * units)
    assert cost.predict_ms(900) == pytest.approx(10.0)
    assert cost.units_within(10.0) == pytest.approx(900.0)
    assert cost.units_within(0.5) == 0.0  # less than the fixed part


def warmed(cost: CostModel, sizes=(100, 400, 200, 800, 300, 600)) -> CostModel:
    for units in sizes:
        cost.observe(units, FIXED_NS + PER_TOKEN_NS * units)
    return cost


def test_the_first_run_and_the_first_of_each_shape_teach_nothing():
    cost = CostModel(warm_batches=1, warm_units=0)
    assert not cost.observe(100, 5_000_000_000)  # the node's first run: it may have compiled
    assert cost.predict_ms(100) is None
    assert cost.observe(100, FIXED_NS + PER_TOKEN_NS * 100)
    assert cost.predict_ms(100) == pytest.approx(2.0)
    assert not cost.observe(100, 5_000_000_000, shape="beam w16 s4 b8")  # a new shape: compiles
    assert cost.observe(100, FIXED_NS + PER_TOKEN_NS * 100, shape="beam w16 s4 b8")
    assert cost.skipped["first_of_shape"] == 2 and cost.predict_ms(100) == pytest.approx(2.0)


def test_a_run_marked_not_steady_teaches_nothing():
    cost = warmed(CostModel())
    before = cost.predict_ms(1000)
    assert not cost.observe(1000, 10 * FIXED_NS, steady=False)
    assert cost.predict_ms(1000) == before and cost.skipped["not_steady"] == 1


def test_a_batch_marked_not_steady_from_inside_fn_teaches_nothing():
    marked = {"every": False}

    def cost(tokens: int) -> int:
        if marked["every"]:
            mark_not_steady()  # e.g. the runner compiled during this batch
            return 100 * (FIXED_NS + PER_TOKEN_NS * tokens)
        return FIXED_NS + PER_TOKEN_NS * tokens

    sim = Sim([(i * 50_000_000, 100 * (1 + i % 4)) for i in range(8)], cost=cost).run()
    steady = sim.node.cost.batches
    assert steady == 7  # all but the first
    marked["every"] = True
    assert_slow_batches_teach_nothing(cost)


def assert_slow_batches_teach_nothing(cost) -> None:
    """Three batches 100x slower than the warmed model, each one not steady: none is learned."""
    sim = Sim([(i * 1_000_000_000, 100) for i in range(3)], cost=cost)
    sim.node.cost = warmed(CostModel())
    sim.run()
    assert sim.node.cost.skipped["not_steady"] == 3
    assert sim.node.cost.predict_ms(100) == pytest.approx(2.0)


def test_a_batch_during_which_the_process_compiled_teaches_nothing():
    """Any compile or graph capture in the process while a batch runs (`compile.events`, e.g. a
    beam shape the warm-up missed) makes the batch not steady, without the node being told."""
    from boundgen.compile.events import BEAM_GRAPH, COMPILES

    def cost(tokens: int) -> int:
        COMPILES.record(BEAM_GRAPH, "test")
        return 100 * (FIXED_NS + PER_TOKEN_NS * tokens)

    assert_slow_batches_teach_nothing(cost)


def test_a_slow_outlier_is_left_out_once_warm():
    cost = warmed(CostModel())
    assert not cost.observe(200, 50 * (FIXED_NS + PER_TOKEN_NS * 200))  # a GC pause, a compile
    assert cost.skipped["outlier"] == 1 and cost.predict_ms(200) == pytest.approx(3.0)


def test_a_compile_before_the_model_is_warm_is_dropped_going_warm():
    cost = CostModel(warm_batches=4, warm_units=0)
    cost.observe(100, FIXED_NS)  # the first run
    # the second run compiled a shape the node could not see, before anything could judge it
    for units, ns in ((300, 6_000_000_000), (100, None), (400, None), (200, None)):
        cost.observe(units, ns or FIXED_NS + PER_TOKEN_NS * units)
    assert cost.warm and cost.skipped["outlier"] == 1
    assert cost.predict_ms(1000) == pytest.approx(11.0, rel=0.01)


def test_a_lasting_change_of_cost_is_followed():
    cost = warmed(CostModel())
    slower = [(u, 4 * (FIXED_NS + PER_TOKEN_NS * u)) for u in (100, 400, 200, 800, 300, 600) * 3]
    taken = [cost.observe(u, ns) for u, ns in slower]
    assert not taken[0]  # at first an outlier
    assert cost.restarts == 1 and any(taken)
    assert cost.predict_ms(1000) == pytest.approx(4 * 11.0, rel=0.01)  # then the new cost


def test_after_warm_up_a_requests_predicted_time_is_within_2x_of_its_measured_median():
    """Poisson arrivals at a low, a high and an overloaded rate, one after the other, requests of
    1-8 × 272 tokens, on a model with the CPU demo server's cost shape (13 ms a forward, 18 µs a
    token), ±20 % noise, a 5 s compile on the first batch and a 10x pause every 40th batch: at
    each rate, the median of measured / predicted latency (each request's, predicted as admission
    does on its arrival) lies in [0.5, 2]."""
    rng = random.Random(7)
    runs = itertools.count(1)

    def cost(tokens: int) -> int:
        n = next(runs)
        ns = (13_000_000 + 18_000 * tokens) * rng.uniform(0.8, 1.2)
        return int(ns + 5e9 if n == 1 else ns * 10 if n % 40 == 0 else ns)

    arrivals, phases, offset = [], [], 0
    for rate in (10, 40, 150):  # per second; this model serves ~40 of these requests a second
        phase = [(offset + at, 272 * rng.randint(1, 8)) for at, _ in poisson(rate, 400, 0, rate)]
        phases.append(range(len(arrivals), len(arrivals) + len(phase)))
        arrivals += phase
        offset = phase[-1][0] + 20_000_000_000  # the queue drains in between
    sim = Sim(arrivals, cost=cost, token_budget=8192).run()
    for rate, ids in zip((10, 40, 150), phases):
        warm = [r for r in ids if sim.predicted[r] is not None]
        assert len(warm) > 300, rate  # the first phase warms the model up
        ratios = sorted((sim.finished[r] - sim.arrived[r]) / 1e6 / sim.predicted[r] for r in warm)
        assert 0.5 <= ratios[len(ratios) // 2] <= 2.0, (rate, ratios[len(ratios) // 2])


# ---- the adaptive budget -------------------------------------------------------------------------


def test_without_a_target_the_budget_is_fixed():
    sim = Sim(poisson(200, 200, 100), token_budget=8192).run()
    assert set(sim.budgets) == {8192}


def test_with_a_target_every_batch_runs_within_half_of_it_once_warm():
    # 1.25 requests of 100 tokens per ms: 0.8 ms of model time per ms with the batches the budget
    # allows (under capacity), in bursts that the fixed budget would merge into long batches
    arrivals = poisson(700, 600, 100)
    sim = Sim(arrivals, token_budget=8192, latency_target_ms=20.0).run()
    warm = [i for i, w in enumerate(sim.warm) if w]
    assert len(warm) > 0.9 * len(sim.batches)
    # the fake's cost is exactly linear, so is the fit: no batch runs past half the target
    assert max(sim.runs_ns[i] for i in warm) <= 10_000_000
    assert all(sim.budgets[i] < 8192 for i in warm)
    assert max(len(b) for b in sim.batches) > 1  # it still merges


def test_near_saturation_the_target_gives_up_no_throughput():
    """At 0.95 of the model's capacity the queue often holds more than two capped batches: then a
    batch takes the whole budget, as without a target (smaller batches would each pay the fixed
    cost, lose capacity and let the queue grow without bound)."""
    capacity = 1e9 / PER_TOKEN_NS / 100  # requests of 100 tokens per second, fixed cost aside
    arrivals = poisson(0.95 * capacity, 2000, 100, seed=1)
    fixed = Sim(arrivals, token_budget=8192).run()
    adaptive = Sim(arrivals, token_budget=8192, latency_target_ms=10.0).run()
    assert 8192 in adaptive.budgets[20:] and min(adaptive.budgets[20:]) < 8192  # both modes
    makespan = max(adaptive.finished.values()) / max(fixed.finished.values())
    assert makespan <= 1.02
    assert p99(adaptive.latencies_ms()) <= 1.1 * p99(fixed.latencies_ms())


def test_the_budget_shrinks_when_batches_get_slower_and_grows_back():
    slow = {"factor": 1}

    def cost(tokens: int) -> int:
        return slow["factor"] * (FIXED_NS + PER_TOKEN_NS * tokens)

    phases = [poisson(150, 300, 100, seed=s) for s in range(3)]
    arrivals, offset = [], 0
    for phase in phases:
        arrivals += [(offset + at, n) for at, n in phase]
        offset += phase[-1][0] + 1_000_000_000
    sim = Sim(arrivals, cost=cost, token_budget=8192, latency_target_ms=60.0)
    third = len(arrivals) // 3

    def slow_down_in_the_middle(batch, original=sim._fn):
        done = len(sim.finished)
        slow["factor"] = 4 if third <= done < 2 * third else 1
        return original(batch)

    sim.node.fn = slow_down_in_the_middle
    sim.run()
    last = {}  # the last capped budget of each phase (the fit has caught up by then)
    seen = 0
    for batch, budget in zip(sim.batches, sim.budgets):
        seen += len(batch)
        if budget < 8192:
            last[min(2, (seen - 1) // third)] = budget
    # (30 ms - fixed) / per token: 2900 tokens, 4x slower 650, then 2900 again
    assert last[1] < last[0] / 2  # slower per token: a much smaller budget
    assert last[2] > 2 * last[1]  # fast again: it grew back


def test_the_budget_keeps_the_oldest_request_within_its_deadline():
    sim = Sim([], token_budget=8192, latency_target_ms=1000.0)
    for units in (100, 400, 200, 800, 300, 600):  # warm the fit: 1 ms + 10 µs per token
        sim.node.cost.observe(units, FIXED_NS + PER_TOKEN_NS * units)
    oldest = FakeRequest(0, deadline_ns=sim.clock.ns + 4_000_000)  # 4 ms left: 300 tokens
    item = type("Item", (), {"req": oldest, "size": 100})()
    assert sim.node._budget(item, deque()) == 300
    item.req = FakeRequest(1, deadline_ns=sim.clock.ns - 1)  # already late: it alone
    assert sim.node._budget(item, deque()) == 1
    item.req = FakeRequest(2)  # no deadline: half the target, 49,900 tokens, over the budget
    assert sim.node._budget(item, deque()) == 8192


def test_latency_target_must_be_positive():
    with pytest.raises(PipelineError, match="latency_target_ms must be positive"):
        Sim([], latency_target_ms=0.0)
