"""Cohere's own client and tests against a live `boundgen serve` (demo model).

Sources:
- cohere-ai/cohere-python `tests/test_client.py` (`test_embed`, `test_rerank`), the client's
  request/response types (`src/cohere/raw_base_client.py` `embed`/`rerank` → `v1/embed`,
  `v1/rerank`; `src/cohere/v2/raw_client.py` → `v2/embed`, `v2/rerank`;
  `src/cohere/types/embed_response.py`, `embed_by_type_response_embeddings.py`,
  `rerank_response_results_item_document.py`, `rerank_document.py`);
- vllm-project/vllm `tests/entrypoints/pooling/embed/test_cohere_online.py` (the `/v2/embed`
  protocol cases a generic embedding model must pass).

Adapted: model names ("embed-english-v3.0", "rerank-v3.5" → the served id; boundgen serves one
model whatever the name). Not ported: image embeddings (text models only) and
`test_semantic_similarity` (a model-quality check: "machine learning" vs "chocolate cake" is
outside the demo's catalog).
"""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest

cohere = pytest.importorskip("cohere")

RERANK_DOCS = [
    "Carson City is the capital city of the American state of Nevada.",
    "The Commonwealth of the Northern Mariana Islands is a group of islands in the Pacific "
    "Ocean. Its capital is Saipan.",
    "Washington, D.C. (also known as simply Washington or D.C., and officially as the District "
    "of Columbia) is the capital of the United States. It is a federal district.",
    "Capital punishment (the death penalty) has existed in the United States since beforethe "
    "United States was a country. As of 2017, capital punishment is legal in 30 of the 50 "
    "states.",
]


@pytest.fixture(scope="module")
def co(demo_server):
    return cohere.Client(api_key="-", base_url=demo_server.url, timeout=120)


@pytest.fixture(scope="module")
def co_v2(demo_server):
    return cohere.ClientV2(api_key="-", base_url=demo_server.url, timeout=120)


# ------------------------------------------------------------ cohere-python tests/test_client.py


def test_rerank(co, demo_model_name):
    response = co.rerank(
        model=demo_model_name,
        query="What is the capital of the United States?",
        documents=RERANK_DOCS,
        top_n=3,
    )
    assert len(response.results) == 3


def test_rerank_v2(co_v2, demo_model_name):
    response = co_v2.rerank(
        model=demo_model_name,
        query="What is the capital of the United States?",
        documents=RERANK_DOCS,
        top_n=3,
    )
    assert len(response.results) == 3
    scores = [r.relevance_score for r in response.results]
    assert scores == sorted(scores, reverse=True)


def test_rerank_document_objects_keep_their_fields(co, demo_model_name):
    """Cohere v1: a document may be an object; `text` is ranked, every field comes back."""
    documents = [{"title": f"doc {i}", "text": text} for i, text in enumerate(RERANK_DOCS)]
    response = co.rerank(
        model=demo_model_name,
        query="What is the capital of the United States?",
        documents=documents,
        return_documents=True,
    )
    for result in response.results:
        assert result.document.text == RERANK_DOCS[result.index]
        assert result.document.title == f"doc {result.index}"


def test_embed(co, demo_model_name):
    response = co.embed(
        texts=["hello", "goodbye"],
        model=demo_model_name,
        input_type="classification",
        embedding_types=["float", "int8", "uint8", "binary", "ubinary"],
    )
    assert response.response_type == "embeddings_by_type"
    assert response.embeddings.float_ is not None
    assert type(response.embeddings.float_[0][0]) is float
    for kind in ("int8", "uint8", "binary", "ubinary"):
        values = getattr(response.embeddings, kind)
        assert values is not None, kind
        assert type(values[0][0]) is int, kind


def test_embed_floats_response(co, demo_model_name):
    """No `embedding_types`: Cohere v1 answers the `embeddings_floats` response type."""
    response = co.embed(texts=["hello", "goodbye"], model=demo_model_name, input_type="clustering")
    assert response.response_type == "embeddings_floats"
    assert len(response.embeddings) == 2
    assert response.texts == ["hello", "goodbye"]


def test_embed_v2(co_v2, demo_model_name):
    response = co_v2.embed(
        model=demo_model_name,
        input_type="search_document",
        texts=["hello", "goodbye"],
        embedding_types=["float"],
    )
    assert len(response.embeddings.float_) == 2
    assert type(response.embeddings.float_[0][0]) is float


# ------------------------------------- vLLM tests/entrypoints/pooling/embed/test_cohere_online.py


def cohere_embed(demo_http, body):
    response = demo_http.post("/v2/embed", json=body)
    response.raise_for_status()
    return response.json()


