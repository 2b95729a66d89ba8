"""`benchmarks/wrk.py`'s stalls over a run: the event loop's late wake-ups and the GC's long
pauses, from two readings of the server's cumulative histograms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import wrk


def reading(lag: dict[str, float], gc: dict[str, dict[str, float]]) -> dict[str, float]:
    """A `node_counters` reading's histogram part, made from /metrics-like samples."""
    lag_samples = {f'le="{le}"': n for le, n in lag.items()}
    gc_samples = {
        f'generation="{g}",le="{le}"': n for g, by_le in gc.items() for le, n in by_le.items()
    }
    return wrk._buckets(lag_samples, "lag_le:") | wrk._buckets(gc_samples, "gc_le:")


def test_stalls_count_what_happened_between_the_readings():
    before = reading(
        {"0.001": 90, "0.01": 99, "0.05": 100, "+Inf": 100},
        {"0": {"0.01": 5, "+Inf": 5}, "2": {"0.01": 0, "+Inf": 1}},  # a pause at the warm-up
    )
    after = reading(
        {"0.001": 1080, "0.01": 1096, "0.05": 1099, "+Inf": 1100},
        {"0": {"0.01": 50, "+Inf": 50}, "2": {"0.01": 0, "+Inf": 3}},
    )
    st = wrk.stalls(before, after)
    assert st["loop_wakeups"] == 1000
    assert st["loop_late_10ms"] == 3 and st["loop_late_50ms"] == 1
    assert st["loop_lag_p99_le_ms"] == 1.0  # 990 of 1,000 under 1 ms
    assert st["gc_pauses_over_10ms"] == 2  # generation 2's, in the run only
    line = wrk.stall_line({"stalls": st})
    assert "lag p99 ≤ 1 ms, 3 of 1000 wake-ups late > 10 ms, 1 > 50 ms" in line
    assert line.endswith("GC pauses > 10 ms: 2")


def test_no_loop_lag_no_line():
    """A server without the probe (an older build, a peer's): nothing to report."""
    assert wrk.stalls({}, {}) == {}
    assert wrk.stall_line({"stalls": {}}) == ""
