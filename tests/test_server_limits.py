"""Issue 19 in process (tiny model): the guard's checks and their options (Host, Origin and CORS,
API key sources and HTTP Basic, Content-Type, body size and deadline, cancel on disconnect),
JSON parsing within its bounds, and admission by expected latency. The live-server bounds (time,
/health latency, RSS) are tests/test_server_reliability.py."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.limits import JsonBounds, load_json
from boundgen.server.testing import http_scope, slow_engine

LOCAL = "http://127.0.0.1:8000"  # the client's view: a server on a loopback address
SCORE = {"query": [1, 2], "items": [[3, 4]], "label_token_ids": [5]}


@pytest.fixture(scope="module")
def engine(engine_for):
    return engine_for()


def client(engine, base_url: str = LOCAL, **config) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(**config)), base_url=base_url)


def message(r) -> str:
    body = r.json()
    err = body.get("error", body)  # SGLang's routes answer a flat error object
    return err if isinstance(err, str) else err["message"]


# ---- Host, Origin, CORS


def test_host_on_a_loopback_connection_must_name_this_machine(engine):
    c = client(engine)
    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "127.0.0.2"):
        assert c.post("/v1/score", json=SCORE, headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example"):
        r = c.get("/v1/models", headers={"Host": host})
        assert r.status_code == 400 and "allowed_hosts" in message(r), host
    assert c.get("/health", headers={"Host": "10.1.2.3:8000"}).status_code == 200  # probes
    # on another address any name passes; an explicit list is the list
    assert client(engine, "http://10.0.0.5").get("/v1/models").status_code == 200
    listed = client(engine, allowed_hosts=("api.example",))
    assert listed.get("/v1/models", headers={"Host": "api.example:443"}).status_code == 200
    assert listed.get("/v1/models").status_code == 400


def test_foreign_origin_is_refused_and_listed_origins_get_cors(engine):
    c = client(engine)
    r = c.post("/v1/score", json=SCORE, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "allowed_origins" in message(r)
    same = c.post("/v1/score", json=SCORE, headers={"Origin": "http://127.0.0.1:8000"})
    assert same.status_code == 200
    app = "https://app.example"
    cors = client(engine, allowed_origins=(app,), api_key="k")
    preflight = cors.options(
        "/v1/score",
        headers={"Origin": app, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == app
    auth = {"Origin": app, "Authorization": "Bearer k"}
    assert cors.post("/v1/score", json=SCORE, headers=auth).status_code == 200


# ---- Content-Type, API key


def test_json_routes_need_a_json_content_type_and_kserve_infer_also_takes_binary(engine):
    c = client(engine)
    body = json.dumps(SCORE).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = c.post("/v1/score", content=body, headers=headers)
        assert r.status_code == 415 and "application/json" in message(r), ctype
    ok = c.post("/v1/score", content=body, headers={"Content-Type": "Application/JSON; charset=x"})
    assert ok.status_code == 200
    infer = "/v2/models/tiny/infer"  # the Content-Type check comes before the route
    r = c.post(infer, content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "octet-stream" in r.json()["error"]  # KServe's error shape
    for headers in ({}, {"Content-Type": "application/octet-stream"}):
        assert c.post(infer, content=b"{}", headers=headers).status_code == 404  # unknown model
    # no body, no Content-Type: nothing to misread, so the route answers (tritonclient's repository
    # index POST sends neither); a body without one is still refused
    assert c.post("/v2/repository/index").status_code == 404
    assert c.post("/v1/score", content=b"", headers={"Content-Length": "0"}).status_code == 400
    assert c.post("/v1/score", content=b" ").status_code == 415


def test_api_key_sources_and_where_it_is_asked_for(engine, tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("from-file \n")
    monkeypatch.delenv("BOUNDGEN_API_KEY", raising=False)
    monkeypatch.setenv("BOUNDGEN_API_KEY_FILE", str(path))
    assert ServerConfig().api_key_source() == ("from-file", "env BOUNDGEN_API_KEY_FILE")
    monkeypatch.setenv("BOUNDGEN_API_KEY", "from-env")
    assert ServerConfig().api_key_source()[0] == "from-env"
    assert ServerConfig(api_key_file=str(path)).api_key_source()[0] == "from-file"
    assert ServerConfig(api_key="flag", api_key_file=str(path)).api_key_source()[0] == "flag"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        ServerConfig(api_key_file=str(tmp_path / "empty")).resolved_api_key()

    c = client(engine, api_key_file=str(path))
    basic = base64.b64encode(b"anyone:from-file").decode()
    for headers in (
        {"Authorization": "Bearer from-file"},
        {"x-api-key": "from-file"},
        {"Authorization": f"Basic {basic}"},
    ):
        assert c.get("/v1/models", headers=headers).status_code == 200, headers
    denied = c.get("/v1/models", headers={"Authorization": "Bearer from-env"})
    assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
    docs = c.get("/docs")
    assert docs.status_code == 401 and docs.headers["www-authenticate"].startswith("Basic")
    assert c.get("/docs", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    assert c.get("/v2/health/ready").status_code == 200


# ---- the body


def _asgi(app, body_chunks: list[bytes], headers: dict[str, str], then_disconnect_s=None):
    """Call `app` as uvicorn would: the body in chunks (a chunk None: never comes), then an
    `http.disconnect` after `then_disconnect_s` (None: only once the response is complete)."""
    sent: list[dict] = []
    chunks = list(body_chunks)

    async def receive():
        if chunks:
            chunk = chunks.pop(0)
            if chunk is None:
                await asyncio.sleep(3600)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        if then_disconnect_s is not None:
            await asyncio.sleep(then_disconnect_s)
            return {"type": "http.disconnect"}
        while not any(m.get("type") == "http.response.body" for m in sent):
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = http_scope("POST", "/v1/score", headers)

    async def run():
        async with asyncio.timeout(10):
            await app(scope, receive, send)

    asyncio.run(run())
    return sent


JSON = {"Host": "127.0.0.1:8000", "Content-Type": "application/json"}


def test_body_over_the_limit_or_too_slow_is_refused(engine):
    app = create_app(engine, ServerConfig(max_body_bytes=1000, body_timeout_s=0.2))
    big = _asgi(app, [b"x"], JSON | {"Content-Length": "1001"})  # refused on the declaration
    assert big[0]["status"] == 413
    assert b"max_body_bytes" in big[1]["body"] and b"max_request_tokens" in big[1]["body"]
    streamed = _asgi(app, [b"x" * 600, b"x" * 600], JSON)  # chunked: counted as it comes
    assert streamed[0]["status"] == 413
    start = time.monotonic()
    slow = _asgi(app, [b'{"query": ', None], JSON | {"Content-Length": "100"})
    assert slow[0]["status"] == 408 and time.monotonic() - start < 2
    assert (b"connection", b"close") in slow[0]["headers"]


def test_a_client_that_leaves_cancels_its_request(engine):
    app = create_app(slow_engine(engine, 0.5), ServerConfig())
    body = json.dumps(SCORE).encode()
    start = time.monotonic()
    sent = _asgi(app, [body], JSON, then_disconnect_s=0.1)
    assert sent == [] and time.monotonic() - start < 0.4  # nobody to answer: nothing sent
    metrics = TestClient(app, base_url=LOCAL).get("/metrics").text
    assert 'boundgen_requests_total{endpoint="score",status="499"} 1.0' in metrics
    deadline = time.monotonic() + 5
    while app.state.boundgen.infer.admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.state.boundgen.infer.admitted == 0  # its work was cancelled in the runtime too


# ---- JSON within its bounds


def test_json_bounds():
    bounds = JsonBounds(containers=8, list_entries=4)
    assert load_json(b'{"a": [1, 2], "b": {"c": "\\u00e9"}}', bounds) == {
        "a": [1, 2],
        "b": {"c": "é"},
    }
    refused = {
        b'{"a": 1, "a": 2}': (400, "duplicate key 'a'"),
        b'{"a": NaN}': (400, "NaN"),
        b'{"a": "\\ud800"}': (400, "lone surrogate"),
        b'{"a": "\xed\xa0\x80"}': (400, "not valid JSON"),
        b"[[[[[[[[[1]]]]]]]]]": (413, "9 JSON arrays and objects"),
        b'{"a": [[1, 2, 3, 4, 5]]}': (413, "a[0] has 5 entries"),
    }
    for body, (status, text) in refused.items():
        with pytest.raises(Exception) as err:
            load_json(body, bounds)
        assert err.value.status == status and text in err.value.message, body


def test_orjson_parses_what_json_would_and_leaves_the_rest_to_json(monkeypatch):
    """Bodies without escapes go through orjson (`_fast_loads`) with the same result as json;
    a duplicate key, an escape, NaN or a float (orjson reads an integer beyond 64 bits as one)
    goes to json's path, whose refusals say why (`test_json_bounds`)."""
    from boundgen.server import limits

    bounds = JsonBounds(containers=200, list_entries=300)
    w2 = {
        "query": list(range(256)),
        "items": [[i, i + 1] * 8 for i in range(100)],
        "label_token_ids": [5, 7],
        "apply_softmax": True,
    }
    texts = {"query": "où est la gare", "documents": ["a b", "c"], "top_n": 1, "x": None}
    for value in (w2, texts, [1, "s", {"k": [True]}], {}):
        body = json.dumps(value, ensure_ascii=False).encode()
        assert limits._fast_loads(body, 300) == json.loads(body) == load_json(body, bounds)
    for body in (
        b'{"a": 1, "a": 2}',  # orjson would keep the last
        b'{"a": {"b": 1, "b": 2}}',
        b'{"a": "x\\"y"}',  # an escape
        b'{"a": NaN}',
        b'{"a": 123456789012345678901234567890}',  # orjson: a float
        b'{"a": [1, 2.5]}',  # any float: json's path
        b'{"a": [1, 2',
    ):
        assert limits._fast_loads(body, 300) is None, body
    # and the fast path is the one taken for a W2 body
    calls = []
    real = limits._fast_loads
    monkeypatch.setattr(limits, "_fast_loads", lambda b, n: calls.append(b) or real(b, n))
    monkeypatch.setattr(limits.json, "loads", None)  # json's path would fail
    assert load_json(json.dumps(w2).encode(), bounds) == w2 and calls


