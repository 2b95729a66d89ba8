"""`server/dispatch.FixedRoutes`: a fixed route's request goes straight to its endpoint, and every
answer is the one FastAPI's router gave (statuses, bodies, headers), misses included."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.routing import APIRouter
from fastapi.testclient import TestClient

from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.dispatch import FixedRoutes

LOCAL = "http://127.0.0.1"
SCORE = {"query": [11] * 10, "items": [[12] * 5, [13] * 7], "label_token_ids": [1, 2]}
# (method, path, JSON body): answered by a fixed route, by one with a path parameter, and not at all
REQUESTS = [
    ("POST", "/v1/score", SCORE),
    ("POST", "/v1/score", {"query": [11], "items": [[12]], "label_token_ids": [10**9]}),  # 400
    ("POST", "/v1/score", {"queries": [[11, 12]], "documents": [[13]]}),  # vLLM's body
    ("POST", "/v1/score", {"query": [11], "items": [[12]], "label_token_ids": [1], "x": 1}),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("POST", "/v2/models/tiny/infer", {"inputs": []}),  # path parameter: the router's
    ("GET", "/v1/score", None),  # 405
    ("POST", "/v1/nothing", SCORE),  # 404
    ("POST", "/v1/score/", SCORE),  # not the fixed path
]


def _client(engine, fixed: bool) -> TestClient:
    app = create_app(engine, ServerConfig(server_timing=False))
    if not fixed:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not FixedRoutes]
    return TestClient(app, base_url=LOCAL)


def _answer(response) -> tuple:
    headers = {k: v for k, v in response.headers.items() if k not in ("date",)}
    return response.status_code, response.content, headers


def test_fixed_routes_answer_as_the_router_does(engine_for):
    engine = engine_for()
    fast, routed = _client(engine, True), _client(engine, False)
    # /v1/models' `created` is each app's own start (whole seconds): two apps made one after the
    # other may straddle a second, so both report the first one's
    fast.app.state.boundgen.started = routed.app.state.boundgen.started
    for method, path, body in REQUESTS:
        kwargs = {"json": body} if body is not None else {}
        got = _answer(fast.request(method, path, **kwargs))
        want = _answer(routed.request(method, path, **kwargs))
        assert got == want, (method, path)


def test_a_fixed_route_skips_the_router(engine_for, monkeypatch):
    routed = []
    router_call = APIRouter.__call__

    async def counted(self, scope, receive, send):
        routed.append((scope["method"], scope["path"]))
        await router_call(self, scope, receive, send)

    monkeypatch.setattr(APIRouter, "__call__", counted)
    client = _client(engine_for(), True)
    assert client.post("/v1/score", json=SCORE).status_code == 200
    assert client.get("/health").status_code == 200
    assert routed == []
    assert client.post("/v1/nothing", json=SCORE).status_code == 404
    assert client.head("/health").status_code in (200, 405)  # HEAD is the router's to answer
    assert routed == [("POST", "/v1/nothing"), ("HEAD", "/health")]


def test_under_a_root_path_the_router_matches(engine_for, monkeypatch):
    routed = []
    router_call = APIRouter.__call__

    async def counted(self, scope, receive, send):
        routed.append(scope["path"])
        await router_call(self, scope, receive, send)

    monkeypatch.setattr(APIRouter, "__call__", counted)
    app = create_app(engine_for(), ServerConfig())
    client = TestClient(app, base_url=LOCAL, root_path="/api")
    assert client.get("/api/health").status_code == 200
    assert routed == ["/api/health"]


def test_a_route_with_path_parameters_is_refused():
    async def endpoint(request):
        raise AssertionError

    with pytest.raises(ValueError, match="path parameters"):
        FixedRoutes(None, {("POST", "/v2/models/{name}/infer"): endpoint})
