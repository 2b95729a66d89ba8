"""SGLang's own `/v1/score` and `/v1/rerank` tests, ported to a live `boundgen serve` (demo model).

Sources (sgl-project/sglang):
- `test/registered/openai_server/basic/test_openai_server.py`: `TestOpenAIV1Score`,
  `TestOpenAIV1Rerank` (HTTP, `requests.post`);
- `test/srt/test_score_api.py`: `TestScoreAPI` (the same cases through `Engine.score`; here over
  HTTP, since `/v1/score` is that call);
- `test/registered/openai_server/basic/test_serving_rerank.py`: top_n / return_documents cases of
  `_build_rerank_response`;
- `python/sglang/test/runners.py`: `TEST_RERANK_QUERY_DOCS`.

Adapted: the model name (the served id) and label token ids (SGLang's Qwen " Yes"/" No" 9454/2753 →
the demo tokenizer's " yes"/" no"). Errors are SGLang's flat `ErrorResponse` (`{"object": "error",
"message", "type": "BadRequestError", "param": null, "code": 400}`), read as SGLang's tests read
them. The numerical comparison with transformers is in `test_sglang_score_hf.py`.
"""

from __future__ import annotations

import httpx
import pytest

LABELS = [299, 272]  # " yes", " no" in the demo tokenizer (SGLang's test: 9454, 2753 for Qwen)

# python/sglang/test/runners.py
TEST_RERANK_QUERY_DOCS = [
    {
        "query": "How many people live in Berlin?",
        "documents": ["Berlin is well known for its museums."],
    },
    {
        "query": "How many people live in Berlin?",
        "documents": [
            "Berlin had a population of 3,520,031 registered inhabitants in an area of "
            "891.82 square kilometers.",
            "Berlin is well known for its museums.",
        ],
    },
]


@pytest.fixture
def run_score(demo_http, demo_model_name):
    """TestOpenAIV1Score.run_score: POST /v1/score, the JSON reply whatever the status."""

    def run(query, items, label_token_ids, apply_softmax=False, item_first=False):
        body = {
            "model": demo_model_name,
            "query": query,
            "items": items,
            "label_token_ids": label_token_ids,
            "apply_softmax": apply_softmax,
            "item_first": item_first,
        }
        return demo_http.post("/v1/score", json=body).json()

    return run


def assert_probability_rows(response, n_items, n_labels):
    assert "error" not in response, response
    assert "scores" in response, "Response should have a 'scores' field"
    assert isinstance(response["scores"], list), "scores should be a list"
    assert len(response["scores"]) == n_items, "Number of scores should match number of items"
    for i, score_list in enumerate(response["scores"]):
        assert isinstance(score_list, list), f"Score {i} should be a list"
        assert len(score_list) == n_labels, f"Score {i} length should match label_token_ids"
        assert all(isinstance(v, float) for v in score_list), f"Score {i} values should be floats"
        assert sum(score_list) == pytest.approx(1.0, abs=1e-6), f"Score {i} should sum to 1"


def assert_score_usage(response):
    assert "usage" in response, "Response should have a 'usage' field"
    assert response["usage"]["prompt_tokens"] > 0
    assert response["usage"]["prompt_tokens"] == response["usage"]["total_tokens"]
    assert response["usage"]["completion_tokens"] == 0, "completion_tokens should be 0"


# ---------------------------------------------------------------- TestOpenAIV1Score (HTTP)


def test_score_text_input(run_score, demo_tokenizer):
    query = "The capital of France is"
    items = ["Paris", "London", "Berlin"]
    label_token_ids = []
    for item in items:
        token_ids = demo_tokenizer.encode(item, add_special_tokens=False)
        assert token_ids, f"Failed to encode item: {item}"
        label_token_ids.append(token_ids[0])
    response = run_score(query, items, label_token_ids, apply_softmax=True)
    assert_probability_rows(response, len(items), len(label_token_ids))
    assert_score_usage(response)


def test_score_token_input(run_score, demo_tokenizer):
    query = "The capital of France is"
    items = ["Paris", "London", "Berlin"]
    query_ids = demo_tokenizer.encode(query, add_special_tokens=False)
    item_ids = [demo_tokenizer.encode(item, add_special_tokens=False) for item in items]
    label_token_ids = [ids[0] for ids in item_ids if ids]
    response = run_score(query_ids, item_ids, label_token_ids, apply_softmax=True)
    assert_probability_rows(response, len(items), len(label_token_ids))
    assert_score_usage(response)


def test_score_error_handling(demo_http, demo_model_name):
    body = {
        "model": demo_model_name,
        "query": "The capital of France is",
        "items": ["Paris", "London", "Berlin"],
        "label_token_ids": [999999],
        "apply_softmax": True,
    }
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 400
    error_response = response.json()
    assert error_response["type"] == "BadRequestError"
    assert "Token ID 999999 is out of vocabulary" in error_response["message"]