def test_token_id_lists_are_checked_together_and_named_alone(engine):
    """Items' token ids: the vocabulary checked over all lists at once; an id outside it, or an
    empty item, is still named by its index."""
    client = TestClient(create_app(engine, ServerConfig()), base_url=LOCAL)
    big = 10**6  # beyond any test model's vocabulary
    items = [[1, 2], [3], [4, 5]]
    ok = {"query": [1, 2], "items": items, "label_token_ids": [1]}
    assert client.post("/v1/score", json=ok).status_code == 200
    for bad, says in (
        ([[1], [2], [big]], f"items[2] contains token id {big}"),
        ([[1], [-1], [2]], "items[1] contains token id -1"),
        ([[1], [], [2]], "items[1] has no tokens"),
    ):
        r = client.post("/v1/score", json={**ok, "items": bad})
        assert r.status_code == 400 and says in r.text, r.text
    # with booleans, floats or text the schema answers first (strict ints), so the range check
    # never sees them; called without the schema, it refuses them with a 400 all the same
    r = client.post("/v1/score", json={**ok, "items": [[1], [True]]})
    assert r.status_code == 400 and "items" in r.text
    from boundgen.server.errors import BadRequest

    limits = client.app.state.boundgen.limits
    with pytest.raises(BadRequest, match="items must be lists of token ids"):
        limits.many_token_ids("items", [[1], ["a"]])


