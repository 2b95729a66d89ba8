"""`benchmarks/profile_w3.py --stream/--gated/--qkv/--copy/--pdl/--bucket-gated`: every setting
given (the streamed GEMMs' rows and kernels, where the staged inputs are copied in, programmatic
edges, the bucket's gate_up kernel) is built as its own side and timed interleaved; on the
CPU (its smoke test) each side still answers the request as eager, and its host steps before a
replay are timed; `--hf` times transformers on the same request in the same process; `--stub-rows`
leaves the host path alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke_run(tmp_path) -> list[str]:
    """The benchmark on the CPU, tiny model, the current path, a few calls."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_w3.py"), "--preset", "tiny"]
    cmd += ["--root", str(tmp_path / "models"), "--device", "cpu", "--variants", "after"]
    return cmd + ["--iters", "3", "--warmup", "1", "--profile-calls", "1", "--kernels", "2"]


def test_sides_are_built_and_timed_side_by_side(tmp_path):
    out = tmp_path / "w3.json"
    cmd = _smoke_run(tmp_path)
    cmd += ["--stream", "0,64", "--gated", "1", "--qkv", "1"]
    cmd += ["--copy", "graph", "--bucket-gated", "1"]
    cmd += ["--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    sides = [
        "after/stream0/gated1/qkv1/copy-graph/bucket-gated1",
        "after/stream64/gated1/qkv1/copy-graph/bucket-gated1",
    ]
    assert list(got["variants"]) == sides
    assert list(got["interleaved"]) == sides
    for side in sides:
        assert set(got["interleaved"][side]) == {"engine", "runner"}
        assert got["variants"][side]["max_abs_diff_vs_eager"] < 1e-4
        # the host steps before a replay, timed on the CPU too
        assert set(got["variants"][side]["split_us"]) == {"pieces", "fill", "wall"}
        # the summary (the last table) sets each side's interleaved time beside its time alone
        for path_ in ("engine", "runner"):
            row = [
                line.split()
                for line in res.stdout.splitlines()
                if line.split()[:2] == [side, path_]
            ][-1]
            want = got["interleaved"][side][path_]["wall_ms_median"]
            # printed to 3 decimals from the same float: the same text (a tolerance of half a
            # unit failed at a tie, 2.446 printed for 2.4455)
            assert row[3] == f"{want:.3f}"
    assert "alone ms  interleaved ms" in res.stdout


def test_hf_is_timed_after_boundgen_in_the_same_process(tmp_path):
    out = tmp_path / "w3.json"
    cmd = _smoke_run(tmp_path) + ["--hf", "eager", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    hf = json.loads(out.read_text())["hf"]
    assert list(hf) == ["eager"]
    assert hf["eager"]["iters"] == 3 and hf["eager"]["wall_ms_median"] > 0
    assert hf["eager"]["max_abs_diff_vs_eager"] < 1e-4  # the same scores as boundgen's eager


def test_stubbed_rows_still_answer_the_request(tmp_path):
    # the host path alone: the rows computed once are handed back, the scores stay the model's
    out = tmp_path / "w3.json"
    cmd = _smoke_run(tmp_path) + ["--workload", "w2", "--stub-rows", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    side = json.loads(out.read_text())["variants"]["after"]
    assert side["max_abs_diff_vs_eager"] < 1e-4
    assert side["engine"]["wall_ms_median"] > 0 and side["runner"]["wall_ms_median"] > 0


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--stream", "64,64+gelu", "--stream: rows are a whole number, not '64+gelu'"),
        ("--hf", "eager,vllm", "--hf: choose from eager,compile"),
    ],
)
def test_a_bad_setting_is_refused_before_anything_is_built(tmp_path, flag, value, message):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_w3.py"), "--preset", "tiny"]
    cmd += ["--root", str(tmp_path / "models"), "--device", "cpu", flag, value]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 2
    assert message in res.stderr
    assert not (tmp_path / "models").exists()
