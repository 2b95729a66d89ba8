"""`server/loop_lag.py`: the event-loop lag probe sees a loop held up, and a running server
exports it in `/metrics`."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")  # server-only: skipped, not a collection error, without the server
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge, Histogram
from test_server_metrics import LOCAL, metric

from boundgen.server import loop_lag
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig


def test_a_loop_held_up_shows_as_lag():
    registry = CollectorRegistry()
    hist = Histogram("lag_seconds", "", buckets=loop_lag.LAG_BUCKETS, registry=registry)
    worst = Gauge("lag_max_seconds", "", registry=registry)

    async def main():
        task = asyncio.create_task(loop_lag.probe(hist, worst, interval_s=0.01))
        await asyncio.sleep(0.03)  # a few wake-ups on time
        time.sleep(0.1)  # the loop held: the probe's timer, due within 10 ms, wakes ~90 ms late
        await asyncio.sleep(0.03)
        task.cancel()

    asyncio.run(main())
    assert registry.get_sample_value("lag_max_seconds") >= 0.08
    late = registry.get_sample_value("lag_seconds_count") - registry.get_sample_value(
        "lag_seconds_bucket", {"le": "0.05"}
    )
    assert late >= 1
    assert registry.get_sample_value("lag_seconds_count") >= 3


def test_a_server_exports_its_loop_lag(engine_for):
    with TestClient(create_app(engine_for(), ServerConfig()), base_url=LOCAL) as client:
        deadline = time.monotonic() + 10
        while True:  # the probe wakes every 10 ms once the app has started
            page = client.get("/metrics").text
            count = metric(page, "boundgen_event_loop_lag_seconds_count")
            if count or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert count and count >= 1
    assert metric(page, "boundgen_event_loop_lag_max_seconds") is not None
