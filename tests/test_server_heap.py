"""GC pause metrics and the start-up heap freeze (`boundgen.server.heap`)."""

from __future__ import annotations

import gc

from prometheus_client import generate_latest

from boundgen.server.heap import GCPauses, freeze_startup_heap
from boundgen.server.metrics import Metrics


def _value(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_gc_pauses_are_counted_per_generation_once_per_process():
    a, b = Metrics(), Metrics()  # two apps in one process: one hook
    assert GCPauses.install() is GCPauses.install()
    assert sum(cb == GCPauses.install()._callback for cb in gc.callbacks) == 1
    before = _value(generate_latest(a.registry).decode(), 'boundgen_gc_pause_seconds_count{generation="2"}')
    gc.collect()
    text = generate_latest(b.registry).decode()
    assert _value(text, 'boundgen_gc_pause_seconds_count{generation="2"}') == before + 1
    assert _value(text, 'boundgen_gc_pause_max_seconds{generation="2"}') > 0


def test_freeze_moves_startup_objects_out_of_collections():
    try:
        info = freeze_startup_heap()
        assert info["frozen_objects"] == gc.get_freeze_count() > 1000
        cycle = []
        cycle.append(cycle)  # made after the freeze: still collected
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
