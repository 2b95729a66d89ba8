"""Every compile in this process, counted: what a server checks stays at zero once it is ready.

A compile on the request path is the worst tail a user meets (issue 23: a merged beam search of
a new shape compiled inside a request for 5.9 s). Two things compile after start-up if a shape
was missed: `torch.compile` (dynamo, any function: the beam search's layers, the `compile`
backend's buckets) and a new whole-search CUDA graph (`SearchGraphs`: capture, plus the compile
of its layers when the shape is new to them). Both report here:

    COMPILES.record(kind, detail)   one compile or capture (thread-safe); listeners are called
    COMPILES.total()                how many so far (a server keeps the count at readiness)
    COMPILES.listen(fn)             fn(kind, detail) on every later one (the server warns)

`watch_dynamo()` hooks dynamo's compile-start callback once per process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("boundgen.compile")

TORCH_COMPILE = "torch.compile"
BEAM_GRAPH = "beam-graph"


class CompileEvents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._listeners: list[Callable[[str, str], None]] = []

    def record(self, kind: str, detail: str = "") -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(kind, detail)
            except Exception:  # a listener must never break a compile
                log.exception("compile listener failed")

    def total(self, kind: str | None = None) -> int:
        with self._lock:
            return self._counts.get(kind, 0) if kind else sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def listen(self, fn: Callable[[str, str], None]) -> Callable[[], None]:
        """Call `fn(kind, detail)` on every compile from now on; returns the unsubscribe."""
        with self._lock:
            self._listeners.append(fn)

        def stop() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return stop


COMPILES = CompileEvents()
_watching = threading.Lock()
_watched = False


def watch_dynamo() -> None:
    """Count every dynamo compile of this process in `COMPILES` (idempotent)."""
    global _watched
    with _watching:
        if _watched:
            return
        try:
            from torch._dynamo.callback import on_compile_start
        except ImportError:  # pragma: no cover - a torch without the callback
            return

        @on_compile_start
        def _started(*_args, **_kwargs) -> None:
            COMPILES.record(TORCH_COMPILE, "dynamo")

        _watched = True
