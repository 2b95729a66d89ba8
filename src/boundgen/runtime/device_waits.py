"""Waiting for the device on one thread, so that the CPU workers never do.

A CPU node that reads what a device node produced (a score request's `finish`, which turns its
label scores into lists) has to wait until the device has run that work. Done on a CPU worker,
every such request held a worker for the rest of its batch's GPU time: with merged forwards of
~10–30 ms and 8 workers, the requests that had to be prepared for the next batch queued behind the
ones waiting for the last (a CPU server with a simulated GPU reached 232 req/s at 16 connections
with 4 workers, 288 with 16: BENCHMARKS.md, 2026-12-02 third session). `DeviceWaits` takes such a
node's unfinished events and a continuation, waits for the events on its own thread and then runs
the continuation — the executor's, which hands the node back to the worker pool.

The waits are taken in the order given: a CUDA event wait cannot time out, and polling would cost
the GIL. Work on one stream ends in order, and a request's device work is queued after the work
of the requests before it, so a later wait is rarely ready before an earlier one; when it is, it
runs once the earlier one's device work has ended.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("boundgen.runtime")


class DeviceWaits:
    """`after(events, then)`: `then()` once every event has completed (`synchronize()`), on this
    object's thread; `close()` stops it after the waits already given."""

    def __init__(self, name: str = "boundgen-device-waits") -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def after(self, events: Sequence[Any], then: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("device waits are closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put((events, then))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            events, then = item
            try:
                for ev in events:
                    ev.synchronize()
            except Exception:  # a failed device still ends its requests: `then` reports it
                log.exception("waiting for device work failed")
            try:
                then()
            except Exception:  # never lose the thread: the other waits still need it
                log.exception("continuation after device work failed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5)
