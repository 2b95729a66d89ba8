"""HTTP API through TestClient on a tiny synthetic checkpoint: every endpoint, parity with the
engine, response snapshots (tests/snapshots/*.json, floats rounded), limits, auth, overload (429),
deadlines (504).

Refresh snapshots with `BOUNDGEN_UPDATE_SNAPSHOTS=1 pytest tests/test_server.py`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from boundgen import Engine, Trie
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig, load_settings
from boundgen.server.testing import slow_engine, tiny_model_dir

SNAPSHOTS = Path(__file__).parent / "snapshots"
MODEL = "tiny-server-test"
TRIE_SEQS = [[5, 6, 7], [5, 6, 8], [5, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def trie_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tries") / "catalog.jsonl"
    Trie.from_sequences(TRIE_SEQS, item_ids=[100, 101, 102, 103]).save(path)
    return path


@pytest.fixture(scope="module")
def client(engine, trie_path):
    app = create_app(
        engine,
        ServerConfig(
            tries=(f"catalog={trie_path}",),
            max_body_bytes=1 << 16,
            max_item_tokens=64,
        ),
    )
    with TestClient(app) as c:
        wait_ready(c)  # the warm-up (a score, an embed, a beam per trie) runs at start-up
        yield c


def wait_ready(client, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while client.get("/health").status_code != 200:
        assert time.monotonic() < end, client.get("/health").text
        time.sleep(0.01)


def rounded(obj, digits=3):
    """Floats rounded; volatile fields (`created` anywhere) dropped."""
    if isinstance(obj, float):
        return round(obj, digits) + 0.0
    if isinstance(obj, list):
        return [rounded(x, digits) for x in obj]
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items() if k != "created"}
    return obj


def check_snapshot(name: str, body: dict, drop=("id",)) -> None:
    body = rounded({k: v for k, v in body.items() if k not in drop})
    path = SNAPSHOTS / f"{name}.json"
    if os.environ.get("BOUNDGEN_UPDATE_SNAPSHOTS") or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    assert body == json.loads(path.read_text()), f"response differs from snapshot {path}"


def error_of(resp, status):
    """The error object: nested under "error" (OpenAI's, vLLM's), or SGLang's flat one."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    if body.get("object") == "error":
        assert set(body) == {"object", "message", "type", "param", "code"} and body["message"]
        assert body["code"] == status
        return body
    err = body["error"]
    assert set(err) == {"message", "type", "code"} and err["message"]
    return err


# ------------------------------------------------------------------------------------ /v1/score


def test_score_text_matches_engine(client, engine):
    body = {
        "query": "the user likes",
        "items": [" red shoes", " a blue hat"],
        "label_token_ids": [3, 7, 11],
        "apply_softmax": True,
        "model": MODEL,
    }
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and out["model"] == MODEL
    want = engine.score(
        "the user likes", [" red shoes", " a blue hat"], [3, 7, 11], apply_softmax=True
    )
    np.testing.assert_allclose(out["scores"], want, rtol=1e-5, atol=1e-6)
    assert all(math.isclose(sum(row), 1.0, rel_tol=1e-5) for row in out["scores"])
    assert out["usage"]["prompt_tokens"] > 0
    check_snapshot("score", out)


def test_score_token_ids_item_first_and_single_item(client, engine):
    r = client.post(
        "/v1/score",
        json={
            "query": [1, 2, 3],
            "items": [[4, 5], [6]],
            "label_token_ids": [9, 10],
            "item_first": True,
        },
    )
    assert r.status_code == 200, r.text
    want = engine.score([1, 2, 3], [[4, 5], [6]], [9, 10], item_first=True)
    np.testing.assert_allclose(r.json()["scores"], want, rtol=1e-5, atol=1e-5)
    r = client.post("/v1/score", json={"query": "q", "items": "one item", "label_token_ids": [9]})
    assert r.status_code == 200 and len(r.json()["scores"]) == 1


