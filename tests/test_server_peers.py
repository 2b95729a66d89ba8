"""The peers' routes (issue 18) through TestClient on a tiny checkpoint: what the ported peer tests
in tests/compat/ do not pin down — exact cuts of documents, encodings byte for byte, refused fields,
TEI's error statuses, KServe's compressed bodies and statistics."""

from __future__ import annotations

import base64
import gzip
import json
import math
import zlib

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from boundgen.server import encodings
from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig

QUERY = "healthy food"
DOCS = ["green apples and fresh pears", "a fast red car", "salad"]


@pytest.fixture(scope="module")
def engine(engine_for):
    return engine_for("qwen2")


@pytest.fixture(scope="module")
def client(engine):
    config = ServerConfig(
        rerank_query_template="Query: {query}\n",
        rerank_document_template="Item: {document}\nRelevant:",
        embed_input_types=("search_query=query: ",),
    )
    with TestClient(create_app(engine, config)) as c:
        yield c


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def error(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---- relevance: rerank, vLLM score, TEI rerank share one computation ----------------------------


def test_rerank_relevance_is_the_templated_score(client, engine):
    labels = client.get("/v1/models").json()["data"][0]["rerank_label_token_ids"]
    want = engine.score(
        "Query: healthy food\n",
        [f"Item: {d}\nRelevant:" for d in DOCS],
        labels,
        apply_softmax=True,
    )
    out = ok(client.post("/v2/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 0}))
    assert len(out["results"]) == 3  # top_n 0: every document
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]][0], abs=1e-5)
    raw = ok(
        client.post("/rerank", json={"query": QUERY, "documents": DOCS, "use_activation": False})
    )
    for r in raw["results"]:  # the logit of P(first label) over the labels
        p = want[r["index"]][0]
        assert r["relevance_score"] == pytest.approx(math.log(p / (1 - p)), abs=1e-4)
    pairs = ok(client.post("/score", json={"text_1": QUERY, "text_2": DOCS}))
    assert [d["score"] for d in pairs["data"]] == pytest.approx([w[0] for w in want], abs=1e-5)
    tei = ok(client.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": False}))
    assert {r["index"]: r["score"] for r in tei} == pytest.approx(
        {i: w[0] for i, w in enumerate(want)}, abs=1e-5
    )


def test_max_tokens_per_doc_cuts_only_the_documents_own_tokens(client, engine):
    tok = engine.tokenizer
    body = {"query": QUERY, "documents": [DOCS[0]], "return_documents": True}
    full = ok(client.post("/v2/rerank", json=body))
    cut = ok(client.post("/v2/rerank", json={**body, "max_tokens_per_doc": 2}))
    doc_tokens = len(tok.encode(f"Item: {DOCS[0]}\nRelevant:")) - len(
        tok.encode("Item: \nRelevant:")
    )
    assert full["usage"]["prompt_tokens"] - cut["usage"]["prompt_tokens"] == pytest.approx(
        doc_tokens - 2, abs=1
    )
    assert cut["results"][0]["document"] == {"text": DOCS[0]}  # the document comes back whole
    # truncate_prompt_tokens: the whole pair cut to N tokens, the query and template kept
    n = full["usage"]["prompt_tokens"] - 3
    short = ok(client.post("/v2/rerank", json={**body, "truncate_prompt_tokens": n}))
    assert short["usage"]["prompt_tokens"] == n
    msg = error(client.post("/v2/rerank", json={**body, "truncate_prompt_tokens": 3}), 400)
    assert "query and template text alone take" in msg["message"]


def test_cohere_document_objects_rank_fields(client):
    docs = [{"title": "fruit", "text": DOCS[0]}, {"title": "cars", "text": DOCS[1]}]
    out = ok(client.post("/v1/rerank", json={"query": QUERY, "documents": docs}))
    assert {r["index"]: r["document"] for r in out["results"]} == dict(enumerate(docs))
    by_fields = ok(
        client.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": docs, "rank_fields": ["title", "text"]},
        )
    )
    assert by_fields["results"] != out["results"]  # "title: ...\ntext: ..." was ranked
    refused = {"query": QUERY, "documents": DOCS, "max_chunks_per_doc": 3}
    assert "max_chunks_per_doc" in error(client.post("/v1/rerank", json=refused), 400)["message"]
    priority = {"query": QUERY, "documents": DOCS, "priority": 2}
    assert "priority" in error(client.post("/v2/rerank", json=priority), 400)["message"]
    missing = {"query": QUERY, "documents": [{"title": "x"}]}
    assert "no `text`" in error(client.post("/v1/rerank", json=missing), 400)["message"]


