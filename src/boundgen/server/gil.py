"""The interpreter's GIL switch interval for a serving process.

A server runs Python on several threads at once: the event loop (HTTP, JSON), the pipeline nodes
(request checks, packing, staging, launching the forward) and the reply path. Every torch call
releases the GIL, and a thread that wants it back while another thread runs Python waits until
that thread is asked to let go, up to the switch interval (CPython's default 5 ms). The forward
node makes a few dozen torch calls per merged batch. On the H200 (W5, 2026-12-02, BENCHMARKS.md)
0.5 ms gave the forward node less host time per forward of ~7.5 requests (pack / stage / launch
7.7 / 4.3 / 4.6 against 11.5 / 7.5 / 5.3 ms) and wrk's closed loop 260 req/s at p99 118 ms, but
three runs of the unchanged server spanned 237-256 req/s at p99 132-176 ms and its open-loop
generator was served more (274 against 230 req/s): no effect shown beyond the spread. So a server
leaves CPython's interval unless `--gil-switch-ms` is given (the A/B).
"""

from __future__ import annotations

import sys


def set_switch_interval(ms: float) -> float:
    """Set the process's GIL switch interval to `ms` milliseconds; → the previous one (ms)."""
    if not ms > 0:
        raise ValueError(f"the GIL switch interval must be > 0 ms, got {ms}")
    before = sys.getswitchinterval() * 1e3
    sys.setswitchinterval(ms / 1e3)
    return before