# ---- admission by expected latency


def test_a_request_that_cannot_make_its_deadline_is_not_run(engine):
    c = client(engine)
    items = [[10 + (i * 7 + j) % 900 for j in range(200)] for i in range(12)]  # 2.4k tokens
    heavy = {"query": [1, 2], "items": items, "label_token_ids": [5]}
    node = c.app.state.boundgen.infer.model_node("score")
    for _ in range(8):  # the cost model learns from what ran (not the first run)
        assert c.post("/v1/score", json=heavy).status_code == 200
        if node.cost.warm:
            break
    expected = node.queue_ms(2402)
    assert expected is not None and expected > 1
    r = c.post("/v1/score", json=heavy | {"timeout_ms": max(1, int(expected / 4))})
    assert r.status_code == 504
    assert message(r).startswith("request not run: timeout_ms=") and "did not finish" not in (
        message(r)
    )


def test_overload_sheds_by_predicted_wait_over_max_queue_ms(engine):
    app = create_app(slow_engine(engine, 0.3), ServerConfig(max_queue_ms=50))
    infer = app.state.boundgen.infer
    node = infer.model_node("score")
    for units, ms in ((10, 300), (10, 300), (4000, 301), (4000, 301)):  # 0.3 s a batch
        node.cost.observe(units, ms * 1_000_000)

    async def run():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/score", json=SCORE))
            await asyncio.sleep(0.05)  # admitted, running: the model is busy for ~0.3 s
            shed = await c.post("/v1/score", json=SCORE)
            return await first, shed

    first, shed = asyncio.run(run())
    assert first.status_code == 200
    assert shed.status_code == 429 and "max_queue_ms=50" in message(shed)
    assert 1 <= int(shed.headers["Retry-After"]) <= 30
