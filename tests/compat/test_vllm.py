"""vLLM's own pooling-API tests, ported to a live `boundgen serve`.

Sources (vllm-project/vllm):
- `tests/entrypoints/pooling/scoring/test_cross_encoder_online.py` and
  `tests/entrypoints/pooling/score/test_online_rerank.py`, `.../score/test_online_score.py`:
  `/score` (text_1/text_2, queries/documents, queries/items, data_1/data_2), `/rerank`, top_n,
  max_model_len, truncation, use_activation, max_tokens_per_doc, `/pooling`;
- `tests/entrypoints/pooling/score/test_generative_scores_e2e.py` (the generative-scores branch):
  `/v1/score` with `label_token_ids` on a causal LM;
- `tests/entrypoints/pooling/classify/test_online.py`: `/classify`;
- `tests/entrypoints/pooling/embed/test_online.py`: `/v1/embeddings` extras;
- `tests/entrypoints/pooling/pooling/test_online.py`: `/pooling`;
- `tests/entrypoints/openai/test_tokenization.py`: `/tokenize`, `/detokenize`;
- response types: `vllm/entrypoints/pooling/scoring/protocol.py` and siblings (`peer_shapes.py`).

Adapted: model names and token ids; the context length (vLLM's servers run with
`--max-model-len 100` or 512, the demo model has 256, the tiny classifier 512); the embedding size
(384 → the demo's 128); the classifier's labels (`Default`/`Spoiled` → `LABEL_0..2`); the
reranker inputs: vLLM's cross-encoder ranks "capital of France" texts, the demo model was trained
on catalog queries and titles, so the query/documents are a held-out demo pair with the same
right/wrong order and the same thresholds (≥ 0.9, ≤ 0.01). vLLM's error `type` is
"BadRequestError"; boundgen's is "invalid_request_error" (both inside `{"error": {...}}`).
Not ported: chat `messages` inputs and `/invocations` (SageMaker), see docs/compat.md.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from peer_shapes import (
    ClassificationResponse,
    EmbeddingResponse,
    PoolingResponse,
    RerankResponse,
    ScoreResponse,
)

DEMO_CONTEXT = 256  # the demo model's max_position_embeddings (vLLM: --max-model-len 100)
SEQ_CLS_CONTEXT = 512  # the tiny classifier's (vLLM's classify test: --max-model-len 512)
EMBED_DIM = 128  # the demo model's hidden size (vLLM's e5-small: 384)
SEQ_CLS_LABELS = ["LABEL_0", "LABEL_1", "LABEL_2"]

# A held-out demo relevance group: one matching title, one hard negative, one other category.
QUERY = "best red sneakers by Astora"
RIGHT = "Astora Core sneakers, red, $999, Vienna"
WRONG = "Soldal Neo sneakers, red, $249, Rome"
OTHER = "Nimtra Max sofa, red, $1290, Madrid"
TEXTS_1 = [QUERY, "gray Solsen jackets"]
TEXTS_2 = [RIGHT, "Solsen One fleece jacket, grey, $15, Prague"]

input_text = "This product was excellent and exceeded my expectations"


@pytest.fixture(params=["/score", "/v1/score"])
def score_route(request):
    return request.param


@pytest.fixture(params=["/rerank", "/v1/rerank", "/v2/rerank"])
def rerank_route(request):
    return request.param


def rerank_relevance(demo_http, model, query, document):
    """The reference for a pair's /score: the server's own rerank relevance of that pair."""
    body = {"model": model, "query": query, "documents": [document]}
    return demo_http.post("/v1/rerank", json=body).json()["results"][0]["relevance_score"]


# ---------------------------------------------------------------------------------- /score


def check_scores(demo_http, model, response, pairs):
    response.raise_for_status()
    score = ScoreResponse.model_validate(response.json())
    assert score.id is not None
    assert score.data is not None
    assert len(score.data) == len(pairs)
    for i, (query, document) in enumerate(pairs):
        assert score.data[i].index == i
        want = rerank_relevance(demo_http, model, query, document)
        assert want == pytest.approx(score.data[i].score, rel=0.01)


@pytest.mark.parametrize(
    "fields",
    [("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2")],
)
def test_score_api_n_vs_n(demo_http, demo_model_name, score_route, fields):
    first, second = fields
    body = {"model": demo_model_name, first: TEXTS_1, second: TEXTS_2}
    response = demo_http.post(score_route, json=body)
    pairs = list(zip(TEXTS_1, TEXTS_2))
    check_scores(demo_http, demo_model_name, response, pairs)


def test_score_api_queries_str_1_documents_str_1(demo_http, demo_model_name, score_route):
    body = {"model": demo_model_name, "queries": QUERY, "documents": RIGHT}
    response = demo_http.post(score_route, json=body)
    check_scores(demo_http, demo_model_name, response, [(QUERY, RIGHT)])


def test_score_api_queries_str_1_documents_str_n(demo_http, demo_model_name, score_route):
    body = {"model": demo_model_name, "queries": QUERY, "documents": [WRONG, RIGHT]}
    response = demo_http.post(score_route, json=body)
    check_scores(demo_http, demo_model_name, response, [(QUERY, WRONG), (QUERY, RIGHT)])


def test_text_1_str_text_2_list(demo_http, demo_model_name, score_route):
    body = {"model": demo_model_name, "text_1": QUERY, "text_2": [WRONG, RIGHT]}
    response = demo_http.post(score_route, json=body)
    check_scores(demo_http, demo_model_name, response, [(QUERY, WRONG), (QUERY, RIGHT)])


def test_score_api_max_model_len(demo_http, demo_model_name, score_route):
    queries = "What is the capital of France?" * 20  # 340 demo tokens > 256
    body = {"model": demo_model_name, "queries": queries, "documents": [WRONG, RIGHT]}
    response = demo_http.post(score_route, json=body)
    assert response.status_code == 400
    assert "Please reduce the length of the input" in response.text
    body["truncate_prompt_tokens"] = DEMO_CONTEXT + 1
    response = demo_http.post(score_route, json=body)
    assert response.status_code == 400
    assert "Please request a smaller truncation size." in response.text


def test_score_use_activation(demo_http, demo_model_name, score_route):
    def get_outputs(use_activation):
        body = {"model": demo_model_name, "text_1": QUERY, "text_2": [WRONG, RIGHT]}
        if use_activation is not None:
            body["use_activation"] = use_activation
        response = demo_http.post(score_route, json=body)
        response.raise_for_status()
        return np.array([x["score"] for x in response.json()["data"]])

    default, w_activation = get_outputs(None), get_outputs(True)
    wo_activation = get_outputs(False)
    np.testing.assert_allclose(default, w_activation, atol=1e-2)
    assert not np.allclose(w_activation, wo_activation, atol=1e-2)
    np.testing.assert_allclose(1 / (1 + np.exp(-wo_activation)), w_activation, atol=1e-2)


# ---------------------------------------- /v1/score with label_token_ids (generative scores)


def test_generative_score_basic(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "queries": "Query: red Astora sneakers\n",
        "documents": [f"Item: {RIGHT}\nRelevant:", f"Item: {OTHER}\nRelevant:"],
        "label_token_ids": [299, 272],  # vLLM's test: 9454, 2753 (Qwen "Yes"/"No")
    }
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 200, f"Response: {response.text}"
    data = response.json()
    assert data["id"].startswith("score-")
    assert data["object"] == "list"
    assert {"model", "data", "usage"} <= data.keys()
    assert len(data["data"]) == 2
    for i, result in enumerate(data["data"]):
        assert result["index"] == i
        assert result["object"] == "score"
        assert 0.0 <= result["score"] <= 1.0


def test_generative_score_validation_empty_label_tokens(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "queries": "Test query",
        "documents": ["item1"],
        "label_token_ids": [],
    }
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 400
    assert "at least one token" in response.json()["error"]["message"].lower()


def test_generative_score_validation_invalid_token_id(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "queries": "Test query",
        "documents": ["item1"],
        "label_token_ids": [9999999999],
    }
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 400
    assert "out of vocabulary range" in response.json()["error"]["message"].lower()


# --------------------------------------------------------------------------------- /rerank


def rerank(demo_http, route, body):
    response = demo_http.post(route, json=body)
    response.raise_for_status()
    return RerankResponse.model_validate(response.json())


def test_rerank_texts(demo_http, demo_model_name, rerank_route):
    body = {"model": demo_model_name, "query": QUERY, "documents": [WRONG, RIGHT]}
    result = rerank(demo_http, rerank_route, body)
    assert result.id is not None
    assert result.results is not None
    assert len(result.results) == 2
    assert result.results[0].relevance_score >= 0.9
    assert result.results[1].relevance_score <= 0.01


def test_rerank_top_n(demo_http, demo_model_name, rerank_route):
    body = {
        "model": demo_model_name,
        "query": QUERY,
        "documents": [WRONG, RIGHT, OTHER],
        "top_n": 2,
    }
    result = rerank(demo_http, rerank_route, body)
    assert result.id is not None
    assert len(result.results) == 2
    assert result.results[0].relevance_score >= 0.9
    assert result.results[1].relevance_score <= 0.01


def test_rerank_top_n_zero_means_all(demo_http, demo_model_name, rerank_route):
    """vLLM's RerankRequest: `top_n: int = 0`, and 0 returns every document."""
    body = {
        "model": demo_model_name,
        "query": QUERY,
        "documents": [WRONG, RIGHT, OTHER],
        "top_n": 0,
    }
    response = demo_http.post(rerank_route, json=body)
    response.raise_for_status()
    assert len(response.json()["results"]) == 3


