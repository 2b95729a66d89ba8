"""Property-based fuzz of the HTTP API: ≥ 500 generated bad requests (wrong types, missing
fields, huge and empty lists, bad token ids, non-UTF-8, deeply nested JSON, broken KServe
tensors). Every answer must be a 4xx with a clear error message, never a 5xx, and the server must
still answer correctly afterwards."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boundgen import Engine
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.testing import frontend_app, tiny_model_dir

MAX_ITEMS = 8
VOCAB = 2048  # the tiny preset's vocabulary (checked in the fixture)
INFER = "/v2/models/tiny-server-test/infer"

VALID = {
    "/v1/score": {"query": "q", "items": ["a"], "label_token_ids": [1]},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/v1/embeddings": {"input": "x"},
    "/v1/beam": {"prompt": "x", "beam_width": 2, "steps": 1},
    INFER: {
        "inputs": [
            {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["q"]},
            {"name": "items", "shape": [1], "datatype": "BYTES", "data": ["a"]},
        ]
    },
}
REQUIRED = {
    "/v1/score": ["query", "items", "label_token_ids"],
    "/v1/rerank": ["query", "documents"],
    "/v1/embeddings": ["input"],
    "/v1/beam": ["prompt", "beam_width", "steps"],
    INFER: ["inputs"],
}

BAD_IDS = [[-1], [VOCAB], [2**70], [1, -5]]
HUGE = ["x"] * (MAX_ITEMS + 1)
LONG_TEXT = "word " * 64
# For each field, values that can never be valid there. (SGLang's `items: []` and `[""]` are: no
# scores, and the query scored alone.)
BAD_VALUES = {
    "query": [1, 1.5, True, None, {"a": 1}, [1.5], ["a"], [[1]], *BAD_IDS, LONG_TEXT],
    "items": [
        1,
        None,
        True,
        {"a": 1},
        [1],
        [None],
        [[1.5]],
        [["a"]],
        HUGE,
        [[t] for t in (-1, VOCAB)],
        [[]],
        [LONG_TEXT],
        ["a", [1]],
    ],
    "label_token_ids": [[], 1, "1", [1.5], ["a"], None, *BAD_IDS, list(range(1000))],
    "apply_softmax": [1, "true", None, [True]],
    "item_first": [0, "no", {}],
    "documents": [[], None, "doc", [1], [None], [{"txt": "a"}], HUGE, [LONG_TEXT]],
    "top_n": [-1, "3", 1.5, True],
    "return_documents": ["yes", 1],
    "input": [None, 1, [], [None], [1.5], [[1.5]], *BAD_IDS, HUGE, {"a": "b"}, [""], [[]]],
    "encoding_format": ["int8", 1, None],
    "dimensions": [7, 0, -1, "64", 1.0],
    "pooling": ["max", 1],
    "prompt": [None, 1, [], [1.5], *BAD_IDS, {"p": 1}, LONG_TEXT * 4],
    "beam_width": [0, -1, 10**6, 1.5, "2", None, True],
    "steps": [0, -3, 10**6, "1", None],
    "top_k": [0, 3, -1, "1"],  # 3 > beam_width 2
    "trie": ["missing", 1, []],
    "timeout_ms": [0, -5, "100", 1.5],
    "model": [1, [], {}],
    "inputs": [
        None,
        [],
        "x",
        [1],
        [{"name": 1}],
        [{"name": "query", "shape": [2], "datatype": "BYTES", "data": ["q"]}],
    ],
}

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
)
json_value = st.recursive(
    json_leaf,
    lambda ch: st.one_of(
        st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=6), ch, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def bad_requests(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    kind = draw(
        st.sampled_from(
            ["wrong_value", "missing", "garbage_json", "raw_bytes", "non_utf8", "nested", "kserve"]
        )
    )
    if kind == "wrong_value":
        field = draw(st.sampled_from(sorted(BAD_VALUES)))
        if path == INFER and field != "inputs":
            field = "inputs"
        body[field] = draw(st.sampled_from(BAD_VALUES[field]))
        if field not in REQUIRED[path] and field not in _OPTIONAL[path]:
            # a field this endpoint ignores: break a required one too
            body.pop(draw(st.sampled_from(REQUIRED[path])))
        return path, json.dumps(body).encode()
    if kind == "missing":
        for key in draw(st.lists(st.sampled_from(REQUIRED[path]), min_size=1, unique=True)):
            body.pop(key)
        return path, json.dumps(body).encode()
    if kind == "garbage_json":
        value = draw(json_value)
        if isinstance(value, dict):
            value.pop(REQUIRED[path][0], None)
        return path, json.dumps(value).encode()
    if kind == "raw_bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "non_utf8":
        field = REQUIRED[path][0]
        raw = json.dumps({**body, field: "@@"}).encode()
        return path, raw.replace(
            b"@@", draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"]))
        )
    if kind == "nested":
        depth = draw(st.integers(min_value=64, max_value=20000))
        nested = "[" * depth + "]" * depth
        where = draw(st.sampled_from(["body", "field"]))
        if where == "body":
            return path, nested.encode()
        raw = json.dumps({**body, REQUIRED[path][0]: "@@"})
        return path, raw.replace('"@@"', nested).encode()
    # kserve: broken tensors
    t = draw(
        st.sampled_from(
            [
                {"name": "items", "shape": [3], "datatype": "BYTES", "data": ["a"]},
                {"name": "items", "shape": [-1], "datatype": "BYTES", "data": ["a"]},
                {"name": "items", "shape": [1], "datatype": "FP32", "data": [1.0]},
                {"name": "items", "shape": [1], "datatype": "BYTES", "data": [1]},
                {
                    "name": "items",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 99},
                },
                {"name": "items", "shape": [1], "datatype": "BYTES"},
                {"name": "items", "shape": [1 << 30], "datatype": "BYTES", "data": []},
                {"name": "items", "shape": [1], "datatype": "NOPE", "data": ["a"]},
            ]
        )
    )
    inputs = [VALID[INFER]["inputs"][0], t]
    params = draw(
        st.sampled_from(
            [None, {"task": "nope"}, {"task": 3}, {"apply_softmax": "yes"}, {"timeout_ms": -1}]
        )
    )
    req = {"inputs": inputs, **({"parameters": params} if params else {})}
    return INFER, json.dumps(req).encode()


_OPTIONAL = {
    "/v1/score": ["apply_softmax", "item_first", "model", "timeout_ms"],
    "/v1/rerank": ["top_n", "return_documents", "model", "timeout_ms"],
    "/v1/embeddings": ["encoding_format", "dimensions", "pooling", "model", "timeout_ms"],
    "/v1/beam": ["top_k", "trie", "model", "timeout_ms"],
    INFER: [],
}


@pytest.fixture(scope="module", params=["in-process", "frontend"])
def client(request, tmp_path_factory):
    """The app over the engine (`serve`), or a frontend's app over its link (`serve --frontends`):
    the same answers either way."""
    engine = Engine.from_pretrained(
        tiny_model_dir(tmp_path_factory.mktemp("m")),
        device="cpu",
        max_items=MAX_ITEMS,
        max_beam_width=8,
        max_beam_steps=4,
    )
    assert engine.config.vocab_size == VOCAB
    config = ServerConfig(
        max_item_tokens=16,
        max_query_tokens=48,
        max_label_tokens=64,
        max_body_bytes=1 << 16,
    )
    if request.param == "frontend":
        with (
            frontend_app(engine, config) as (app, _),
            TestClient(app, raise_server_exceptions=True) as c,
        ):
            yield c
        return
    with TestClient(create_app(engine, config), raise_server_exceptions=True) as c:
        yield c


SEEN: dict[int, list[int]] = {}  # per client: the statuses its fuzzed requests got


@settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(req=bad_requests())
def test_bad_requests_get_clear_4xx(client, req):
    path, body = req
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    SEEN.setdefault(id(client), []).append(r.status_code)
    assert 400 <= r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
    body = r.json()
    err = body.get("error", body)  # SGLang's routes answer a flat error object
    message = err if isinstance(err, str) else err["message"]
    assert isinstance(message, str) and 8 <= len(message) <= 2000, message
    if not isinstance(err, str):
        assert err["type"].endswith(("_error", "Error")) or err["type"] == "request_too_large"


def test_fuzz_ran_enough_and_server_still_answers(client):
    assert len(SEEN.get(id(client), ())) >= 500, len(SEEN.get(id(client), ()))
    r = client.post(
        "/v1/score",
        json={"query": "q", "items": ["a", "b"], "label_token_ids": [1, 2], "apply_softmax": True},
    )
    assert r.status_code == 200 and len(r.json()["scores"]) == 2
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics").text
    assert 'boundgen_requests_total{endpoint="score",status="500"}' not in metrics