# SGLang's `ErrorResponse` (python/sglang/srt/entrypoints/openai/protocol.py), as
# `serving_base.create_error_response` fills it for a bad request
SGLANG_ERROR_KEYS = {"object", "message", "type", "param", "code"}


def assert_sglang_error(response, status=400, type_="BadRequestError"):
    body = response.json()
    assert response.status_code == status, body
    assert set(body) == SGLANG_ERROR_KEYS, body
    assert (body["object"], body["type"], body["param"], body["code"]) == (
        "error",
        type_,
        None,
        status,
    )
    return body["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"query": "q", "items": ["a"], "label_token_ids": [999999]},  # the model refuses it
        {"query": "q", "items": ["a"]},  # validation: a field missing
        {"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"},
    ],
    ids=["model", "missing-field", "wrong-type"],
)
def test_score_errors_are_sglangs_flat_object(demo_http, body):
    assert_sglang_error(demo_http.post("/v1/score", json=body))


def test_score_error_of_a_vllm_body_stays_vllms(demo_http):
    """`/v1/score` with vLLM's fields is vLLM's route: its nested error object."""
    body = {"queries": "q", "documents": ["a"], "label_token_ids": [999999]}
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 400
    assert set(response.json()["error"]) >= {"message", "type", "code"}


def test_rerank_errors_are_sglangs_flat_object(sglang_rerank_server):
    response = httpx.post(sglang_rerank_server.url + "/v1/rerank", json={"query": "q"}, timeout=120)
    assert "documents" in assert_sglang_error(response)


# ---------------------------------------------------- TestScoreAPI (test/srt/test_score_api.py)


def test_score_consistency_empty_item(run_score, demo_tokenizer):
    """test_score_consistency's "default case"; the HF numbers are checked in
    test_sglang_score_hf.py, here the shape and the [0, 1] range as SGLang asserts them."""
    label_token_ids = [
        demo_tokenizer.encode(t, add_special_tokens=False)[0] for t in (" to", " the")
    ]
    response = run_score("I pledge allegiance", ["", " to"], label_token_ids, apply_softmax=True)
    assert_probability_rows(response, 2, 2)
    assert all(0 <= v <= 1 for row in response["scores"] for v in row)


def test_score_consistency_item_first(run_score, demo_tokenizer):
    label_token_ids = [
        demo_tokenizer.encode(t, add_special_tokens=False)[0] for t in (" to", " the")
    ]
    response = run_score(
        " is a city", ["Tokyo", "Japan"], label_token_ids, apply_softmax=True, item_first=True
    )
    assert_probability_rows(response, 2, 2)
    assert all(0 <= v <= 1 for row in response["scores"] for v in row)


@pytest.mark.parametrize("batch_size", [1, 2, 4, 8])
def test_score_batch_handling(run_score, batch_size):
    label_token_ids = [1, 2, 3]
    texts = [f"test {i}" for i in range(batch_size)]
    response = run_score("The test was", texts, label_token_ids, apply_softmax=True)
    assert_probability_rows(response, batch_size, len(label_token_ids))


def test_multi_item_scoring_basic(run_score):
    query = "What is the capital of California? Answer Yes or No for each of the following options:"
    items = ["Sacramento", "San Jose", "San Francisco"]
    response = run_score(query, items, LABELS, apply_softmax=True)
    assert_probability_rows(response, len(items), len(LABELS))
    assert all(score >= 0 for row in response["scores"] for score in row)


def test_multi_item_scoring_consistency(run_score):
    items = ["Option A", "Option B", "Option C"]
    scores1 = run_score("Choose the best option:", items, [1, 2, 3], apply_softmax=True)["scores"]
    scores2 = run_score("Choose the best option:", items, [1, 2, 3], apply_softmax=True)["scores"]
    assert len(scores1) == len(scores2)
    for s1, s2 in zip(scores1, scores2):
        assert s1 == pytest.approx(s2, abs=1e-6)


@pytest.mark.parametrize(
    "items",
    [["Single item"], ["Item 1", "Item 2"], ["A", "B", "C", "D"], ["X", "Y", "Z", "W", "V", "U"]],
)
def test_multi_item_scoring_different_sizes(run_score, items):
    response = run_score("Rate each option:", items, [1, 2, 3, 4, 5], apply_softmax=True)
    assert_probability_rows(response, len(items), 5)


def test_multi_item_scoring_empty_items(run_score):
    response = run_score("Test query", [], [1, 2], apply_softmax=True)
    assert response["scores"] == [], "Should return empty list for empty items"


def test_multi_item_scoring_single_item(run_score):
    response = run_score(
        "Complete this sentence: The capital of France is", ["Paris"], [1, 2, 3], True
    )
    assert_probability_rows(response, 1, 3)


