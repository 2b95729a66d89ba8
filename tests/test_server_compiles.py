"""Nothing compiles on a request's path once the server is ready: under mixed traffic (scores,
embeddings, beam searches of several widths and prompt lengths, merged by the batching node into
several sizes, with and without a trie) `boundgen_compiles_after_ready_total` stays 0. The fake
compile hook: on the CPU the runner gets whole-search buckets without CUDA graphs, whose first use
per shape is reported like a capture (`compile.events`), so a shape the warm-up missed would
count."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="the server extra is not installed")
from fastapi.testclient import TestClient

from boundgen import Trie
from boundgen.compile.backends import CompiledForwards
from boundgen.compile.decode import SearchGraphs
from boundgen.runner import ModelRunner
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig

LOCAL = "http://localhost"
PROMPT_TOKENS = 12
TRIE = Trie.from_sequences([[11, 12, 13], [11, 14, 15], [16, 17, 18], [16, 12, 19]])


def with_search_buckets(engine):
    """`engine` whose runner makes whole-search buckets (CPU: without graphs)."""
    model = engine.model
    search = SearchGraphs(model, torch.device("cpu"), model.backend, use_graphs=False)
    runner = ModelRunner(model, engine.device, CompiledForwards("eager", [], {}, False, search))
    return engine.with_runner(runner)


def after_ready(state) -> dict[str, float]:
    metric = state.metrics.compiles_after_ready
    return {kind: metric.labels(kind)._value.get() for kind in ("torch.compile", "beam-graph")}


def wait_ready(client, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while client.get("/health").status_code != 200:
        assert time.monotonic() < end, "not ready"
        time.sleep(0.02)


def prompt(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(20, 200, (n,), generator=rng).tolist()


@pytest.fixture
def served(engine_for, tmp_path):
    engine = with_search_buckets(engine_for("qwen2"))
    profile = [
        {"kind": "score", "query_tokens": 16, "items": 4, "item_tokens": 4},
        {"kind": "embed", "texts": [16]},
        {"kind": "beam", "prompt_tokens": PROMPT_TOKENS, "width": 2, "steps": 2, "count": 4},
        {"kind": "beam", "prompt_tokens": PROMPT_TOKENS, "width": 3, "trie": "items", "count": 2},
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    config = ServerConfig(warmup=str(path), max_queue_ms=60_000)
    app = create_app(engine, config, tries={"items": TRIE})
    yield app
    engine.close()


def test_mixed_traffic_compiles_nothing_after_ready(served):
    state = served.state.boundgen
    graphs = state.engine.runner.forwards.search
    rng = torch.Generator().manual_seed(0)
    requests = []
    for i in range(48):
        n = [3, PROMPT_TOKENS, 7, 1][i % 4]
        if i % 3 == 0:
            body = {"prompt": prompt(rng, n), "beam_width": 2, "steps": 2}
            requests.append(("/v1/beam", body))
        elif i % 3 == 1:
            body = {"prompt": prompt(rng, n), "beam_width": 3, "steps": 3, "trie": "items"}
            requests.append(("/v1/beam", body))
        else:
            items = [prompt(rng, 4) for _ in range(1 + i % 5)]
            body = {"query": prompt(rng, 16), "items": items, "label_token_ids": [5, 6]}
            requests.append(("/v1/score", body))
    with TestClient(served, base_url=LOCAL) as client:
        wait_ready(client)
        made = len(graphs.slots)
        assert graphs.sealed and made == 3 + 2  # batch sizes 1, 2, 4 (W2) and 1, 2 (W3, trie)
        statuses: list[int] = []

        def send(chunk) -> None:
            for route, body in chunk:
                statuses.append(client.post(route, json=body).status_code)

        # 8 concurrent clients: the batching node merges beam requests into searches of
        # 1 … 8 prompts, more than any bucket takes (cut into the made ones)
        threads = [threading.Thread(target=send, args=(requests[k::8],)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = client.get("/metrics").text
    assert statuses == [200] * len(requests)
    assert after_ready(state) == {"torch.compile": 0, "beam-graph": 0}
    assert "boundgen_compiles_after_ready_total" not in metrics or all(
        line.endswith(" 0.0")
        for line in metrics.splitlines()
        if line.startswith("boundgen_compiles_after_ready_total")
    )
    assert len(graphs.slots) == made and graphs.misses == 0 and graphs.searches > 0


def test_a_shape_the_warm_up_missed_runs_plain_and_compiles_nothing(served):
    state = served.state.boundgen
    graphs = state.engine.runner.forwards.search
    with TestClient(served, base_url=LOCAL) as client:
        wait_ready(client)
        r = client.post("/v1/beam", json={"prompt": [30, 31, 32], "beam_width": 5, "steps": 2})
        assert r.status_code == 200
        assert "boundgen_beam_graph_misses_total 1.0" in client.get("/metrics").text
    assert graphs.misses == 1
    assert after_ready(state) == {"torch.compile": 0, "beam-graph": 0}


def test_without_a_warm_up_the_metric_moves_and_warns(engine_for, caplog):
    """The counter can move: a server told not to warm up makes its first search's bucket on the
    request's path, and says so."""
    engine = with_search_buckets(engine_for("qwen2"))
    app = create_app(engine, ServerConfig(warmup="off"))
    try:
        with TestClient(app, base_url=LOCAL) as client, caplog.at_level(logging.WARNING):
            wait_ready(client)
            r = client.post("/v1/beam", json={"prompt": [30, 31, 32], "beam_width": 2, "steps": 2})
            assert r.status_code == 200
        assert after_ready(app.state.boundgen)["beam-graph"] == 1
        assert any("after the server said ready" in m for m in caplog.messages)
    finally:
        engine.close()