def test_vllm_score_pairs_and_generative_labels(client, engine):
    labels = [5, 7]
    out = ok(
        client.post(
            "/v1/score",
            json={"queries": ["a b", "c d"], "documents": ["e", "f"], "label_token_ids": labels},
        )
    )
    for d, (q, doc) in zip(out["data"], [("a b", "e"), ("c d", "f")]):
        want = engine.score(q, [doc], labels, apply_softmax=True)[0][0]
        assert d["score"] == pytest.approx(want, abs=1e-5)
    bad = {"queries": ["a", "b"], "documents": ["x", "y", "z"]}
    assert "give one text in queries" in error(client.post("/score", json=bad), 400)["message"]
    unpaired = {"text_1": "a", "documents": ["x"]}
    assert "text_1 needs" in error(client.post("/score", json=unpaired), 400)["message"]


# ---- embeddings: encodings, truncation, Cohere ---------------------------------------------------


def test_embedding_encodings_byte_for_byte(client):
    body = {"input": ["hello world", "bye"], "normalize": False}
    floats = np.array(
        [d["embedding"] for d in ok(client.post("/v1/embeddings", json=body))["data"]]
    )
    for dtype, endianness in [("float16", "big"), ("bfloat16", "little"), ("float32", "big")]:
        fields = {"encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
        out = ok(client.post("/v1/embeddings", json={**body, **fields}))["data"]
        raw = [base64.b64decode(d["embedding"]) for d in out]
        assert raw == [encodings.raw_bytes(v, dtype, endianness) for v in floats]
    r = client.post("/v1/embeddings", json={**body, "encoding_format": "bytes"})
    meta = json.loads(r.headers["metadata"])
    assert [(m["start"], m["end"], m["shape"]) for m in meta["data"]] == [
        (0, floats.shape[1] * 4, [floats.shape[1]]),
        (floats.shape[1] * 4, floats.shape[1] * 8, [floats.shape[1]]),
    ]
    np.testing.assert_array_equal(np.frombuffer(r.content, "=f4").reshape(floats.shape), floats)
    only = client.post("/v1/embeddings", json={**body, "encoding_format": "bytes_only"})
    assert "metadata" not in only.headers and only.content == r.content
    float_dtype = {**body, "embed_dtype": "float16"}
    assert (
        "apply to encoding_format"
        in error(client.post("/v1/embeddings", json=float_dtype), 400)["message"]
    )
    clash = {**body, "use_activation": True}
    assert "disagree" in error(client.post("/v1/embeddings", json=clash), 400)["message"]


def test_bfloat16_rounds_to_nearest_even():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-9, -2.5], dtype=np.float32)
    bits = np.frombuffer(encodings.raw_bytes(x, "bfloat16", "little"), "<u2")
    got = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, [1.0, 1.0 + 2**-7, -2.5])


def test_bfloat16_bits_are_torchs():
    """The reply's bfloat16 bits are computed without torch (a frontend process has none): the
    same bits torch's conversion writes, for every kind of float32 (random bit patterns: normal,
    subnormal, infinite, NaN; ties; the largest)."""
    import torch

    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, 100_000, dtype=np.uint32).view(np.float32)
    largest = np.finfo(np.float32).max
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, largest, -largest, 1e-45, 1.00390625])
    normal = rng.standard_normal(10_000)
    x = np.concatenate([patterns, normal.astype(np.float32), special.astype(np.float32)])
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(encodings.bfloat16_bits(x), want)


def test_cohere_quantized_types():
    x = np.array([[0.5, -1.0, 0.25, 0.0, 1.0, -0.1, 0.2, 0.3, 0.9]], dtype=np.float32)
    out = encodings.cohere_embeddings(x, ["int8", "uint8", "ubinary", "binary", "base64"])
    assert out["int8"] == [[64, -127, 32, 0, 127, -13, 25, 38, 114]]
    assert out["uint8"] == [[v + 128 for v in out["int8"][0]]]
    assert out["ubinary"] == [[0b10101011, 0b10000000]]  # x > 0, first value in the high bit
    assert out["binary"] == [[0b10101011 - 128, 0]]
    assert np.frombuffer(base64.b64decode(out["base64"][0]), "<f4").tolist() == x[0].tolist()