def test_rerank_max_model_len(demo_http, demo_model_name, rerank_route):
    body = {
        "model": demo_model_name,
        "query": "What is the capital of France?" * 100,
        "documents": [WRONG, RIGHT],
    }
    response = demo_http.post(rerank_route, json=body)
    assert response.status_code == 400
    assert "Please reduce the length of the input" in response.text


def test_rerank_use_activation(demo_http, demo_model_name, rerank_route):
    def get_outputs(use_activation):
        body = {"model": demo_model_name, "query": QUERY, "documents": [WRONG, RIGHT]}
        body["use_activation"] = use_activation
        response = demo_http.post(rerank_route, json=body)
        response.raise_for_status()
        return np.array([x["relevance_score"] for x in response.json()["results"]])

    default, w_activation = get_outputs(None), get_outputs(True)
    wo_activation = get_outputs(False)
    np.testing.assert_allclose(default, w_activation, atol=1e-2)
    assert not np.allclose(w_activation, wo_activation, atol=1e-2)
    np.testing.assert_allclose(1 / (1 + np.exp(-wo_activation)), w_activation, atol=1e-2)


def test_rerank_max_tokens_per_doc_reduces_tokens(demo_http, demo_model_name, rerank_route):
    long_doc = "The capital of France is Paris. " * 5
    base = {"model": demo_model_name, "query": QUERY, "documents": [long_doc]}
    no_limit = rerank(demo_http, rerank_route, base)
    with_limit = rerank(demo_http, rerank_route, {**base, "max_tokens_per_doc": 10})
    assert len(with_limit.results) == 1
    assert with_limit.usage.prompt_tokens > 0
    assert with_limit.usage.prompt_tokens < no_limit.usage.prompt_tokens


