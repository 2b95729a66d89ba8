"""`/metrics` beyond the per-endpoint counters: the compiled buckets' use (hit rate and padding),
admission's predicted wait and budget, and sheds by reason."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")  # server-only: skipped, not a collection error, without the server
from fastapi.testclient import TestClient

from boundgen.compile.backends import CompiledForwards, _eager_fns
from boundgen.compile.buckets import parse_buckets
from boundgen.runner import ModelRunner
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.errors import Overloaded

LOCAL = "http://localhost"
BUCKETS = "t64-s4-m64,t256-s8-m128"


def metric(text: str, name: str, labels: str = "") -> float | None:
    """The value of `name{labels}` in a Prometheus text page (None when absent)."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.fixture(scope="module")
def bucketed(engine_for):
    """The tiny engine through two bucket-shaped forwards (the plain model per bucket: what a
    compiled backend looks like to the runner, without a compile)."""
    engine = engine_for()
    buckets = parse_buckets(BUCKETS, engine.engine_config.max_batch_tokens)
    forwards = CompiledForwards("eager-buckets", buckets, _eager_fns(engine.model, buckets), True)
    runner = ModelRunner(engine.model, engine.device, forwards, share_prefix=False)
    return engine.with_runner(runner)


def test_bucket_batches_misses_and_padding(bucketed):
    client = TestClient(create_app(bucketed, ServerConfig()), base_url=LOCAL)
    body = {"query": [11] * 10, "items": [[12] * 5, [13] * 7], "label_token_ids": [1, 2]}
    assert client.post("/v1/score", json=body).status_code == 200
    page = client.get("/metrics").text
    assert metric(page, "boundgen_model_backend", 'backend="eager-buckets"') == 1.0
    assert metric(page, "boundgen_bucket_batches_total", 'bucket="t64-s4-m64"') == 1.0
    assert metric(page, "boundgen_bucket_batches_total", 'bucket="t256-s8-m128"') == 0.0
    assert metric(page, "boundgen_bucket_misses_total") == 0.0
    assert metric(page, "boundgen_bucket_real_tokens_total") == 10 + 5 + 10 + 7  # no sharing
    assert metric(page, "boundgen_bucket_padded_tokens_total") == 64


def test_forward_host_time_by_part(bucketed):
    """`boundgen_runner_host_seconds_total{part}`: where the forwards' host time went (a bucketed
    forward packs, stages and launches; nothing else moves it), its CPU part
    (`boundgen_runner_host_cpu_seconds_total`) and the pieces run."""
    client = TestClient(create_app(bucketed, ServerConfig()), base_url=LOCAL)
    before = client.get("/metrics").text
    parts = ("pack", "stage", "launch")
    was = {p: metric(before, "boundgen_runner_host_seconds_total", f'part="{p}"') for p in parts}
    pieces = metric(before, "boundgen_runner_pieces_total")
    body = {"query": [11] * 10, "items": [[12] * 5, [13] * 7], "label_token_ids": [1, 2]}
    assert client.post("/v1/score", json=body).status_code == 200
    page = client.get("/metrics").text
    for p in parts:
        wall = metric(page, "boundgen_runner_host_seconds_total", f'part="{p}"')
        assert wall > was[p]
        # the same parts' CPU time on their thread: some, and never above the wall time
        cpu = metric(page, "boundgen_runner_host_cpu_seconds_total", f'part="{p}"')
        assert 0 < cpu <= wall
    assert metric(page, "boundgen_runner_pieces_total") == pieces + 1


def test_host_cpu_time_never_counts_above_its_wall_time(bucketed):
    """Two clocks read one after the other can show a span with more CPU than wall time (CI saw
    41.653 against 41.633 us); the runner counts at most the wall time."""
    runner = bucketed.runner
    before = runner.stats()
    runner._spent("pack", (1_000, 5_000), (41_633 + 1_000, 41_653 + 5_000))
    after = runner.stats()
    wall = after["host_seconds"]["pack"] - before["host_seconds"]["pack"]
    cpu = after["host_cpu_seconds"]["pack"] - before["host_cpu_seconds"]["pack"]
    assert wall == pytest.approx(41_633e-9) and cpu == pytest.approx(wall)
    runner._spent("pack", (0, 0), (1_000, 400))  # a thread that waited: its CPU as read
    assert runner.stats()["host_cpu_seconds"]["pack"] - after["host_cpu_seconds"]["pack"] == (
        pytest.approx(400e-9)
    )


