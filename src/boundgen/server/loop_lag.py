"""How late the event loop runs what is due: a probe that asks to wake every `INTERVAL_S` and
records how much later than that it woke (`boundgen_event_loop_lag_seconds`, and its worst as
`boundgen_event_loop_lag_max_seconds`).

Every request's hand-offs go through the event loop: its body is read there, its result is handed
back there from the thread that finished it (`hops` in `/v1/beam`'s `Server-Timing`). When the loop
is busy with other requests' Python, or waits for the GIL while a worker thread runs Python, each
of those steps is late by as much. Under `/v1/beam` load on an H100 the slowest 1 % of requests
spent 70 ms in `hops` (BENCHMARKS.md, thirtieth session) — the loop late, or the GIL, or the
hand-back itself: this lag tells the first two from the third. A wake-up late by more than the
interval means the loop (or the GIL it needs) was held that long; GC pauses, also on the loop's
thread, are counted apart (`heap.GCPauses`).

The probe runs from the app's start, its warm-up included (the worst lag is since then, as the GC's
longest pause is), and costs one timer wake-up per interval (100 a second by default).
"""

from __future__ import annotations

import asyncio
from typing import Any

INTERVAL_S = 0.01
# the lag's buckets (seconds): on an idle loop a wake-up was 0.17 ms late on average (the 2-core
# development machine)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


async def probe(histogram: Any, worst: Any, interval_s: float = INTERVAL_S) -> None:
    """Until cancelled: sleep `interval_s`, observe how much later than asked the loop woke into
    `histogram` (a prometheus `Histogram`) and keep the largest in `worst` (a `Gauge`)."""
    loop = asyncio.get_running_loop()
    most = 0.0
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - asked)
        histogram.observe(lag)
        if lag > most:
            most = lag
            worst.set(lag)
