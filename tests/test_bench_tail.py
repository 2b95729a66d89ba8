"""`benchmarks/bench_tail.py`'s collections line: what the runs themselves collected, apart from
the longest pause since the server started (which its warm-up may have set)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_tail


def test_the_collections_line_gives_the_runs_mean_and_the_longest_since_start():
    before = {"gen1_seconds_count": 8, "gen1_seconds_sum": 0.065, "gen1_max_seconds": 0.0478}
    after = {"gen1_seconds_count": 141, "gen1_seconds_sum": 0.5, "gen1_max_seconds": 0.0478}
    line = bench_tail.gc_line(before, after)
    assert "gen1: 133 (3.27 ms on average, longest since start 47.8 ms)" in line
    assert "gen0: 0 (longest since start 0.0 ms)" in line  # no collection: no mean