def test_truncate_prompt_tokens_and_prefixes(client, engine):
    text = "one two three four five six seven eight"
    ids = engine.tokenizer.encode(text, add_special_tokens=True)
    for side, kept in (("right", ids[:3]), ("left", ids[-3:])):
        body = {"input": text, "truncate_prompt_tokens": 3, "truncation_side": side}
        out = ok(client.post("/v1/embeddings", json=body))
        assert out["usage"]["prompt_tokens"] == 3
        want = ok(client.post("/v1/embeddings", json={"input": [kept]}))
        assert out["data"][0]["embedding"] == want["data"][0]["embedding"]
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    too_far = {"input": text, "truncate_prompt_tokens": context + 1}
    assert (
        "Please request a smaller truncation size."
        in error(client.post("/v1/embeddings", json=too_far), 400)["message"]
    )
    # Cohere input_type: the server's prefix for it, before the text
    cohere = ok(client.post("/v2/embed", json={"texts": [text], "input_type": "search_query"}))
    plain = ok(client.post("/v1/embeddings", json={"input": ["query: " + text]}))
    np.testing.assert_allclose(
        cohere["embeddings"]["float"][0], plain["data"][0]["embedding"], atol=1e-6
    )


def test_chat_messages_are_refused_by_name(client):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for route in ("/v1/embeddings", "/pooling", "/tokenize"):
        assert "messages" in error(client.post(route, json=body), 400)["message"], route


# ---- TEI ----------------------------------------------------------------------------------------


def test_tei_errors_have_tei_types(client):
    r = client.post("/embed", json={"inputs": "x", "dimensions": 3})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation"
    r = client.post("/embed", json={"inputs": []})
    assert r.status_code == 400 and r.json() == {
        "error": "`inputs` cannot be empty",
        "error_type": "Empty",
    }
    r = client.post("/tokenize", json={"inputs": 3})  # TEI's /tokenize (shared path): TEI errors
    assert r.status_code == 422 and r.json()["error_type"] == "Validation"
    r = client.post("/embed", json={"inputs": "x", "prompt_name": "query"})
    assert r.status_code == 422 and "prompt_name" in r.json()["error"]
    r = client.post("/predict", json={"inputs": "x"})  # no classification head
    assert r.status_code == 422 and "classification head" in r.json()["error"]


def test_tei_embed_all_and_tokenize(client, engine):
    text = "hello big world"
    rows = ok(client.post("/embed_all", json={"inputs": [text, "hi"]}))
    want = engine.embed([text, "hi"], pooling="tokens")
    assert [len(r) for r in rows] == [len(w) for w in want]
    np.testing.assert_allclose(rows[0], want[0].numpy(), atol=1e-5)
    tokens = ok(client.post("/tokenize", json={"inputs": text}))[0]
    assert [t["id"] for t in tokens] == engine.tokenizer.encode(text, add_special_tokens=True)
    assert "".join(t["text"] for t in tokens if not t["special"]) == text


# ---- KServe: compressed bodies, statistics, unknown routes ---------------------------------------


def _infer_body() -> bytes:
    return json.dumps(
        {
            "inputs": [
                {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["q"]},
                {"name": "items", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
            ]
        }
    ).encode()


def test_kserve_compressed_bodies_and_statistics(client, engine):
    url = f"/v2/models/{engine.model_name}/infer"
    plain = ok(client.post(url, content=_infer_body()))["outputs"]
    for encoding, data in (
        ("gzip", gzip.compress(_infer_body())),
        ("deflate", zlib.compress(_infer_body())),
    ):
        r = client.post(url, content=data, headers={"content-encoding": encoding})
        assert ok(r)["outputs"] == plain, encoding
    r = client.post(url, content=b"not gzip", headers={"content-encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip" in r.json()["error"]
    r = client.post(url, content=b"x", headers={"content-encoding": "br"})
    assert r.status_code == 400 and "br" in r.json()["error"]
    stats = ok(client.get(f"/v2/models/{engine.model_name}/stats"))["model_stats"][0]
    assert stats["inference_count"] >= 3 and stats["inference_stats"]["fail"]["count"] >= 2
    phases = stats["inference_stats"]
    assert all(phases[p]["count"] == phases["success"]["count"] for p in ("queue", "compute_infer"))
    assert ok(client.get("/v2/models/stats"))["model_stats"][0]["name"] == engine.model_name
    unknown = client.get("/v2/models/nope/stats")
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": f"Request for unknown model: 'nope' is not found (this server serves "
        f"{engine.model_name!r})"
    }
    assert client.post("/v2/repository/index").json() == {
        "error": "no route POST /v2/repository/index"
    }


def test_kserve_body_inflating_past_the_limit_is_refused(engine):
    config = ServerConfig(max_body_bytes=4096)
    with TestClient(create_app(engine, config)) as c:
        bomb = gzip.compress(b" " * 100_000)  # ~100 bytes on the wire
        r = c.post(
            f"/v2/models/{engine.model_name}/infer",
            content=bomb,
            headers={"content-encoding": "gzip"},
        )
    assert r.status_code == 413 and "inflates past 4096 bytes" in r.json()["error"]