@pytest.mark.parametrize("value", [0, -5])
def test_rerank_max_tokens_per_doc_validation(demo_http, demo_model_name, rerank_route, value):
    body = {
        "model": demo_model_name,
        "query": "What is the capital of France?",
        "documents": ["The capital of France is Paris."],
        "max_tokens_per_doc": value,
    }
    response = demo_http.post(rerank_route, json=body)
    assert response.status_code == 400
    assert "max_tokens_per_doc must be a positive integer" in response.text


# ------------------------------------------------------------------------- /classify (seq-cls)


@pytest.fixture(params=["/v1/classify", "/classify"])
def classify_route(request):
    return request.param


def classify(seqcls_http, route, body):
    response = seqcls_http.post(route, json=body)
    response.raise_for_status()
    return ClassificationResponse.model_validate(response.json())


def test_classify_completion_request(
    seqcls_http, seqcls_model_name, seqcls_tokenizer, classify_route
):
    input_tokens = seqcls_tokenizer.encode(input_text)
    for value in (input_text, input_tokens):
        output = classify(seqcls_http, classify_route, {"model": seqcls_model_name, "input": value})
        assert output.object == "list"
        assert output.model == seqcls_model_name
        assert len(output.data) == 1
        assert hasattr(output.data[0], "label")
        assert hasattr(output.data[0], "probs")