def test_score_bad_inputs(client):
    base = {"query": "q", "items": ["a"], "label_token_ids": [1]}
    msg = error_of(client.post("/v1/score", json={**base, "label_token_ids": [10**9]}), 400)[
        "message"
    ]
    assert msg == "label_token_ids: Token ID 1000000000 is out of vocabulary range [0, 2048)"
    assert (
        "field required" in error_of(client.post("/v1/score", json={"query": "q"}), 400)["message"]
    )
    # SGLang: no items, no scores (and no model call)
    assert client.post("/v1/score", json={**base, "items": []}).json()["scores"] == []
    assert (
        "both be text"
        in error_of(client.post("/v1/score", json={**base, "items": [[1]]}), 400)["message"]
    )
    err = error_of(client.post("/v1/score", json={**base, "items": ["word " * 200]}), 413)
    assert err["type"] == "request_too_large" and "max_item_tokens" in err["message"]
    err = error_of(
        client.post(
            "/v1/score", content=b"x" * (1 << 17), headers={"content-type": "application/json"}
        ),
        413,
    )
    assert "max_body_bytes" in err["message"]
    broken = client.post("/v1/score", content=b"{", headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(broken, 400)["message"]
    check_snapshot("error_400", client.post("/v1/score", json={"query": "q"}).json())


# ----------------------------------------------------------------------------- rerank, classify


def test_rerank_cohere_shape(client, engine):
    docs = ["green apples", "a fast car", "fresh green salad"]
    r = client.post(
        "/v1/rerank", json={"model": MODEL, "query": "healthy food", "documents": docs, "top_n": 2}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    labels = client.get("/v1/models").json()["data"][0]["rerank_label_token_ids"]
    want = [row[0] for row in engine.score("healthy food", docs, labels, apply_softmax=True)]
    assert [x["index"] for x in out["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
    for res in out["results"]:
        assert res["relevance_score"] == pytest.approx(want[res["index"]], rel=1e-5)
        assert res["document"]["text"] == docs[res["index"]]
    check_snapshot("rerank", out)
    # Cohere v2 path and {"text": ...} documents
    r2 = client.post(
        "/v2/rerank",
        json={
            "model": MODEL,
            "query": "healthy food",
            "documents": [{"text": d} for d in docs],
            "return_documents": False,
        },
    )
    assert [x["index"] for x in r2.json()["results"]][:2] == [x["index"] for x in out["results"]]
    assert "document" not in r2.json()["results"][0]


def test_classify(tmp_path_factory):
    cls_dir = tiny_model_dir(tmp_path_factory.mktemp("cls"), seq_cls=3)
    engine = Engine.from_pretrained(cls_dir, device="cpu", dtype="float32")
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/classify", json={"model": "m", "input": ["good product", "bad"]})
        assert r.status_code == 200, r.text
        out = r.json()
        logits = np.array(engine.classify(["good product", "bad"]))
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        np.testing.assert_allclose([d["probs"] for d in out["data"]], probs, rtol=1e-5)
        assert out["data"][0]["label"] == f"LABEL_{int(probs[0].argmax())}"
        assert out["data"][0]["num_classes"] == 3
        check_snapshot("classify", out)
        infer = {
            "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["bad"]}],
            "parameters": {"task": "classify"},
        }
        r = c.post(f"/v2/models/{cls_dir.name}/infer", json=infer)
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], probs[1], rtol=1e-5)


def test_classify_needs_seq_cls_head(client):
    assert (
        "classification head"
        in error_of(client.post("/v1/classify", json={"input": "x"}), 400)["message"]
    )


# ---------------------------------------------------------------------------------- embeddings


def test_embeddings_float_and_base64(client, engine):
    r = client.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world", "bye"]})
    assert r.status_code == 200, r.text
    out = r.json()
    want = engine.embed(["hello world", "bye"], pooling="last", normalize=True).numpy()
    got = np.array([d["embedding"] for d in out["data"]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    check_snapshot(
        "embeddings", {**out, "data": [{**d, "embedding": d["embedding"][:8]} for d in out["data"]]}
    )
    r = client.post("/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, want[0], rtol=1e-5, atol=1e-6)
    r = client.post(
        "/v1/embeddings", json={"input": [[1, 2, 3]], "pooling": "mean", "normalize": False}
    )
    assert r.status_code == 200
    np.testing.assert_allclose(
        r.json()["data"][0]["embedding"],
        engine.embed([[1, 2, 3]], pooling="mean").numpy()[0],
        rtol=1e-5,
        atol=1e-6,
    )


def test_embeddings_dimensions_rejected_clearly(client, engine):
    err = error_of(client.post("/v1/embeddings", json={"input": "x", "dimensions": 8}), 400)
    assert f"{engine.config.hidden_size}-dimensional" in err["message"]
    ok = client.post("/v1/embeddings", json={"input": "x", "dimensions": engine.config.hidden_size})
    assert ok.status_code == 200


# ---------------------------------------------------------------------------------------- beam


def test_beam_with_and_without_trie(client, engine):
    r = client.post("/v1/beam", json={"prompt": "hello", "beam_width": 4, "steps": 2, "top_k": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    want = engine.beam_search("hello", 4, 2, top_k=3)
    assert [x["tokens"] for x in out["results"]] == [t for t, _ in want]
    assert [x["score"] for x in out["results"]] == pytest.approx([s for _, s in want], rel=1e-4)
    assert (
        "unknown trie"
        in error_of(
            client.post(
                "/v1/beam", json={"prompt": "x", "beam_width": 2, "steps": 1, "trie": "nope"}
            ),
            400,
        )["message"]
    )
    assert (
        "max_beam_width"
        in error_of(
            client.post("/v1/beam", json={"prompt": "x", "beam_width": 10**6, "steps": 1}), 413
        )["message"]
    )


def test_beam_trie_item_ids(client):
    r = client.post(
        "/v1/beam", json={"prompt": [1, 2, 3], "beam_width": 4, "steps": 3, "trie": "catalog"}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert all(res["tokens"] in TRIE_SEQS for res in out["results"])
    assert all(res["item_id"] == 100 + TRIE_SEQS.index(res["tokens"]) for res in out["results"])
    check_snapshot("beam_trie", out)


# ------------------------------------------------------------------------------------- KServe v2


def test_kserve_metadata_health_and_json_infer(client, engine):
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
    meta = client.get(f"/v2/models/{MODEL}").json()
    assert meta["name"] == MODEL and {t["name"] for t in meta["inputs"]} >= {"query", "items"}
    check_snapshot("kserve_metadata", meta)
    r = client.get("/v2/models/other")
    assert r.status_code == 404 and "unknown model" in r.json()["error"]
    req = {
        "id": "r1",
        "inputs": [
            {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["the user likes"]},
            {
                "name": "items",
                "shape": [2],
                "datatype": "BYTES",
                "data": [" red shoes", " a blue hat"],
            },
            {"name": "label_token_ids", "shape": [2], "datatype": "INT64", "data": [3, 7]},
        ],
    }
    r = client.post(f"/v2/models/{MODEL}/infer", json=req)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "r1" and out["outputs"][0]["shape"] == [2, 2]
    want = engine.score("the user likes", [" red shoes", " a blue hat"], [3, 7], apply_softmax=True)
    np.testing.assert_allclose(np.reshape(out["outputs"][0]["data"], (2, 2)), want, rtol=1e-5)
    check_snapshot("kserve_infer", out)
    bad = client.post(
        f"/v2/models/{MODEL}/infer",
        json={"inputs": [{"name": "items", "shape": [2], "datatype": "BYTES", "data": ["a"]}]},
    )
    assert bad.status_code == 400 and "needs 2 elements" in bad.json()["error"]


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def test_kserve_binary_tensors(client, engine):
    q, items = _bytes_tensor([b"hello"]), _bytes_tensor([b"a", b"b", b"c"])
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "query",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(q)},
                },
                {
                    "name": "items",
                    "shape": [3],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(items)},
                },
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    r = client.post(
        f"/v2/models/{MODEL}/infer",
        content=head + q + items,
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "content-type": "application/octet-stream",
        },
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    meta = json.loads(r.content[:n])
    scores = np.frombuffer(r.content[n:], dtype="<f4").reshape(meta["outputs"][0]["shape"])
    labels = client.get("/v1/models").json()["data"][0]["rerank_label_token_ids"]
    np.testing.assert_allclose(
        scores, engine.score("hello", ["a", "b", "c"], labels, apply_softmax=True), rtol=1e-5
    )


# ----------------------------------------------------------------------------- models, metrics


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    check_snapshot("models", models)
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/score", json={"query": [1], "items": [[2]], "label_token_ids": [3]})
    client.post("/v1/score", json={"query": [1], "items": [[-2]], "label_token_ids": [3]})
    text = client.get("/metrics").text
    for name in (
        "boundgen_request_seconds_bucket",
        "boundgen_runtime_node_seconds_bucket",
        "boundgen_inflight",
        "boundgen_batch_tokens",
        "boundgen_items_total",
        "boundgen_errors_total",
        "boundgen_device_memory_bytes",
    ):
        assert name in text, name
    assert 'boundgen_errors_total{endpoint="score",type="invalid_request_error"}' in text


def test_server_timing_header(client, engine):
    """Every answer says where its time went (`app` first); a model call adds its own entries."""
    from boundgen.loadtest import parse_server_timing

    r = client.post(
        "/v1/score", json={"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [3]}
    )
    timing = parse_server_timing(r.headers["server-timing"])
    assert r.headers["server-timing"].startswith("app;dur=")
    inner = {
        "runtime",
        "prepare",
        "forward",
        "forward-batch-wait",
        "forward-batch-run",
        "head",
        "finish",
    }
    assert inner <= set(timing), timing
    assert all(v >= 0 for v in timing.values())
    assert timing["runtime"] <= timing["app"]
    # the batching node's run = waiting for its batch + the batch's run (+ hand-offs)
    assert timing["forward-batch-wait"] + timing["forward-batch-run"] <= timing["forward"] + 0.01
    bad = client.post("/v1/score", json={"query": [1], "items": [[-2]], "label_token_ids": [3]})
    assert set(parse_server_timing(bad.headers["server-timing"])) == {
        "app"
    }  # refused before the model
    off = create_app(engine, ServerConfig(server_timing=False))
    with TestClient(off) as c:
        assert "server-timing" not in c.get("/health").headers


def test_unknown_route_and_method(client):
    assert error_of(client.get("/v1/nope"), 404)["type"] == "not_found_error"
    assert error_of(client.get("/v1/score"), 405)["message"].startswith("method GET")


def test_api_key(engine, monkeypatch):
    monkeypatch.setenv("BOUNDGEN_API_KEY", "s3cret")
    with TestClient(create_app(engine)) as c:
        body = {"query": [1], "items": [[2]], "label_token_ids": [3]}
        assert error_of(c.post("/v1/score", json=body), 401)["type"] == "authentication_error"
        assert (
            c.post("/v1/score", json=body, headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
        assert (
            c.post("/v1/score", json=body, headers={"Authorization": "Bearer s3cret"}).status_code
            == 200
        )
        wait_ready(c)  # probes stay open: readiness answers without the key


# ------------------------------------------------------------------------------ load control


async def _concurrent(app, requests):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
        return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))


def test_overload_sheds_with_429_and_accepted_succeed(engine):
    app = create_app(slow_engine(engine, 0.2), ServerConfig(max_queue=2, retry_after_s=3))
    body = {"query": [1, 2], "items": [[3]], "label_token_ids": [4]}
    responses = asyncio.run(_concurrent(app, [("/v1/score", body)] * 8))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(429) >= 4 and set(codes) <= {200, 429}, codes
    shed = next(r for r in responses if r.status_code == 429)
    assert shed.headers["Retry-After"] == "3" and error_of(shed, 429)["type"] == "overloaded_error"
    ok = [r.json()["scores"] for r in responses if r.status_code == 200]
    assert all(s == ok[0] for s in ok)
    # capacity comes back once the burst is done
    assert asyncio.run(_concurrent(app, [("/v1/score", body)]))[0].status_code == 200


def test_timeout_504_and_event_loop_stays_free(engine):
    app = create_app(slow_engine(engine, 0.6), ServerConfig(timeout_ms=5000))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            slow = asyncio.create_task(
                c.post(
                    "/v1/score",
                    json={"query": [1], "items": [[2]], "label_token_ids": [3], "timeout_ms": 100},
                )
            )
            await asyncio.sleep(0.02)
            t0 = time.perf_counter()
            health = await c.get("/health")
            health_s = time.perf_counter() - t0
            return await slow, health, health_s

    slow, health, health_s = asyncio.run(run())
    err = error_of(slow, 504)
    assert err["type"] == "timeout_error" and "timeout_ms=100" in err["message"]
    assert health.status_code == 200 and health_s < 0.3  # the model thread never blocks the loop


# ------------------------------------------------------------------------------------- config


def test_config_file_and_validation(tmp_path):
    (tmp_path / "s.yaml").write_text(
        "port: 9001\nmax_queue: 7\ntries: {a: /x}\nengine:\n  max_items: 12\n"
    )
    settings = load_settings(tmp_path / "s.yaml")
    server, eng = settings.server, settings.engine
    assert server.port == 9001 and server.max_queue == 7 and server.tries == ("a=/x",)
    assert eng.max_items == 12
    (tmp_path / "s.toml").write_text('host = "0.0.0.0"\ndevice = "cpu"\n')
    settings = load_settings(tmp_path / "s.toml")
    assert settings.server.host == "0.0.0.0" and settings.engine.device == "cpu"
    with pytest.raises(ValueError, match="unknown keys"):
        load_settings({"nope": 1})
    with pytest.raises(ValueError, match="max_queue"):
        load_settings({"max_queue": 0})
    assert ServerConfig().host == "127.0.0.1"


def test_default_model_is_the_demo_with_its_catalog_trie():
    from boundgen.demo import default_model_path, default_trie_path

    path, config = ServerConfig().with_default_model()
    assert path == default_model_path() and (path / "config.json").exists()
    assert config.tries == (f"catalog={default_trie_path()}",)
    given, kept = ServerConfig(model="/some/dir", tries=("x=/t.jsonl",)).with_default_model()
    assert str(given) == "/some/dir" and kept.tries == ("x=/t.jsonl",)


def test_deadline_504(client):
    items = [[(7 * i + j) % 2000 + 1 for j in range(48)] for i in range(64)]
    r = client.post(
        "/v1/score",
        json={
            "query": list(range(1, 200)),
            "items": items,
            "label_token_ids": [1],
            "timeout_ms": 1,
        },
    )
    assert error_of(r, 504)["type"] == "timeout_error"
    assert (
        client.post(
            "/v1/score", json={"query": [1], "items": [[2]], "label_token_ids": [3]}
        ).status_code
        == 200
    )


def test_serve_flags_override_config_file(tmp_path):
    from boundgen.cli import build_parser
    from boundgen.server.config import settings_from_args

    (tmp_path / "c.toml").write_text("port = 9100\nmax_queue = 5\n[engine]\nmax_items = 7\n")
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(tmp_path / "c.toml"),
            "--port",
            "9200",
            "--device",
            "cpu",
            "--batch-max-wait-ms",
            "2",
        ]
    )
    settings = settings_from_args(args)
    server, engine = settings.server, settings.engine
    assert (server.port, server.max_queue) == (9200, 5)
    assert (engine.max_items, engine.device, engine.batch_max_wait_ms) == (7, "cpu", 2.0)


def test_openapi_documents_request_bodies(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert body == {"$ref": "#/components/schemas/ScoreRequest"}
    assert {"ScoreRequest", "RerankRequest", "RerankDocument"} <= set(spec["components"]["schemas"])


def test_trie_softmax_setting_reaches_the_loaded_tries(trie_path):
    """`--trie-softmax children`: the server's tries renormalise over children (the LM head then
    runs on a trie level's tokens only); anything else is refused at start."""
    from boundgen.server.state import load_tries

    cfg = ServerConfig(tries=(f"catalog={trie_path}",), trie_softmax="children").validate()
    assert load_tries(cfg)["catalog"].softmax == "children"
    assert load_tries(ServerConfig(tries=(f"catalog={trie_path}",)))["catalog"].softmax == "vocab"
    with pytest.raises(ValueError, match="trie_softmax must be vocab or children"):
        ServerConfig(trie_softmax="items").validate()