def test_basic_embed(demo_http, demo_model_name):
    body = {"model": demo_model_name, "texts": ["hello world"], "embedding_types": ["float"]}
    r = cohere_embed(demo_http, body)
    assert "embeddings" in r
    assert len(r["embeddings"]["float"]) == 1
    assert len(r["embeddings"]["float"][0]) > 0


def test_unsupported_input_type_rejected(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "input_type": "nonexistent_type",
        "texts": ["hello world"],
        "embedding_types": ["float"],
    }
    response = demo_http.post("/v2/embed", json=body)
    assert response.status_code == 400
    assert "Unsupported input_type" in response.json()["error"]["message"]


def test_v1_v2_parity(demo_http, demo_model_name):
    texts = ["hello world"]
    v2 = cohere_embed(
        demo_http, {"model": demo_model_name, "texts": texts, "embedding_types": ["float"]}
    )
    body = {"model": demo_model_name, "input": texts, "encoding_format": "float"}
    v1 = demo_http.post("/v1/embeddings", json=body).json()
    a, b = np.array(v2["embeddings"]["float"][0]), np.array(v1["data"][0]["embedding"])
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert cos > 0.9999, f"v1/v2 parity failed, cosine={cos}"


def test_embedding_types(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "texts": ["test"],
        "embedding_types": ["float", "binary", "ubinary"],
    }
    r = cohere_embed(demo_http, body)
    dim = len(r["embeddings"]["float"][0])
    assert len(r["embeddings"]["binary"][0]) == dim // 8
    assert len(r["embeddings"]["ubinary"][0]) == dim // 8


def test_response_structure(demo_http, demo_model_name):
    body = {"model": demo_model_name, "texts": ["test"], "embedding_types": ["float"]}
    r = cohere_embed(demo_http, body)
    assert "id" in r
    assert "embeddings" in r
    assert r["texts"] == ["test"]
    assert r["meta"]["api_version"]["version"] == "2"
    assert r["meta"]["tokens"]["input_tokens"] > 0


def test_batch(demo_http, demo_model_name):
    texts = ["apple", "banana", "cherry"]
    body = {"model": demo_model_name, "texts": texts, "embedding_types": ["float"]}
    r = cohere_embed(demo_http, body)
    assert len(r["embeddings"]["float"]) == 3
    dim = len(r["embeddings"]["float"][0])
    assert all(len(emb) == dim for emb in r["embeddings"]["float"])


def test_l2_normalized(demo_http, demo_model_name):
    body = {"model": demo_model_name, "texts": ["hello world"], "embedding_types": ["float"]}
    r = cohere_embed(demo_http, body)
    assert abs(float(np.linalg.norm(r["embeddings"]["float"][0])) - 1.0) < 0.01


def test_missing_input_returns_error(demo_http, demo_model_name):
    response = demo_http.post("/v2/embed", json={"model": demo_model_name})
    assert response.status_code == 400


def test_base64_embedding_type(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "texts": ["test encoding"],
        "embedding_types": ["float", "base64"],
    }
    r = cohere_embed(demo_http, body)
    float_emb = r["embeddings"]["float"][0]
    decoded = struct.unpack(f"<{len(float_emb)}f", base64.b64decode(r["embeddings"]["base64"][0]))
    np.testing.assert_allclose(float_emb, decoded, rtol=1e-5)


LONG_TEXT = " ".join(["word"] * 2000)  # 4001 demo tokens > 256


@pytest.mark.parametrize("truncate", ["END", "START"])
def test_truncate_succeeds(demo_http, demo_model_name, truncate):
    body = {
        "model": demo_model_name,
        "texts": [LONG_TEXT],
        "embedding_types": ["float"],
        "truncate": truncate,
    }
    r = cohere_embed(demo_http, body)
    assert len(r["embeddings"]["float"]) == 1


def test_truncate_none_rejects_long_input(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "texts": [LONG_TEXT],
        "embedding_types": ["float"],
        "truncate": "NONE",
    }
    assert demo_http.post("/v2/embed", json=body).status_code == 400


def test_truncate_start_vs_end_differ(demo_http, demo_model_name):
    start_words = " ".join(f"alpha{i}" for i in range(300))
    end_words = " ".join(f"omega{i}" for i in range(300))
    text = start_words + " " + end_words

    def embedding(truncate):
        body = {
            "model": demo_model_name,
            "texts": [text],
            "embedding_types": ["float"],
            "truncate": truncate,
        }
        return np.array(cohere_embed(demo_http, body)["embeddings"]["float"][0])

    end, start = embedding("END"), embedding("START")
    cos = float(end @ start / (np.linalg.norm(end) * np.linalg.norm(start)))
    assert cos < 0.99, f"START and END truncation gave the same embedding (cosine {cos})"