def test_classify_completion_request_batched(
    seqcls_http, seqcls_model_name, seqcls_tokenizer, classify_route
):
    n = 10
    input_tokens = seqcls_tokenizer.encode(input_text)
    for value in ([input_text] * n, [input_tokens] * n):
        output = classify(seqcls_http, classify_route, {"model": seqcls_model_name, "input": value})
        assert len(output.data) == n
        for i, item in enumerate(output.data):
            assert item.index == i
            assert len(item.probs) == item.num_classes
            assert item.label in SEQ_CLS_LABELS


def test_classify_empty_input_error(seqcls_http, seqcls_model_name, classify_route):
    for value in ("", []):
        response = seqcls_http.post(
            classify_route, json={"model": seqcls_model_name, "input": value}
        )
        assert response.status_code == 400
        assert "error" in response.json()


def test_classify_add_special_tokens(seqcls_http, seqcls_model_name, classify_route):
    for add_special_tokens in (False, True):
        body = {
            "model": seqcls_model_name,
            "input": input_text,
            "add_special_tokens": add_special_tokens,
        }
        classify(seqcls_http, classify_route, body)


def test_classify_truncate_prompt_tokens(seqcls_http, seqcls_model_name):
    body = {"model": seqcls_model_name, "input": "hello " * 600, "truncate_prompt_tokens": 5}
    output = classify(seqcls_http, "/v1/classify", body)
    assert len(output.data) == 1
    assert output.data[0].index == 0
    assert output.usage.prompt_tokens == 5
    assert output.usage.total_tokens == 5
    body = {
        "model": seqcls_model_name,
        "input": "test",
        "truncate_prompt_tokens": SEQ_CLS_CONTEXT + 1,
    }
    response = seqcls_http.post("/v1/classify", json=body)
    assert response.status_code == 400
    assert "truncate_prompt_tokens" in response.json()["error"]["message"]


def test_classify_use_activation(seqcls_http, seqcls_model_name):
    def get_outputs(use_activation):
        body = {"model": seqcls_model_name, "input": input_text, "use_activation": use_activation}
        response = seqcls_http.post("/v1/classify", json=body)
        return np.array([x["probs"] for x in response.json()["data"]])

    default, w_activation = get_outputs(None), get_outputs(True)
    wo_activation = get_outputs(False)
    np.testing.assert_allclose(default, w_activation, atol=1e-2)
    assert not np.allclose(w_activation, wo_activation, atol=1e-2)
    softmax = np.exp(wo_activation) / np.exp(wo_activation).sum(-1, keepdims=True)
    np.testing.assert_allclose(softmax, w_activation, atol=1e-2)


# ---------------------------------------------------------------------------- /v1/embeddings


def embed(demo_http, body):
    response = demo_http.post("/v1/embeddings", json=body)
    response.raise_for_status()
    return response


def test_embedding_completion_request(demo_http, demo_model_name, demo_tokenizer):
    input_tokens = demo_tokenizer.encode(input_text)
    for value in (input_text, input_tokens):
        body = {"model": demo_model_name, "input": value, "encoding_format": "float"}
        embeddings = EmbeddingResponse.model_validate(embed(demo_http, body).json())
        assert len(embeddings.data) == 1
        assert len(embeddings.data[0].embedding) == EMBED_DIM
        assert embeddings.usage.completion_tokens == 0
        assert embeddings.usage.prompt_tokens == len(input_tokens)
        assert embeddings.usage.total_tokens == len(input_tokens)


def test_embedding_completion_request_batched(demo_http, demo_model_name, demo_tokenizer):
    n = 10
    input_tokens = demo_tokenizer.encode(input_text)
    for value in ([input_text] * n, [input_tokens] * n):
        body = {"model": demo_model_name, "input": value, "encoding_format": "float"}
        embeddings = EmbeddingResponse.model_validate(embed(demo_http, body).json())
        assert len(embeddings.data) == n
        assert len(embeddings.data[0].embedding) == EMBED_DIM
        assert embeddings.usage.prompt_tokens == len(input_tokens) * n
        assert embeddings.usage.total_tokens == len(input_tokens) * n


