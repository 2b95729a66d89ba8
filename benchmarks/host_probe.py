"""How fast this host runs a server's Python, measured in a few seconds: a line at the head of
every device call, so that calls on different machines can be told apart before their numbers
are compared.

The device machines' hosts differ: with the same code, `/v1/beam`'s event loop took 0.20 ms of
CPU a request on one H100 machine and 0.50 on another, woke late only on the second, and the
server took twice as long to start there (BENCHMARKS.md, thirty-first session). What the probe
reads:

- `python_ms`: a fixed piece of pure Python (dict and list work, ~what a request's parsing does),
  the best of five — the per-request CPU of the event loop scales with it;
- `handoff_us`: two threads passing a turn back and forth through locks, µs a round trip (median
  and p99) — what every hand-off between the event loop and a worker costs: a wake-up of a
  sleeping thread and the GIL passing to it;
- `numpy_us`: one round of the small numpy calls a request's packing and staging make (a W2
  request's 1,856 ids from a list, its segments' offsets, a concatenation of 101 pieces, a padded
  copy), the best of five — the host steps before a replay are such calls, and on H100 hosts
  they read 2–5x the dev machine's where `python_ms` read the same (BENCHMARKS.md, fiftieth
  session): this tells a host's numpy apart from the path;
- `steal`: the share of the CPUs' time the hypervisor took over a second of this probe;
- `clock_ns`: one reading of each clock the runtime reads several times a request
  (`perf_counter_ns`, and `thread_time_ns`, a system call where the wall clock is not: a virtual
  machine may trap it).

    python benchmarks/host_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import host_cpu
import numpy as np


def python_ms(rounds: int = 5) -> float:
    """Best time of a fixed pure-Python workload, ms."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        d: dict[int, list[int]] = {}
        for i in range(200_000):
            d.setdefault(i % 1_000, []).append(i)
        sum(len(v) for v in d.values())
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def numpy_us(rounds: int = 5, calls: int = 200) -> float:
    """Best µs of one round of small numpy calls as packing makes them for a W2 request: 1,856
    token ids from a list, cumulative offsets of 101 segments, their positions concatenated, the
    ids copied into a padded buffer and the rest zeroed."""
    ids = list(range(1_856))
    lengths = np.full(101, 16, dtype=np.int64)
    lengths[0] = 256
    pieces = [np.arange(n, dtype=np.int64) for n in lengths.tolist()]
    padded = np.empty(1_920, dtype=np.int64)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            a = np.fromiter(ids, dtype=np.int64, count=len(ids))
            lengths.cumsum()  # the method, as packing calls it
            np.concatenate(pieces)
            padded[: a.shape[0]] = a
            padded[a.shape[0] :] = 0
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def handoff_us(trips: int = 2_000) -> tuple[float, float]:
    """(median, p99) µs of a round trip between two threads, each waiting on a lock the other
    releases."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def echo() -> None:
        for _ in range(trips):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    for _ in range(trips):
        t0 = time.perf_counter()
        ping.release()
        pong.acquire()
        times.append((time.perf_counter() - t0) * 1e6)
    thread.join()
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def clock_ns(reads: int = 20_000) -> dict[str, float]:
    """Median ns of one reading of each clock (over batches of 100 readings)."""
    out = {}
    for name, clock in (
        ("perf_counter_ns", time.perf_counter_ns),
        ("thread_time_ns", time.thread_time_ns),
    ):
        batches = []
        for _ in range(reads // 100):
            t0 = time.perf_counter_ns()
            for _ in range(100):
                clock()
            batches.append((time.perf_counter_ns() - t0) / 100)
        out[name] = round(statistics.median(batches), 1)
    return out


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def probe() -> dict:
    before = host_cpu.read()
    t0 = time.perf_counter()
    py = python_ms()
    np_us = numpy_us()
    median, p99 = handoff_us()
    clocks = clock_ns()
    rest = 1.0 - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)  # at least a second of accounting for the steal share
    stolen = host_cpu.usage(before, host_cpu.read()).get("steal")
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python_ms": round(py, 2),
        "numpy_us": round(np_us, 1),
        "handoff_us_median": round(median, 1),
        "handoff_us_p99": round(p99, 1),
        "steal": None if stolen is None else round(stolen, 4),
        "clock_ns": clocks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    r = probe()
    steal = "n/a" if r["steal"] is None else f"{100 * r['steal']:.1f} %"
    print(
        f"host: {r['cpus']} CPUs ({r['cpu_model']}); Python workload {r['python_ms']:.1f} ms; "
        f"numpy packing round {r['numpy_us']:.1f} µs; "
        f"thread hand-off {r['handoff_us_median']:.1f} µs median, {r['handoff_us_p99']:.1f} p99; "
        f"steal {steal}; a clock reading {r['clock_ns']['perf_counter_ns']:.0f} ns (wall), "
        f"{r['clock_ns']['thread_time_ns']:.0f} ns (thread CPU)",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
