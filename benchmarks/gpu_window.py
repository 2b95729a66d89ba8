"""What the GPU does inside a running server over a window of its life (issue 25: at W5's
saturation every forward is full and its stream always busy, yet one forward takes 29.3 ms against
25.2 ms of kernels in process — does the GPU idle between the server's forwards, and which kernels
does it run?). Run as a server prelude; `bench_tail.py --gpu-window SECONDS` adds it and starts the
window once its last, saturated step is under way (`trigger`: a file it creates then):

    import sys; sys.path.insert(0, "benchmarks"); import gpu_window
    gpu_window.start(delay_s=0, seconds=2, out="/root/out/w5_window.json", trigger="/tmp/go")

After `delay_s` (and once `trigger` exists, when given) a daemon thread records `seconds` of the
process's device work with torch.profiler (CUDA activity only: CUPTI sees the kernels and copies of
every thread, and no CPU op is traced, so the server's Python is not slowed) and writes JSON: the
window's `wall_ms`, `gpu_busy_ms` and `gpu_busy_share`, `launches`, the longest idle gaps and the
per-kernel table. Without CUDA the file says so (`error`): the profiler's CPU ops are recorded per
thread, so a CPU window of the server's other threads would come back empty.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from common import busy_us, idle_gaps, kernel_rows

HERE = Path(__file__).resolve().parent


def prelude(seconds: float, out: Path, trigger: Path) -> str:
    """A server prelude (Python run first in `boundgen serve`'s process) that records one window
    of `seconds` into `out` once `trigger` exists: the caller touches it when the load is on."""
    out.unlink(missing_ok=True)
    trigger.unlink(missing_ok=True)
    return (
        f"\nimport sys; sys.path.insert(0, {str(HERE)!r}); import gpu_window; "
        f"gpu_window.start(0, {seconds}, {str(out)!r}, {str(trigger)!r})"
    )


def read(path: Path, wait_s: float = 20.0) -> dict:
    """The server's window, once written (`error` when it never was)."""
    end = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.2)
    return json.loads(path.read_text()) if path.exists() else {"error": f"no {path.name}"}


def under_load(window: Path, trigger: Path, seconds: float, load, label: str):
    """Run `load(seconds + 3)` (a saturated closed loop, returning its row) and, one second in,
    touch `trigger` so the server records `seconds` of its GPU work; print the window in a line
    under `label` and return (the load's row, marked `profiled`, and the window)."""
    threading.Timer(1.0, trigger.touch).start()
    row = load(seconds + 3) | {"profiled": "GPU window"}
    w = read(window)
    print(f"GPU window ({label}): {line(w)}", flush=True)
    return row, w


def line(w: dict) -> str:
    """One window in a line: busy share, launches, gaps, the top five kernels."""
    if "error" in w:
        return w["error"]
    top = ", ".join(f"{k['kernel'][:40]} {k['ms']:.1f} ms" for k in w["kernels"][:5])
    gaps = ", ".join(f"{g['ms']:.2f}" for g in w["longest_gaps"])
    return (
        f"wall {w['wall_ms']:.0f} ms, GPU busy {w['gpu_busy_ms']:.0f} ms "
        f"({w['gpu_busy_share']:.0%}), {w['launches']} launches, idle between "
        f"{w['idle_between_ms']:.1f} ms (longest {gaps}); top: {top}"
    )


def start(
    delay_s: float, seconds: float, out: str, trigger: str | None = None, top: int = 30
) -> threading.Thread:
    """Record one window in a daemon thread (returned, so a caller can join it)."""
    args = (delay_s, seconds, Path(out), trigger and Path(trigger), top)
    thread = threading.Thread(target=_record, args=args, name="gpu-window", daemon=True)
    thread.start()
    return thread


def _record(delay_s: float, seconds: float, out: Path, trigger: Path | None, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    time.sleep(delay_s)
    while trigger is not None and not trigger.exists():
        time.sleep(0.05)
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: nothing to record")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            time.sleep(seconds)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        summary = summarize(prof, wall_ms, True, top)
    except Exception as exc:  # the server must not notice: the window says what went wrong
        summary = {"error": repr(exc)[:500]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))


def summarize(prof, wall_ms: float, cuda: bool, top: int = 30) -> dict:
    """A recorded window: busy time (the union of the spans), gaps, kernels by their own time
    (`cuda` false: CPU ops and their CPU time, for tests)."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()]
    busy_ms = busy_us(spans) / 1e3
    gaps = idle_gaps(spans, [])
    return {
        "wall_ms": wall_ms,
        "device": "cuda" if cuda else "cpu",
        "launches": len(spans),
        "gpu_busy_ms": busy_ms,
        "gpu_busy_share": busy_ms / wall_ms if wall_ms else 0.0,
        "idle_between_ms": gaps.get("idle_between_ms", 0.0),
        "longest_gaps": gaps.get("longest_gaps", []),
        "kernels": kernel_rows(prof, cuda)[:top],
    }