def test_embedding_truncate_prompt_tokens(demo_http, demo_model_name):
    text = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
    body = {"model": demo_model_name, "input": [text], "truncate_prompt_tokens": 10}
    embeddings = EmbeddingResponse.model_validate(embed(demo_http, body).json())
    assert len(embeddings.data) == 1
    assert embeddings.usage.prompt_tokens == 10
    assert embeddings.usage.total_tokens == 10
    body["truncate_prompt_tokens"] = DEMO_CONTEXT + 1
    response = demo_http.post("/v1/embeddings", json=body)
    assert response.status_code == 400
    assert "Please request a smaller truncation size." in response.json()["error"]["message"]


def test_base64_embedding(demo_http, demo_model_name):
    texts = [
        "Hello my name is",
        "The best thing about vLLM is that it supports many different models",
    ]
    floats = embed(
        demo_http, {"model": demo_model_name, "input": texts, "encoding_format": "float"}
    )
    b64 = embed(demo_http, {"model": demo_model_name, "input": texts, "encoding_format": "base64"})
    for f, b in zip(floats.json()["data"], b64.json()["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="float32")
        np.testing.assert_allclose(decoded, f["embedding"], rtol=1e-6)


@pytest.mark.parametrize("embed_dtype", ["float32", "float16", "bfloat16"])  # vLLM's EMBED_DTYPES
@pytest.mark.parametrize("endianness", ["native", "big", "little"])
def test_base64_embed_dtype_and_endianness(demo_http, demo_model_name, embed_dtype, endianness):
    texts = [input_text] * 3
    floats = embed(
        demo_http, {"model": demo_model_name, "input": texts, "encoding_format": "float"}
    )
    body = {
        "model": demo_model_name,
        "input": texts,
        "encoding_format": "base64",
        "embed_dtype": embed_dtype,
        "endianness": endianness,
    }
    b64 = embed(demo_http, body)
    order = {"native": "=", "big": ">", "little": "<"}[endianness]
    for f, b in zip(floats.json()["data"], b64.json()["data"]):
        raw = base64.b64decode(b["embedding"])
        if embed_dtype == "bfloat16":  # the high half of a float32
            halves = np.frombuffer(raw, dtype=f"{order}u2").astype(np.uint32) << 16
            decoded = halves.view(np.float32)
        else:
            decoded = np.frombuffer(raw, dtype=f"{order}{np.dtype(embed_dtype).char}")
        np.testing.assert_allclose(decoded.astype(np.float32), f["embedding"], atol=1e-2)


def test_bytes_embed(demo_http, demo_model_name):
    body = {"model": demo_model_name, "input": [input_text] * 3, "encoding_format": "bytes"}
    response = embed(demo_http, body)
    assert "metadata" in response.headers
    assert len(response.content) == 3 * EMBED_DIM * 4  # float32 by default


@pytest.mark.parametrize("param_name", ["encoding_format", "embed_dtype", "endianness"])
def test_embedding_params_not_supported(demo_http, demo_model_name, param_name):
    body = {
        "model": demo_model_name,
        "input": input_text,
        "encoding_format": "base64",
        param_name: f"bad_{param_name}",
    }
    response = demo_http.post("/v1/embeddings", json=body)
    assert response.status_code == 400
    assert "literal_error" in response.json()["error"]["message"]
    assert f"bad_{param_name}" in response.json()["error"]["message"]


def test_embedding_use_activation(demo_http, demo_model_name):
    def get_outputs(use_activation):
        body = {
            "model": demo_model_name,
            "input": input_text,
            "encoding_format": "float",
            "use_activation": use_activation,
        }
        return np.array([x["embedding"] for x in embed(demo_http, body).json()["data"]])

    default, w_normal = get_outputs(None), get_outputs(True)
    wo_normal = get_outputs(False)
    np.testing.assert_allclose(default, w_normal, atol=1e-2)
    assert not np.allclose(w_normal, wo_normal, atol=1e-2)
    normalized = wo_normal / np.linalg.norm(wo_normal, axis=-1, keepdims=True)
    np.testing.assert_allclose(w_normal, normalized, atol=1e-2)


def test_embedding_messages_rejected_clearly(demo_http, demo_model_name):
    """vLLM embeds chat `messages` through a chat template; the demo model has none, so boundgen
    refuses them by name (docs/compat.md)."""
    body = {"model": demo_model_name, "messages": [{"role": "user", "content": "hi"}]}
    response = demo_http.post("/v1/embeddings", json=body)
    assert response.status_code == 400
    assert "messages" in response.json()["error"]["message"]


# --------------------------------------------------------------------------------- /pooling


def test_pooling_embed(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "input": input_text,
        "encoding_format": "float",
        "task": "embed",
    }
    response = demo_http.post("/pooling", json=body)
    poolings = PoolingResponse.model_validate(response.json())
    assert len(poolings.data) == 1
    assert len(poolings.data[0].data) == EMBED_DIM


def test_pooling_classify(seqcls_http, seqcls_model_name):
    body = {
        "model": seqcls_model_name,
        "input": input_text,
        "encoding_format": "float",
        "task": "classify",
    }
    response = seqcls_http.post("/pooling", json=body)
    poolings = PoolingResponse.model_validate(response.json())
    assert len(poolings.data) == 1
    assert len(poolings.data[0].data) == len(SEQ_CLS_LABELS)


def test_pooling_completion_request_batched(demo_http, demo_model_name, demo_tokenizer):
    n = 10
    input_tokens = demo_tokenizer.encode(input_text)
    for value in ([input_text] * n, [input_tokens] * n):
        body = {
            "model": demo_model_name,
            "input": value,
            "encoding_format": "float",
            "task": "embed",
        }
        response = demo_http.post("/pooling", json=body)
        response.raise_for_status()
        poolings = PoolingResponse.model_validate(response.json())
        assert poolings.id is not None
        assert len(poolings.data) == n
        assert poolings.usage.completion_tokens == 0
        assert poolings.usage.prompt_tokens == len(input_tokens) * n
        assert poolings.usage.total_tokens == len(input_tokens) * n


def test_pooling_token_embed(demo_http, demo_model_name, demo_tokenizer):
    body = {
        "model": demo_model_name,
        "input": input_text,
        "encoding_format": "float",
        "task": "token_embed",
    }
    response = demo_http.post("/pooling", json=body)
    poolings = PoolingResponse.model_validate(response.json())
    assert len(poolings.data) == 1
    assert len(poolings.data[0].data) == len(demo_tokenizer.encode(input_text))
    assert len(poolings.data[0].data[0]) == EMBED_DIM


@pytest.mark.parametrize("task", ["token_classify", "plugin"])
def test_pooling_not_supported(demo_http, demo_model_name, task):
    body = {"model": demo_model_name, "input": "test", "encoding_format": "float", "task": task}
    response = demo_http.post("/pooling", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(f"Unsupported task: {task!r}")


# ----------------------------------------------------------------- /tokenize, /detokenize


def test_basic_tokenize(demo_http, demo_model_name, demo_tokenizer):
    response = demo_http.get("/v1/models")
    assert response.json()["data"][0]["id"] == demo_model_name
    response = demo_http.post("/tokenize", json={"model": demo_model_name, "prompt": input_text})
    assert response.json()["tokens"] == demo_tokenizer.encode(input_text)


def test_tokenize_completions(demo_http, demo_model_name, demo_tokenizer):
    for add_special in (False, True):
        prompt = "vllm1 This is a test prompt."
        tokens = demo_tokenizer.encode(prompt, add_special_tokens=add_special)
        body = {"add_special_tokens": add_special, "model": demo_model_name, "prompt": prompt}
        response = demo_http.post("/tokenize", json=body)
        response.raise_for_status()
        result = response.json()
        assert result["tokens"] == tokens
        assert result["count"] == len(tokens)
        assert result["max_model_len"] == DEMO_CONTEXT
        assert result["token_strs"] is None


def test_tokenize_with_return_token_strs(demo_http, demo_model_name, demo_tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    body = {"prompt": prompt, "model": demo_model_name, "return_token_strs": True}
    response = demo_http.post("/tokenize", json=body)
    response.raise_for_status()
    tokens = demo_tokenizer.encode(prompt, add_special_tokens=True)
    result = response.json()
    assert result["tokens"] == tokens
    assert result["count"] == len(tokens)
    assert result["max_model_len"] == DEMO_CONTEXT
    assert result["token_strs"] == demo_tokenizer.convert_ids_to_tokens(tokens)


def test_detokenize(demo_http, demo_model_name, demo_tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = demo_tokenizer.encode(prompt, add_special_tokens=False)
    response = demo_http.post("/detokenize", json={"model": demo_model_name, "tokens": tokens})
    response.raise_for_status()
    assert response.json() == {"prompt": prompt}
