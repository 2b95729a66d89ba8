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


def test_frontends_loops_and_cpu_are_reported_beside_the_engines():
    """With `--frontends`: their loops' late wake-ups follow the engine loop's on the line, and
    their CPU per request follows the engine's threads'."""
    lag = {"0.001": 100, "0.01": 100, "0.05": 100, "+Inf": 100}
    before = reading(lag, {}) | wrk._buckets(
        {'le="0.01"': 10, 'le="0.05"': 10, 'le="+Inf"': 10}, "flag_le:"
    )
    after = reading({k: v + 500 for k, v in lag.items()}, {}) | wrk._buckets(
        {'le="0.01"': 400, 'le="0.05"': 409, 'le="+Inf"': 410}, "flag_le:"
    )
    st = wrk.stalls(before, after)
    assert (st["frontend_wakeups"], st["frontend_late_10ms"], st["frontend_late_50ms"]) == (
        400,
        10,
        1,
    )
    line = wrk.stall_line({"stalls": st})
    assert line.endswith("frontends' loops: lag p99 ≤ 50 ms, 10 of 400 late > 10 ms")
    assert "GC pauses > 10 ms: 0;" in line

    counts = {"requests": 100.0, "frontend_cpu:0": 1.0, "frontend_cpu:1": 2.0}
    later = {"requests": 300.0, "frontend_cpu:0": 1.1, "frontend_cpu:1": 2.3}
    per = wrk.frontend_cpu_per_request(counts, later)
    assert per == pytest.approx({"frontend-0": 0.5, "frontend-1": 1.5})
    row = {"thread_cpu_ms_per_request": {"MainThread": 0.2}, "frontend_cpu_ms_per_request": per}
    assert wrk.cpu_line(row).endswith(
        "CPU ms per request: 0.20 (MainThread 0.20); frontend processes 2.00 "
        "(frontend-0 0.50, frontend-1 1.50)"
    )
    assert wrk.frontend_cpu_per_request({"requests": 1.0}, {"requests": 5.0}) == {}
