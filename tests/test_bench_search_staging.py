"""`benchmarks/bench_search_staging.py`: both sides of the search-staging A/B run (on the CPU, its
smoke test) and leave the slot's buffers as `BucketSet.pad` of the packed prompts would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_search_staging as bench  # noqa: E402

from boundgen.compile.buckets import Bucket  # noqa: E402
from boundgen.text.packing import SequenceGroup  # noqa: E402


def test_both_sides_are_timed(tmp_path):
    out = tmp_path / "staging.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_search_staging.py")]
    cmd += ["--device", "cpu", "--iters", "3", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())["searches"]
    assert list(got) == ["1 prompts (t128)", "8 prompts (t1024)"]
    for row in got.values():
        for side in ("before", "staged"):
            assert 0 < row[side]["host_us"] <= row[side]["until_copied_us"]


def test_the_staged_side_stages_what_the_packed_side_copies():
    """The A/B compares like with like: after one call each, the slot's device buffers hold the
    same ids, positions, segments, last rows and lengths on both sides."""
    bucket = Bucket.parse("t128")
    group = SequenceGroup([], [list(range(5, 45)), list(range(7, 17))])
    dev = torch.device("cpu")
    (old, old_bufs), (new, new_bufs) = (
        bench.before(bucket, group, dev),
        bench.staged(bucket, group, dev),
    )
    old()
    new()
    assert set(old_bufs) <= set(new_bufs)
    for name, want in old_bufs.items():
        assert torch.equal(new_bufs[name], want), name
    assert new_bufs["lengths"].tolist() == [40, 10]
