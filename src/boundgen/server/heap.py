"""Keep Python's cyclic garbage collector out of request latency, and measure it.

A serving process holds hundreds of thousands of long-lived objects after start-up (torch,
transformers, FastAPI, the engine: 345K for the demo server). A full (oldest-generation) collection
walks all of them — 185 ms on the 2-core development machine — and stalls whichever requests are in
flight. CPython runs one only when the survivors since the last one reach a quarter of the
long-lived objects, so it is rare (none in 320 requests of a CPU load test), but when it comes it is
a p99 event. `gc.freeze()` after start-up moves those objects into a permanent generation that
collections skip: once the app is built, and again after the warm-up (compiling the beam searches'
graphs makes many more long-lived objects). Objects made by requests are still collected as usual.
`boundgen_gc_pause_seconds` (per generation) shows whether pauses matter for a deployment.

The collector is paused from the start of `boundgen serve` until the server is ready
(`pause_until_ready`): the warm-up's `torch.compile` tracing allocates fast enough to run
collection after collection over the start-up heap — ~1.5 s of a later start sampled on the H200
(`BOUNDGEN_STARTUP_PROFILE`, 2026-12-02). The freeze at readiness collects once instead.

At exit the heap is unfrozen: the interpreter's last collection never looks at frozen objects, so
cycles among them were never freed, and extensions that count their live objects at exit said so
— every stop of `boundgen serve` ended in hundreds of lines of Triton's "nanobind: leaked ...".
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger("boundgen.server")

# A full collection once per this many middle-generation ones (CPython's default: 10). Measured
# on the H200 (W5 at 5-300 req/s, about 96 s of load, heap frozen after the warm-up): 53 full
# collections of 26.5 ms on average, each a p99 event; the frozen heap keeps the long-lived count
# small, so CPython's "a quarter more long-lived objects" rule no longer holds them back.
FULL_COLLECTION_EVERY = 100
_unfreeze_at_exit = False


def pause_until_ready() -> None:
    """No automatic collections until `freeze_startup_heap(ready=True)` (start-up only)."""
    gc.disable()


def freeze_startup_heap(ready: bool = True) -> dict:
    """Collect once, then freeze what is left (call after the engine and the app are built, and
    after the warm-up); from then on a full collection runs once per `FULL_COLLECTION_EVERY`
    middle-generation ones. `ready`: the start-up is over, automatic collections resume."""
    global _unfreeze_at_exit
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:  # once however many freezes (the app, then the warm-up)
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
    if ready:
        gc.enable()
    info = {"frozen_objects": gc.get_freeze_count(), "seconds": time.perf_counter() - t0}
    log.info(
        "gc: froze %d start-up objects (%.2f s); full collections now skip them",
        info["frozen_objects"],
        info["seconds"],
    )
    return info


# ------------------------------------------------------------------------------- pause measurement

PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GCPauses:
    """Process-wide timing of every collection, per generation (one `gc.callbacks` hook however
    many apps the process builds). `collect()` makes it a Prometheus collector:
    `boundgen_gc_pause_seconds`."""

    _instance: GCPauses | None = None

    def __init__(self) -> None:
        self._start: float | None = None
        self.buckets = {g: [0] * len(PAUSE_BUCKETS) for g in range(3)}
        self.count = dict.fromkeys(range(3), 0)
        self.total = dict.fromkeys(range(3), 0.0)
        self.max = dict.fromkeys(range(3), 0.0)

    @classmethod
    def install(cls) -> GCPauses:
        if cls._instance is None:
            cls._instance = cls()
            gc.callbacks.append(cls._instance._callback)
        return cls._instance

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is None:
            return
        pause, self._start = time.perf_counter() - self._start, None
        g = min(int(info.get("generation", 2)), 2)
        self.count[g] += 1
        self.total[g] += pause
        self.max[g] = max(self.max[g], pause)
        for i, edge in enumerate(PAUSE_BUCKETS):
            if pause <= edge:
                self.buckets[g][i] += 1

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily(
            "boundgen_gc_pause_seconds",
            "Python garbage-collection pauses by generation",
            labels=["generation"],
        )
        worst = GaugeMetricFamily(
            "boundgen_gc_pause_max_seconds",
            "longest collection pause so far",
            labels=["generation"],
        )
        for g in range(3):
            cum = [(str(edge), float(n)) for edge, n in zip(PAUSE_BUCKETS, self.buckets[g])]
            hist.add_metric([str(g)], cum + [("+Inf", float(self.count[g]))], self.total[g])
            worst.add_metric([str(g)], self.max[g])
        yield hist
        yield worst
