"""CPU time per Python thread (`server/threads.py`, `boundgen_thread_cpu_seconds{thread}`)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from boundgen.server.threads import thread_cpu_seconds

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")


def _run(name: str, target) -> dict[str, float]:
    """CPU seconds per thread, read while a thread `name` runs `target` (after 0.3 s of it)."""
    stop = threading.Event()
    th = threading.Thread(target=target, args=(stop,), name=name)
    th.start()
    try:
        time.sleep(0.3)
        return thread_cpu_seconds()
    finally:
        stop.set()
        th.join()


def test_a_busy_thread_has_cpu_time_a_sleeping_one_has_none():
    def burn(stop):
        while not stop.is_set():
            sum(range(1000))

    busy = _run("test-burner", burn)
    idle = _run("test-sleeper", lambda stop: stop.wait())
    # the burner holds the GIL about half the time against the main thread's sleeps: well above
    # the sleeper, whose CPU time is the thread's start-up
    assert busy["test-burner"] >= 0.05
    assert idle["test-sleeper"] <= 0.02
    assert {"MainThread", "other"} <= busy.keys()


def test_the_metric_is_on_the_metrics_page(engine_for):
    from fastapi.testclient import TestClient

    from boundgen.server.app import create_app
    from boundgen.server.config import ServerConfig

    page = TestClient(create_app(engine_for(), ServerConfig()), base_url="http://localhost")
    text = page.get("/metrics").text
    assert 'boundgen_thread_cpu_seconds_total{thread="MainThread"}' in text
    assert 'boundgen_thread_cpu_seconds_total{thread="other"}' in text
