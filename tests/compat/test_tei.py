"""TEI's documented calls against a live `boundgen serve` (demo model; `/predict` on the tiny
sequence classifier).

Sources (huggingface/text-embeddings-inference):
- `README.md` and `docs/source/en/quick_tour.md`: the curl calls to `/embed`, `/rerank`,
  `/predict` (single and batched) and `/v1/embeddings`;
- `docs/openapi.json`: request and response types of `/embed`, `/embed_all`, `/predict`,
  `/rerank`, `/similarity`, `/tokenize`, `/decode`, `/info`, and `ErrorResponse`
  (`peer_shapes.py`);
- `router/tests/test_http_rerank.rs` (commented out upstream): identical texts score the same and
  ties rank the higher index first (TEI sorts ascending, then reverses);
  `router/tests/test_http_predict.rs`: a batch's predictions equal the single requests'.

Adapted: the hidden size (the demo's 128) and the classifier's labels. TEI answers errors as
`{"error": "<message>", "error_type": "Validation" | "Empty" | ...}` with 422 for validation and
400 for empty input; the TEI routes keep that shape.
"""

from __future__ import annotations

import numpy as np
import pytest
from peer_shapes import Info, Prediction, Rank, SimpleToken, TeiError

EMBED_DIM = 128
SEQ_CLS_LABELS = {"LABEL_0", "LABEL_1", "LABEL_2"}


def post(http, route, body):
    response = http.post(route, json=body)
    response.raise_for_status()
    return response.json()


# ------------------------------------------------------------------------------------- /embed


def test_embed(demo_http):
    embeddings = post(demo_http, "/embed", {"inputs": "What is Deep Learning?"})
    assert len(embeddings) == 1 and len(embeddings[0]) == EMBED_DIM
    assert np.linalg.norm(embeddings[0]) == pytest.approx(1.0, abs=1e-3)  # normalize: true


def test_embed_batch(demo_http):
    embeddings = post(demo_http, "/embed", {"inputs": ["Today is a nice day", "I like you"]})
    assert len(embeddings) == 2 and all(len(e) == EMBED_DIM for e in embeddings)


def test_embed_matches_openai_route(demo_http):
    tei = post(demo_http, "/embed", {"inputs": ["I like you"]})
    openai = post(
        demo_http, "/v1/embeddings", {"input": ["I like you"], "encoding_format": "float"}
    )
    np.testing.assert_allclose(tei[0], openai["data"][0]["embedding"], rtol=1e-5, atol=1e-6)


def test_embed_all(demo_http, demo_tokenizer):
    text = "What is Deep Learning?"
    embeddings = post(demo_http, "/embed_all", {"inputs": text})
    assert len(embeddings) == 1
    assert len(embeddings[0]) == len(demo_tokenizer.encode(text))  # one vector per token
    assert all(len(v) == EMBED_DIM for v in embeddings[0])


def test_openai_embeddings_as_tei_documents_it(demo_http):
    """quick_tour.md: `/v1/embeddings` with TEI's model name; boundgen serves one model."""
    body = {
        "input": "What is Deep Learning?",
        "model": "text-embeddings-inference",
        "encoding_format": "float",
    }
    response = post(demo_http, "/v1/embeddings", body)
    assert len(response["data"]) == 1 and len(response["data"][0]["embedding"]) == EMBED_DIM


# ----------------------------------------------------------------------------------- /rerank


def test_rerank(demo_http):
    body = {
        "query": "What is Deep Learning?",
        "texts": ["Deep Learning is not...", "Deep learning is..."],
    }
    ranks = [Rank.model_validate(r) for r in post(demo_http, "/rerank", body)]
    assert sorted(r.index for r in ranks) == [0, 1]
    assert [r.score for r in ranks] == sorted((r.score for r in ranks), reverse=True)
    assert all(r.text is None for r in ranks)  # return_text defaults to false
    assert all(0.0 <= r.score <= 1.0 for r in ranks)  # raw_scores defaults to false


def test_rerank_identical_texts_tie_higher_index_first(demo_http):
    body = {"query": "test", "texts": ["test", "other", "test"], "return_text": True}
    ranks = [Rank.model_validate(r) for r in post(demo_http, "/rerank", body)]
    assert ranks[0].score == ranks[1].score
    assert {ranks[0].index, ranks[1].index} == {0, 2}
    assert ranks[0].index == 2 and ranks[1].index == 0
    assert [r.text for r in ranks] == [["test", "other", "test"][r.index] for r in ranks]


def test_rerank_raw_scores(demo_http):
    body = {
        "query": "What is Deep Learning?",
        "texts": ["Deep Learning is not...", "Deep learning is..."],
    }
    probs = {r["index"]: r["score"] for r in post(demo_http, "/rerank", body)}
    raw = {r["index"]: r["score"] for r in post(demo_http, "/rerank", {**body, "raw_scores": True})}
    for i, p in probs.items():
        assert 1 / (1 + np.exp(-raw[i])) == pytest.approx(p, abs=1e-5)


def test_rerank_empty_texts(demo_http):
    response = demo_http.post("/rerank", json={"query": "q", "texts": []})
    assert response.status_code == 400
    error = TeiError.model_validate(response.json())
    assert error.error_type == "Empty" and "`texts` cannot be empty" in error.error


# ---------------------------------------------------------------------- /predict (classifier)


def test_predict(seqcls_http):
    predictions = [
        Prediction.model_validate(p)
        for p in post(seqcls_http, "/predict", {"inputs": "I like you."})
    ]
    assert {p.label for p in predictions} == SEQ_CLS_LABELS
    scores = [p.score for p in predictions]
    assert scores == sorted(scores, reverse=True)
    assert sum(scores) == pytest.approx(1.0, abs=1e-5)


def test_predict_batch(seqcls_http):
    batch = post(seqcls_http, "/predict", {"inputs": [["I like you."], ["I hate pineapples"]]})
    assert len(batch) == 2
    single = post(seqcls_http, "/predict", {"inputs": "I like you."})
    # test_http_predict.rs: each prediction of the batch equals the single request's
    assert [p["label"] for p in batch[0]] == [p["label"] for p in single]
    assert [p["score"] for p in batch[0]] == pytest.approx([p["score"] for p in single], abs=1e-5)


# ------------------------------------------------------------------------------- /similarity


def test_similarity(demo_http):
    body = {
        "inputs": {
            "source_sentence": "What is Deep Learning?",
            "sentences": ["What is Machine Learning?", "What is Deep Learning?"],
        }
    }
    scores = post(demo_http, "/similarity", body)
    assert len(scores) == 2
    assert scores[1] == pytest.approx(1.0, abs=1e-4)  # the sentence itself: cosine 1


# ------------------------------------------------------------------- /tokenize, /decode, /info


def test_tokenize(demo_http, demo_tokenizer):
    text = "test"
    tokens = [
        SimpleToken.model_validate(t) for t in post(demo_http, "/tokenize", {"inputs": text})[0]
    ]
    assert [t.id for t in tokens] == demo_tokenizer.encode(text)
    assert "".join(text[t.start : t.stop] for t in tokens) == text


def test_decode(demo_http, demo_tokenizer):
    ids = demo_tokenizer.encode("Today is a nice day")
    assert post(demo_http, "/decode", {"ids": ids}) == ["Today is a nice day"]
    assert post(demo_http, "/decode", {"ids": [ids, ids]}) == ["Today is a nice day"] * 2


def test_info(demo_http, demo_model_name):
    response = demo_http.get("/info")
    response.raise_for_status()
    info = Info.model_validate(response.json())
    assert info.served_model_name == demo_model_name
    assert info.max_input_length == 256
