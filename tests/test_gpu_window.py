"""`benchmarks/gpu_window.py`, the server prelude that records a window of the process's device
work: the thread and its file, and the window's summary from a profile of CPU ops."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_window


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; the GPU runs it in a server")
def test_without_cuda_the_window_file_says_why(tmp_path):
    out, trigger = tmp_path / "w" / "window.json", tmp_path / "go"
    thread = gpu_window.start(delay_s=0.0, seconds=0.0, out=str(out), trigger=str(trigger))
    time.sleep(0.2)
    assert thread.is_alive() and not out.exists()  # waits for its trigger
    trigger.touch()
    thread.join(timeout=30)
    assert "no CUDA device" in json.loads(out.read_text())["error"]


def test_a_window_summary_counts_busy_time_gaps_and_kernels():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            a = torch.tanh(a @ a)
            time.sleep(0.01)  # idle between the ops: gaps of at least this long
        wall_ms = (time.perf_counter() - t0) * 1e3
    got = gpu_window.summarize(prof, wall_ms, cuda=False)
    assert got["launches"] >= 6 and 0 < got["gpu_busy_ms"] < wall_ms
    assert got["gpu_busy_share"] == pytest.approx(got["gpu_busy_ms"] / wall_ms)
    assert got["longest_gaps"][0]["ms"] >= 9 and got["idle_between_ms"] >= 18
    names = {k["kernel"] for k in got["kernels"]}
    assert {"aten::tanh", "aten::mm"} <= names


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; the GPU runs it in a server")
def test_the_prelude_records_once_triggered_and_read_returns_the_file(tmp_path):
    out, trigger = tmp_path / "window.json", tmp_path / "go"
    out.write_text("{}")  # a stale window from an earlier run is removed
    code = gpu_window.prelude(0.0, out, trigger)
    assert not out.exists()
    exec(code, {})
    assert gpu_window.read(out, wait_s=0.3) == {"error": "no window.json"}
    trigger.touch()
    assert "no CUDA device" in gpu_window.read(out, wait_s=30)["error"]


def test_a_window_line_names_busy_share_gaps_and_top_kernels():
    w = {
        "wall_ms": 2000.0,
        "gpu_busy_ms": 1500.0,
        "gpu_busy_share": 0.75,
        "launches": 40,
        "idle_between_ms": 500.0,
        "longest_gaps": [{"ms": 3.25}],
        "kernels": [{"kernel": "gemm", "ms": 700.0}],
    }
    assert gpu_window.line(w) == (
        "wall 2000 ms, GPU busy 1500 ms (75%), 40 launches, idle between 500.0 ms "
        "(longest 3.25); top: gemm 700.0 ms"
    )
    assert gpu_window.line({"error": "no CUDA device"}) == "no CUDA device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; the GPU runs it in a server")
def test_under_load_triggers_the_window_while_the_load_runs(tmp_path, capsys):
    out, trigger = tmp_path / "window.json", tmp_path / "go"
    exec(gpu_window.prelude(0.0, out, trigger), {})
    seen = []

    def load(seconds):  # a load step: the trigger appears one second into it
        seen.append(seconds)
        time.sleep(1.5)
        assert trigger.exists()
        return {"ok_per_s": 1.0}

    row, window = gpu_window.under_load(out, trigger, 0.5, load, "2 connections")
    assert seen == [3.5] and row == {"ok_per_s": 1.0, "profiled": "GPU window"}
    assert "no CUDA device" in window["error"]
    assert capsys.readouterr().out.startswith(f"GPU window (2 connections): {window['error']}")


def test_a_profiled_run_says_so_in_its_load_cell():
    """The window's CUPTI slows the server it records: its row's load cell names it, so the row
    is not read as the server's throughput."""
    import wrk

    row = {"connections": 256, "think_ms": 0.0}
    assert wrk.load_label(row) == "256 conn"
    assert wrk.load_label(row | {"profiled": "GPU window"}) == "256 conn, GPU window on"
    assert wrk.load_label({"connections": 64, "think_ms": 210.4}) == "64 conn, think 210 ms"