def test_an_eager_runner_has_no_bucket_series(engine_for):
    page = TestClient(create_app(engine_for(), ServerConfig()), base_url=LOCAL).get("/metrics")
    assert metric(page.text, "boundgen_model_backend", 'backend="eager"') == 1.0
    assert "boundgen_bucket_batches_total{" not in page.text


def test_device_time_series_per_batching_node(engine_for):
    """`boundgen_runtime_device_seconds_total` and `boundgen_runtime_paced_wait_seconds_total` per
    batching node: 0 on CPU (no device queue); `boundgen_runtime_launch_seconds_total`, the host
    time of forming and launching the batches."""
    engine = engine_for()
    client = TestClient(create_app(engine, ServerConfig()), base_url=LOCAL)
    body = {"query": [1, 2, 3], "items": [[4, 5], [6]], "label_token_ids": [1, 2]}
    assert client.post("/v1/score", json=body).status_code == 200
    page = client.get("/metrics").text
    assert metric(page, "boundgen_runtime_device_seconds_total", 'node="forward"') == 0.0
    assert metric(page, "boundgen_runtime_paced_wait_seconds_total", 'node="forward"') == 0.0
    assert metric(page, "boundgen_runtime_batches_total", 'node="forward"') >= 1.0
    # on CPU the call is the batch: its launch time is the forward's host time, above 0
    assert metric(page, "boundgen_runtime_launch_seconds_total", 'node="forward"') > 0.0
    # the tail merge plan's cuts and the cost model's fit, as the node has them (0 while cold)
    node = engine.runtime.stats()["batching"]["forward"]
    cost, warm = node["cost"], node["cost"]["warm"]
    assert metric(page, "boundgen_runtime_planned_cuts_total", 'node="forward"') == float(
        node["planned_cuts"]
    )
    fixed = metric(page, "boundgen_runtime_cost_fixed_seconds", 'node="forward"')
    per_unit = metric(page, "boundgen_runtime_cost_per_unit_seconds", 'node="forward"')
    assert fixed == pytest.approx(cost["fixed_ms"] / 1e3 if warm else 0.0)
    assert per_unit == pytest.approx(cost["per_unit_us"] / 1e6 if warm else 0.0)


def test_the_cost_fit_series_read_zero_until_the_model_is_warm(engine_for, monkeypatch):
    """A cold cost model's fit (a first batch or two) predicts nothing: the gauges read 0 until
    it is warm, then its fit."""
    engine = engine_for()
    client = TestClient(create_app(engine, ServerConfig()), base_url=LOCAL)
    node = engine.runtime.context.forward
    monkeypatch.setattr(node.cost, "_fit", (2_000_000.0, 3_000.0))
    monkeypatch.setattr(type(node.cost), "warm", property(lambda self: False))
    page = client.get("/metrics").text
    assert metric(page, "boundgen_runtime_cost_fixed_seconds", 'node="forward"') == 0.0
    monkeypatch.setattr(type(node.cost), "warm", property(lambda self: True))
    page = client.get("/metrics").text
    assert metric(page, "boundgen_runtime_cost_fixed_seconds", 'node="forward"') == 0.002
    assert metric(page, "boundgen_runtime_cost_per_unit_seconds", 'node="forward"') == 3e-06


def test_admission_gauges_and_shed_reasons(engine_for):
    app = create_app(engine_for(), ServerConfig(max_queue=1, max_queue_ms=50))
    client = TestClient(app, base_url=LOCAL)
    page = client.get("/metrics").text
    assert metric(page, "boundgen_predicted_wait_seconds") == 0.0
    assert metric(page, "boundgen_queue_budget_seconds") == 0.05
    infer = app.state.boundgen.infer
    infer._admitted = 1  # as if one request were being served
    try:
        with pytest.raises(Overloaded):
            infer.check_load()
    finally:
        infer._admitted = 0
    page = client.get("/metrics").text
    assert metric(page, "boundgen_shed_total", 'reason="capacity"') == 1.0
