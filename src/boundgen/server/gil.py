"""The interpreter's GIL switch interval for a serving process.

A server runs Python on several threads at once: the event loop (HTTP, JSON), the pipeline nodes
(request checks, packing, staging, launching the forward) and the reply path. Every torch call
releases the GIL, and a thread that wants it back while another thread runs Python waits until
that thread is asked to let go, up to the switch interval (CPython's default 5 ms). The forward
node makes a few dozen torch calls per merged batch, so at saturation it waited for the GIL more
than it worked: on the H200 (W5, 2026-12-02, BENCHMARKS.md) its host time per forward of 7.5
merged requests was 11.5 ms packing, 7.5 staging and 5.3 launching, where packing and padding take
~0.19 ms a request on an idle development CPU (`bench_host.py`), and it bounded the server at ~237
req/s. With 0.5 ms: 7.7 / 4.3 / 4.6 ms and ~260 req/s, p99 118 against 176 ms (one pair of runs on
one machine). A shorter interval costs threads that run Python alone a little more switching.
"""

from __future__ import annotations

import sys

DEFAULT_MS = 0.5


def set_switch_interval(ms: float) -> float:
    """Set the process's GIL switch interval to `ms` milliseconds; → the previous one (ms)."""
    if not ms > 0:
        raise ValueError(f"the GIL switch interval must be > 0 ms, got {ms}")
    before = sys.getswitchinterval() * 1e3
    sys.setswitchinterval(ms / 1e3)
    return before
