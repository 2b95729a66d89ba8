"""Issue 27, no silent typos: a field close to one the route knows is refused with a 400 naming
it; any other unknown field is handled as the route's peer handles it (docs/compat.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig
from boundgen.server.fields import check
from boundgen.server.schemas.sglang import ScoreRequest

SCORE = {"query": "the user likes", "items": [" red shoes"], "label_token_ids": [3, 7]}
RERANK = {"query": "q", "documents": ["a", "b"]}


@pytest.fixture(scope="module")
def client(engine_for):
    config = ServerConfig(
        rerank_query_template="Query: {query}\n",
        rerank_document_template="Item: {document}\nRelevant:",
    )
    with TestClient(create_app(engine_for("qwen2"), config)) as c:
        yield c


def message_of(response) -> str:
    body = response.json()
    err = body.get("error", body)  # SGLang's routes answer a flat error object
    return err if isinstance(err, str) else err["message"]


# (route, body with the misspelling, the misspelled name, the field it resembles)
MISSPELLINGS = [
    ("/v1/score", {**SCORE, "apply_sofmax": True}, "apply_sofmax", "apply_softmax"),
    ("/v1/score", {**SCORE, "item_frist": True}, "item_frist", "item_first"),
    ("/v1/score", {**SCORE, "label_token_id": [3]}, "label_token_id", "label_token_ids"),
    ("/v1/score", {**SCORE, "temprature": 1}, "temprature", "temperature"),
    (
        "/v1/score",
        {"queries": "q", "items": ["a"], "use_activaton": False},
        "use_activaton",
        "use_activation",
    ),
    (
        "/score",
        {"queries": "q", "documents": ["a"], "activation": False},
        "activation",
        "use_activation",
    ),
    ("/v1/rerank", {**RERANK, "retrun_documents": False}, "retrun_documents", "return_documents"),
    ("/v1/rerank", {**RERANK, "top_k": 1}, "top_k", "top_n"),
    ("/v2/rerank", {**RERANK, "max_token_per_doc": 4}, "max_token_per_doc", "max_tokens_per_doc"),
    (
        "/v1/embeddings",
        {"input": "a", "encodng_format": "base64"},
        "encodng_format",
        "encoding_format",
    ),
    ("/v1/embeddings", {"input": "a", "priorty": 1}, "priorty", "priority"),
    (
        "/v2/embed",
        {"texts": ["a"], "embeding_types": ["int8"]},
        "embeding_types",
        "embedding_types",
    ),
    ("/embed", {"inputs": "a", "normalise": False}, "normalise", "normalize"),
    ("/rerank", {"query": "q", "texts": ["a"], "raw_score": True}, "raw_score", "raw_scores"),
    (
        "/tokenize",
        {"prompt": "a", "return_token_str": True},
        "return_token_str",
        "return_token_strs",
    ),
    ("/v1/beam", {"prompt": "a", "beam_width": 2, "steps": 1, "top-k": 1}, "top-k", "top_k"),
    (
        "/v2/models/m/infer",
        {"inputs": [], "paramters": {"task": "embed"}},
        "paramters",
        "parameters",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "typo", "meant"), MISSPELLINGS, ids=[f"{m[0]}:{m[2]}" for m in MISSPELLINGS]
)
def test_a_misspelled_field_is_refused_naming_the_one_it_resembles(client, path, body, typo, meant):
    if path.startswith("/v2/models/"):
        path = path.replace("/m/", f"/{client.get('/v1/models').json()['data'][0]['id']}/")
    response = client.post(path, json=body)
    tei = path in ("/embed", "/rerank")  # TEI answers a bad request with 422 `Validation`
    assert response.status_code == (422 if tei else 400), response.text
    message = message_of(response)
    assert message.startswith(f"{typo}: unknown field; did you mean {meant!r}?"), message


def test_a_misspelled_unsupported_field_says_why_it_would_be_refused_anyway(client):
    message = message_of(client.post("/v1/score", json={**SCORE, "temprature": 1}))
    assert "does not sample" in message
    message = message_of(client.post("/v1/embeddings", json={"input": "a", "priorty": 1}))
    assert "no priority scheduling" in message


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/score", {**SCORE, "user": "u1", "temperature": 1.0}),  # SGLang: ignored
        ("/v1/score", {"queries": "q", "items": ["a"], "user": "u1"}),  # vLLM: ignored
        ("/v1/embeddings", {"input": "a", "user": "u1", "request_id": "r"}),  # vLLM: ignored
        ("/v1/rerank", {**RERANK, "request_id": "r"}),  # Cohere/vLLM: ignored
        ("/embed", {"inputs": "a", "request_id": "r"}),  # TEI: ignored
    ],
    ids=["sglang-score", "vllm-score", "embeddings", "rerank", "tei-embed"],
)
def test_other_unknown_fields_are_ignored_as_the_peer_does(client, path, body):
    assert client.post(path, json=body).status_code == 200


def test_boundgens_own_beam_refuses_any_unknown_field(client):
    response = client.post("/v1/beam", json={"prompt": "a", "beam_width": 2, "steps": 1, "n": 3})
    assert response.status_code == 400
    assert message_of(response).startswith("n: unknown field; this request takes beam_width,")


def test_a_stem_shared_with_another_field_is_not_a_near_miss():
    check(ScoreRequest, ["queries", "user", "documents"])  # `query`/`queries`: 0.67, no typo