@pytest.mark.parametrize(
    "query",
    [
        "Is this true?",
        "Choose the correct answer:",
        "What is the best option?",
        "Select all that apply:",
        "",
    ],
)
def test_multi_item_scoring_different_queries(run_score, query):
    response = run_score(query, ["Yes", "No"], [1, 2], apply_softmax=True)
    assert_probability_rows(response, 2, 2)


@pytest.mark.parametrize("label_token_ids", [[1, 2], [1, 2, 3, 4], [1], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_multi_item_scoring_different_label_tokens(run_score, label_token_ids):
    response = run_score("Choose the best option:", ["Option A", "Option B"], label_token_ids, True)
    assert_probability_rows(response, 2, len(label_token_ids))


def test_multi_item_scoring_without_softmax(run_score):
    items = ["Good", "Bad", "Neutral"]
    response = run_score("Rate each option:", items, [1, 2, 3], apply_softmax=False)
    assert len(response["scores"]) == len(items)
    for score_list in response["scores"]:
        assert len(score_list) == 3
        assert all(isinstance(score, (int, float)) for score in score_list)


def test_multi_item_scoring_large_batch(run_score):
    items = [f"Item {i}" for i in range(20)]
    response = run_score("Classify each item:", items, [1, 2, 3], apply_softmax=True)
    assert_probability_rows(response, 20, 3)


def test_multi_item_scoring_unicode(run_score):
    response = run_score("选择最佳选项：", ["选项A", "选项B", "选项C"], [1, 2, 3], True)
    assert_probability_rows(response, 3, 3)


@pytest.mark.parametrize(
    "bad",
    [{"label_token_ids": "invalid"}, {"items": None}],
    ids=["label_token_ids-not-a-list", "items-none"],
)
def test_multi_item_scoring_error_handling(demo_http, bad):
    """The engine raises ValueError/TypeError; over HTTP that is a 400 naming the field."""
    body = {"query": "Test query", "items": ["Item 1", "Item 2"], "label_token_ids": [1, 2]}
    response = demo_http.post("/v1/score", json={**body, **bad, "apply_softmax": True})
    assert next(iter(bad)) in assert_sglang_error(response)


# ---------------------------------------------------------------- TestOpenAIV1Rerank (HTTP)


def run_rerank(server, query, docs, **extra):
    return httpx.post(
        server.url + "/v1/rerank", json={"query": query, "documents": docs, **extra}, timeout=120
    ).json()


def test_rerank_single(sglang_rerank_server):
    case = TEST_RERANK_QUERY_DOCS[0]
    response = run_rerank(sglang_rerank_server, case["query"], case["documents"])
    assert len(response) == 1
    assert isinstance(response[0]["score"], float)
    assert isinstance(response[0]["document"], str)
    assert isinstance(response[0]["index"], int)


def test_rerank_batch(sglang_rerank_server):
    case = TEST_RERANK_QUERY_DOCS[1]
    response = run_rerank(sglang_rerank_server, case["query"], case["documents"])
    assert len(response) == 2
    for result in response:
        assert isinstance(result["score"], float)
        assert isinstance(result["document"], str)
        assert isinstance(result["index"], int)


# test_serving_rerank.py checks these on `_build_rerank_response` with fixed scores; over HTTP
# the scores come from the model, so the checks are on order, count and the document field.


def test_rerank_sorted_descending_with_documents(sglang_rerank_server):
    response = run_rerank(sglang_rerank_server, "q", ["a", "b", "c"], return_documents=True)
    assert sorted(r["index"] for r in response) == [0, 1, 2]
    scores = [r["score"] for r in response]
    assert scores == sorted(scores, reverse=True)
    assert [r["document"] for r in response] == [["a", "b", "c"][r["index"]] for r in response]


def test_rerank_return_documents_false(sglang_rerank_server):
    response = run_rerank(sglang_rerank_server, "q", ["a", "b", "c"], return_documents=False)
    assert [r["document"] for r in response] == [None, None, None]


def test_rerank_top_n(sglang_rerank_server):
    full = run_rerank(sglang_rerank_server, "q", ["a", "b", "c"], return_documents=True)
    top = run_rerank(sglang_rerank_server, "q", ["a", "b", "c"], return_documents=True, top_n=2)
    assert len(top) == 2
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]


def test_rerank_top_n_greater_than_total(sglang_rerank_server):
    response = run_rerank(sglang_rerank_server, "q", ["a", "b"], return_documents=True, top_n=10)
    assert len(response) == 2


def test_rerank_top_n_with_return_documents_false(sglang_rerank_server):
    response = run_rerank(
        sglang_rerank_server, "q", ["a", "b", "c"], return_documents=False, top_n=1
    )
    assert len(response) == 1
    assert response[0]["document"] is None
