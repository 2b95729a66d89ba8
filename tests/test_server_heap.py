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


_EXIT_SCRIPT = """
from boundgen.server.heap import freeze_startup_heap

class Noisy:
    def __del__(self):
        print("freed", flush=True)

holder = Noisy()
holder.self = holder  # a cycle alive at the freeze, garbage once the module lets it go
freeze_startup_heap()
freeze_startup_heap()  # the warm-up's second freeze
"""


def test_a_frozen_heap_is_freed_at_exit():
    """The heap is unfrozen at exit, so the interpreter's last collection frees the cycles that
    were alive at the freeze (frozen, they outlived it: Triton's nanobind then printed hundreds
    of "leaked" lines on every stop of `boundgen serve`)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("freed") == 1, (done.stdout, done.stderr)
