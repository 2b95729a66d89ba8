"""How many of the waiting requests the next merged forward takes, for the tail (issue 25, W5).

A merged batch answers all its requests when it ends, so merging delays every request in it but
the last by the others' work; what it saves is a forward's fixed cost (launches, host work, the
latency-bound kernels) per request merged. "Everything that fits" (`all`) is right when the fixed
cost dominates (a 64-token prompt: the forward of 8 costs little more than of 1) and wrong when the
per-token cost does: W2's forward of 2 requests took 1.86x one's GPU time, of 8 7.06x (H200,
BENCHMARKS.md, 2026-12-02 fifth session: fixed ~0.48 ms, ~3.1 ms a request). There, under Poisson
arrivals at 70 % of the unmerged capacity, one simulated GPU queue (`benchmarks/sim_merge.py`, fixed
share 0.13 of a lone request's forward) has its p99 at 7.7 lone forwards' time merging everything
waiting, 6.7 with this plan (BENCHMARKS.md, CPU, 2026-12-06). On the H100's served path the cost
model fitted ~1 ms fixed a forward (launch and host work on top of the GPU's), a share of ~0.25 for
W2, where the plan merges nearly as much as `all` (thirty-fifth session).

The plan: split the queue (oldest first, at most `WINDOW` requests) into consecutive forwards
that minimise the sum of the requests' completion times, plus `FUTURE` requests more waiting
behind the whole queue (what arrives meanwhile waits for all of it, so the fixed costs a plan
pays delay them too); the next forward is the plan's first. A dynamic programme over the queue's
suffixes, O(WINDOW²). With no fixed cost it never merges (nothing to save); the longer the queue
and the larger the fixed cost, the more it merges, so under a backlog it keeps what merging
saves. (`FUTURE` from that simulation, `--futures`: 8 against 0, 2, 4 and 16 at fixed shares
0.05–0.3 and 60–90 % load; 8 was never above merging everything, and within 13 % of the best
fixed cap.)
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 16  # requests planned over; a longer queue's rest counts as `FUTURE`-like load
FUTURE = 8  # requests assumed to arrive behind the queue while it drains


def first_forward(
    sizes: Sequence[float],
    fixed: float,
    per_unit: float,
    budget: float,
    max_requests: int | None = None,
    future: float = FUTURE,
) -> int:
    """Requests (at least 1) the next forward takes of a FIFO queue of `sizes` (units each, the
    oldest first), when a forward of u units costs `fixed + per_unit · u` and takes at most
    `budget` units (a request larger than the budget still runs alone) and `max_requests`."""
    n = len(sizes)
    if n <= 1:
        return n
    ends = [0.0]
    for s in sizes:
        ends.append(ends[-1] + s)
    most = n if max_requests is None else max(1, max_requests)
    # cost[i]: the least weighted completion time of requests i.. (all of them wait for each
    # forward before theirs); first[i]: the size of the first forward of that plan
    cost = [0.0] * (n + 1)
    first = [1] * (n + 1)
    for i in range(n - 1, -1, -1):
        waiting = n - i + future
        best = None
        for j in range(i + 1, min(n, i + most) + 1):
            units = ends[j] - ends[i]
            if j > i + 1 and units > budget:
                break
            c = waiting * (fixed + per_unit * units) + cost[j]
            if best is None or c < best:
                best, first[i] = c, j - i
        cost[i] = best
    return first[0]
