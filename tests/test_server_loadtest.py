"""`boundgen loadtest` against a real uvicorn server in a thread, its statistics, and the HF
baseline server's parity with the engine through the same HTTP API."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
import uvicorn
from fastapi.testclient import TestClient

from boundgen import Engine, cli
from boundgen.loadtest import (
    LoadConfig,
    Sample,
    arrival_times,
    fit_to_server,
    parse_server_timing,
    run_loadtest,
    slowest_line,
    summarize,
)
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.testing import free_port, slow_engine, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("lt"))


def test_arrivals_and_summary():
    cfg = LoadConfig(arrivals="uniform")
    assert arrival_times(cfg, 10, 2) == [i / 10 for i in range(20)]
    poisson = arrival_times(LoadConfig(), 200, 5)
    assert 800 < len(poisson) < 1200 and all(0 <= t < 5 for t in poisson)
    samples = [Sample("score", i / 100, (i + 1) / 1000, 200) for i in range(99)]
    samples.append(Sample("score", 0.99, 0.5, 429, "overloaded_error"))
    s = summarize(samples, qps=100, duration=1.0, items=10)
    assert s["ok"] == 99 and s["errors"] == {"429:overloaded_error": 1}
    assert s["latency_ms"]["p50"] == pytest.approx(50.0) and s["latency_ms"][
        "max"
    ] == pytest.approx(99)
    assert s["error_rate"] == pytest.approx(0.01)
    assert math.isnan(summarize([], 1, 1, 1)["latency_ms"]["p99"])


def test_default_shapes_fit_the_served_model():
    card = {"max_model_len": 256, "trie_depths": {"catalog": 3}}
    fitted, notes = fit_to_server(LoadConfig(trie="catalog"), card)
    assert (fitted.query_tokens, fitted.prompt_tokens, fitted.steps) == (240, 128, 3)
    assert notes == [
        "steps 4 -> 3: the depth of trie 'catalog'",
        "query_tokens 256 -> 240: to fit the served model's 256-token context",
    ]
    given = LoadConfig(query_tokens=300, steps=5, trie="catalog")  # explicit: kept as given
    assert fit_to_server(given, card)[0] == given
    assert fit_to_server(LoadConfig(), {})[0] == LoadConfig()  # a server without a card
    small = fit_to_server(LoadConfig(), {"max_model_len": 100})[0]
    assert (small.query_tokens, small.prompt_tokens) == (84, 96)


def test_server_timing_parse_and_tail_attribution():
    assert parse_server_timing(
        'app;dur=12.5, forward;desc="model";dur=9, cache, forward;dur=1'
    ) == {"app": 12.5, "forward": 10.0}
    assert parse_server_timing(None) is None and parse_server_timing("app;dur=x, miss") is None
    # 200 answers: server time 1 ms each, except the two slowest (server-side 40 ms in "forward")
    samples = [
        Sample("score", i / 100, 0.002, 200, server={"app": 1.0, "forward": 0.5})
        for i in range(198)
    ]
    samples += [
        Sample("score", 1.0, 0.050, 200, server={"app": 41.0, "forward": 40.0}),
        Sample("score", 1.1, 0.060, 200, server={"app": 41.0, "forward-wait": 2.0}),
    ]
    samples.append(Sample("score", 1.2, 9.0, 504, "timeout_error", server={"app": 9000.0}))
    s = summarize(samples, qps=200, duration=1.0, items=1)
    assert s["server_ms"]["p50"] == pytest.approx(1.0) and s["server_ms"]["p99"] > 1.0
    tail = s["slowest"]
    assert tail["n"] == 2 and tail["latency_ms"] == pytest.approx(55.0)
    assert tail["server_ms"] == pytest.approx(41.0) and tail["outside_ms"] == pytest.approx(14.0)
    assert tail["entries_ms"] == {
        "forward": pytest.approx(20.0),
        "forward-wait": pytest.approx(1.0),
    }
    assert "slowest" not in summarize(
        [Sample("score", 0, 0.001, 200)], 1, 1, 1
    )  # no header: no guess
    # on the console: the largest entries first
    assert slowest_line(tail) == (
        "  slowest 1 % (2 requests): 55.00 ms = server 41.00 ms (forward 20.00, forward-wait 1.00)"
        " + outside the server 14.00 ms"
    )


class _ThreadServer:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_loadtest_against_live_server(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, device="cpu")
    with _ThreadServer(create_app(engine)) as srv:
        cfg = LoadConfig(
            url=srv.url,
            workload="mixed",
            qps_steps=(4.0, 8.0),
            duration=1.5,
            warmup=2,
            items=4,
            item_tokens=4,
            query_tokens=8,
            prompt_tokens=8,
            beam_width=2,
            steps=2,
            slo_ms=10_000,
            distinct=4,
            out=str(tmp_path / "r.json"),
            plot=str(tmp_path / "r.png"),
        )
        lines = []
        report = run_loadtest(cfg, log=lines.append)
    # the console: every step with the slowest requests' breakdown, and never a bare None
    assert sum(line.startswith("  slowest 1 % (") for line in lines) == 2, lines
    assert not any("None" in line for line in lines), lines
    assert report["vocab_size"] == engine.config.vocab_size
    assert [s["qps_target"] for s in report["steps"]] == [4.0, 8.0]
    assert all(s["ok"] == s["requests"] > 0 for s in report["steps"]), report["steps"]
    assert report["max_qps_within_slo"] == 8.0
    step = json.loads((tmp_path / "r.json").read_text())["steps"][0]
    assert step["latency_ms"]["p99"] > 0
    # the server's Server-Timing came back with every answer: handler time ≤ what the client saw
    assert 0 < step["server_ms"]["p50"] <= step["latency_ms"]["p50"]
    assert "runtime" in step["slowest"]["entries_ms"]  # served through the DAG runtime
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_hf_baseline_server_matches_engine(model_dir):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from baseline_hf_server import hf_engine
    finally:
        sys.path.pop(0)
    engine = Engine.from_pretrained(model_dir, device="cpu", dtype="float32")
    hf = create_app(hf_engine(model_dir, "cpu", "float32"), ServerConfig(warmup="off"))
    with TestClient(hf) as c:
        for body in (
            {
                "query": "the user likes",
                "items": [" red shoes", " a blue hat and more"],
                "label_token_ids": [3, 7, 11],
            },
            {
                "query": [1, 2, 3],
                "items": [[4], [5, 6, 7, 8]],
                "label_token_ids": [9, 10],
                "item_first": True,
                "apply_softmax": True,
            },
        ):
            r = c.post("/v1/score", json=body)
            assert r.status_code == 200, r.text
            want = engine.score(
                body["query"],
                body["items"],
                body["label_token_ids"],
                apply_softmax=body.get("apply_softmax", False),
                item_first=body.get("item_first", False),
            )
            np.testing.assert_allclose(r.json()["scores"], want, rtol=1e-4, atol=1e-5)
        r = c.post("/v1/beam", json={"prompt": "x", "beam_width": 2, "steps": 1})
        assert r.status_code == 400 and "/v1/score" in r.json()["error"]["message"]


def test_loadtest_stops_at_saturation(model_dir):
    engine = slow_engine(Engine.from_pretrained(model_dir, device="cpu"), 0.25)
    app = create_app(engine, ServerConfig(max_queue=4))
    lines = []
    with _ThreadServer(app) as srv:
        cfg = LoadConfig(
            url=srv.url,
            workload="score",
            qps_steps=(40.0, 80.0),
            duration=1.0,
            warmup=1,
            items=2,
            item_tokens=2,
            query_tokens=4,
            distinct=2,
        )
        report = run_loadtest(cfg, log=lines.append)
    assert [s["qps_target"] for s in report["steps"]] == [40.0]
    step = report["steps"][0]
    assert step["errors"].get("429:overloaded_error", 0) > 0 and step["ok"] > 0
    assert report["max_qps_within_slo"] is None
    assert any("saturated at 40" in line for line in lines), lines
    assert not any("None" in line for line in lines), lines


# ---- the command line: errors in one line, defaults in --help


def test_loadtest_without_a_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["loadtest", "--url", url, "--duration", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"boundgen loadtest: error: no answer from {url} (ConnectError")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_loadtest_url_without_scheme_is_one_line(capsys):
    assert cli.main(["loadtest", "--url", "127.0.0.1:8000"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "boundgen loadtest: error: --url '127.0.0.1:8000' needs its scheme: "
        "e.g. http://127.0.0.1:8000\n"
    )


def test_loadtest_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["loadtest", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    shown_defaults = ("20.0", "http://127.0.0.1:8000", "score", "on")  # --slo-ms ... a flag pair
    for shown in (f"(default: {value})" for value in shown_defaults):
        assert shown in out
    assert "(default: None)" not in out
