"""GC pause metrics and the start-up heap freeze (`boundgen.server.heap`)."""

from __future__ import annotations

import gc
import weakref

import pytest

pytest.importorskip("prometheus_client")  # server-only: skipped without the server's packages
from prometheus_client import generate_latest

from boundgen.server.heap import FULL_COLLECTION_EVERY, GCPauses, freeze_startup_heap
from boundgen.server.metrics import Metrics


def _value(text: str, name: str) -> float:
    return next(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
    )


def test_gc_pauses_are_counted_per_generation_once_per_process():
    a, b = Metrics(), Metrics()  # two apps in one process: one hook
    assert GCPauses.install() is GCPauses.install()
    assert sum(cb == GCPauses.install()._callback for cb in gc.callbacks) == 1
    before = _value(
        generate_latest(a.registry).decode(), 'boundgen_gc_pause_seconds_count{generation="2"}'
    )
    gc.collect()
    text = generate_latest(b.registry).decode()
    assert _value(text, 'boundgen_gc_pause_seconds_count{generation="2"}') == before + 1
    assert _value(text, 'boundgen_gc_pause_max_seconds{generation="2"}') > 0


class _Node:
    """A weak-referenceable object to build reference cycles from."""


def test_freeze_moves_startup_objects_out_of_collections():
    survivor = _Node()
    survivor.self = survivor  # a cycle alive at start-up: frozen with the rest of the heap
    watch = weakref.ref(survivor)
    thresholds = gc.get_threshold()
    try:
        info = freeze_startup_heap()
        assert gc.get_threshold()[2] == FULL_COLLECTION_EVERY
        # Other threads may free frozen objects meanwhile, so the live count can only have dropped.
        assert info["frozen_objects"] > 1000 and gc.get_freeze_count() <= info["frozen_objects"]
        del survivor
        gc.collect()
        assert watch() is not None  # frozen: full collections skip it
        later = _Node()
        later.self = later  # made after the freeze: still collected
        watch_later = weakref.ref(later)
        del later
        gc.collect()
        assert watch_later() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    gc.collect()
    assert watch() is None  # unfrozen garbage is collected again
