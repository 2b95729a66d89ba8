"""The tail merge plan (`runtime/merge_plan.py`) against every way of splitting small queues, and a
`BatchingNode` with `merge_policy="tail"` on the fake model of `batching_sim.py`: requests mostly
of per-token cost run alone once the cost model is told, requests mostly of fixed cost merge as
with "all", and a W2-like stream at ~75 % load gets a lower p99 with no loss of throughput."""

from __future__ import annotations

import itertools
import random

import pytest
from batching_sim import Sim, p99, poisson
from fake_request import FakeRequest

from boundgen.runtime import batching
from boundgen.runtime.merge_plan import first_forward
from boundgen.runtime.node import PipelineError


def _splits(n: int):
    """Every split of n queued requests into consecutive forwards, as forward sizes."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield [*sizes, run]


def _weighted_completion(split, sizes, fixed, per_unit, future):
    """The plan's objective: each forward's time counted once for every request still queued at
    its start, and `future` more."""
    total, i = 0.0, 0
    left = len(sizes)
    for k in split:
        total += (left + future) * (fixed + per_unit * sum(sizes[i : i + k]))
        left -= k
        i += k
    return total


@pytest.mark.parametrize("seed", range(40))
def test_the_first_forward_starts_a_best_split(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    sizes = [rng.choice((16, 64, 256, 1856)) for _ in range(n)]
    fixed, per_unit = rng.choice((0.0, 0.1, 1.0, 50.0)), rng.choice((0.01, 0.5))
    budget = rng.choice((10**9, 2000, 4000))
    future = rng.choice((0, 2, 8))
    feasible = [
        s
        for s in _splits(n)
        if all(
            k == 1 or sum(sizes[i : i + k]) <= budget
            for i, k in zip(itertools.accumulate([0, *s[:-1]]), s)
        )
    ]
    best = min(_weighted_completion(s, sizes, fixed, per_unit, future) for s in feasible)
    k = first_forward(sizes, fixed, per_unit, budget, future=future)
    starts = [s for s in feasible if s[0] == k]
    assert starts, (sizes, k)
    got = min(_weighted_completion(s, sizes, fixed, per_unit, future) for s in starts)
    assert got == pytest.approx(best)


def test_without_a_fixed_cost_nothing_merges():
    assert first_forward([100] * 10, 0.0, 1.0, 10**9) == 1


def test_a_cost_all_fixed_merges_everything_that_fits():
    assert first_forward([100] * 10, 1e6, 1.0, 10**9) == 10
    assert first_forward([100] * 10, 1e6, 1.0, 450) == 4  # the budget
    assert first_forward([100] * 10, 1e6, 1.0, 10**9, max_requests=3) == 3


def test_a_request_over_the_budget_still_runs():
    assert first_forward([5000, 10], 1e6, 1.0, 1000) == 1
    assert first_forward([5000], 1.0, 1.0, 1000) == 1
    assert first_forward([], 1.0, 1.0, 1000) == 0


def test_a_longer_queue_merges_more():
    """Everything queued waits for each forward: the longer the queue, the more a fixed cost saved
    is worth against the wait a merge adds."""
    short = first_forward([100] * 2, 10.0, 1.0, 10**9, future=0)
    long = first_forward([100] * 16, 10.0, 1.0, 10**9, future=0)
    assert short == 1 and long > 1


# ---- the policy in a batching node ---------------------------------------------------------------

W2_TOKENS = 1856
FIXED_NS = 480_000  # the H200 W2 forwards' fixed cost (merge_plan's docstring)
PER_TOKEN_NS = 1_665  # ~3.09 ms a W2 request


def _w2_cost(tokens: int) -> int:
    return FIXED_NS + PER_TOKEN_NS * tokens


def test_the_policy_must_be_known():
    with pytest.raises(PipelineError, match="merge_policy"):
        Sim([], merge_policy="some")


def test_tail_runs_per_token_requests_alone_once_the_cost_is_told():
    """Cost all per token: once fixed and per-token cost are told apart (batches of 1–3 while
    cold, merged as "all"), no batch merges; "all" keeps merging what waits."""
    arrivals = poisson(250, 400, 1000, seed=3)  # 10 ms a request: ~2.5x overloaded in bursts

    def cost(tokens):
        return 10_000 * tokens

    tail = Sim(arrivals, cost=cost, merge_policy="tail", token_budget=8192).run()
    everything = Sim(arrivals, cost=cost, token_budget=8192).run()
    told = tail.node.cost.told_fit() is not None
    assert told
    late = tail.batches[len(tail.batches) // 2 :]
    assert max(len(b) for b in late) == 1
    assert max(len(b) for b in everything.batches[len(everything.batches) // 2 :]) > 1
    assert tail.node.stats()["planned_cuts"] > 0


def test_tail_merges_requests_whose_cost_is_mostly_fixed():
    arrivals = poisson(2000, 600, 64, seed=4)

    def cost(tokens):
        return 1_000_000 + 1_000 * tokens  # a 64-token prompt: 94 % fixed cost

    tail = Sim(arrivals, cost=cost, merge_policy="tail", token_budget=8192).run()
    everything = Sim(arrivals, cost=cost, token_budget=8192).run()
    assert tail.batches[50:] == everything.batches[50:]


def test_tail_before_the_cost_is_told_merges_as_all():
    arrivals = [(0, 100), (10_000, 100), (20_000, 100)]
    sim = Sim(arrivals, merge_policy="tail").run()
    assert sim.batches == [[0], [1, 2]]


def test_tail_lowers_a_w2_streams_p99_without_losing_throughput():
    """W2 requests at ~75 % of the fake GPU's capacity (Poisson): merged as "all", every request of
    a batch waits for the others' work; the plan merges only where the fixed cost pays."""
    capacity = 1e9 / _w2_cost(W2_TOKENS)
    arrivals = poisson(0.75 * capacity, 3000, W2_TOKENS, seed=5)
    tail = Sim(arrivals, cost=_w2_cost, merge_policy="tail", token_budget=15000).run()
    everything = Sim(arrivals, cost=_w2_cost, token_budget=15000).run()
    assert p99(tail.latencies_ms()) < 0.9 * p99(everything.latencies_ms())
    makespan = max(tail.finished.values()) / max(everything.finished.values())
    assert makespan <= 1.01


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_planned_cut_counts_only_a_live_request_it_kept_out(cancelled):
    """`planned_cuts` counts a batch the plan ended while a live request that fits waited, not one
    whose next request was cancelled while it waited (nothing was kept out)."""
    sim = Sim([], merge_policy="tail", token_budget=8192)
    node = sim.node
    node._planned = lambda first, waiting, budget: 1  # the plan: the first request alone
    lane = batching._Lane("key")
    reqs = [FakeRequest(i) for i in range(2)]
    reqs[1].failed = cancelled
    lane.waiting.extend(batching._Item(r, {}, lambda *a: None, 100, 0) for r in reqs)
    batch = node._take(lane)
    assert [it.req.request_id for it in batch] == [0]
    assert node.stats()["planned_cuts"] == (0 if cancelled else 1)
    assert len(lane.waiting) == (0 if cancelled else 1)
