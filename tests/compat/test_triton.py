"""Triton's HTTP client examples against a live `boundgen serve` (KServe v2 routes, demo model).

Sources (triton-inference-server/client):
- `src/python/examples/simple_http_health_metadata.py`: liveness, readiness, metadata with query
  parameters, the error for an unknown model;
- `src/python/examples/simple_http_infer_client.py`: infer with binary and JSON tensors,
  `request_compression_algorithm` / `response_compression_algorithm`, `get_inference_statistics`,
  the error for an unknown model;
- `src/python/examples/simple_http_string_infer_client.py`: BYTES tensors;
- `src/python/library/tritonclient/http/_utils.py` `_get_error`: an error body is
  `{"error": "<message>"}`, read as the exception's message.

Adapted: the model ("simple", INT32 INPUT0/INPUT1 → sum/difference) → boundgen's score task
(BYTES `query` + `items` → FP32 `scores`); the server name ("triton" → "boundgen").
"""

from __future__ import annotations

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

QUERY = b"Query: best red sneakers by Astora\n"
ITEMS = [
    b"Item: Astora Core sneakers, red, $999, Vienna\nRelevant:",
    b"Item: Soldal Neo sneakers, red, $249, Rome\nRelevant:",
]


@pytest.fixture(scope="module")
def triton_client(demo_server):
    return httpclient.InferenceServerClient(url=demo_server.url.removeprefix("http://"))


def score_inputs(binary_query: bool, binary_items: bool):
    query = httpclient.InferInput("query", [1], "BYTES")
    query.set_data_from_numpy(np.array([QUERY], dtype=object), binary_data=binary_query)
    items = httpclient.InferInput("items", [len(ITEMS)], "BYTES")
    items.set_data_from_numpy(np.array(ITEMS, dtype=object), binary_data=binary_items)
    return [query, items]


def test_health_metadata(triton_client, demo_model_name):
    assert triton_client.is_server_live(query_params={"test_1": 1, "test_2": 2})
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready(demo_model_name)
    assert triton_client.get_server_metadata()["name"] == "boundgen"
    metadata = triton_client.get_model_metadata(
        demo_model_name, query_params={"test_1": 1, "test_2": 2}
    )
    assert metadata["name"] == demo_model_name


def test_metadata_of_unknown_model(triton_client):
    with pytest.raises(InferenceServerException) as raised:
        triton_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in raised.value.message()


def infer_scores(client, model, *, requested_outputs: bool, **kwargs):
    outputs = (
        [httpclient.InferRequestedOutput("scores", binary_data=True)] if requested_outputs else None
    )
    return client.infer(
        model,
        score_inputs(binary_query=False, binary_items=True),
        outputs=outputs,
        query_params={"test_1": 1, "test_2": 2},
        **kwargs,
    ).as_numpy("scores")


@pytest.mark.parametrize("requested_outputs", [True, False])
def test_infer(triton_client, demo_model_name, requested_outputs):
    scores = infer_scores(triton_client, demo_model_name, requested_outputs=requested_outputs)
    assert scores.shape == (len(ITEMS), 2)
    np.testing.assert_allclose(scores.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_response_compression(triton_client, demo_model_name, algorithm):
    plain = infer_scores(triton_client, demo_model_name, requested_outputs=True)
    compressed = infer_scores(
        triton_client,
        demo_model_name,
        requested_outputs=True,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_allclose(compressed, plain, rtol=1e-6)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_request_compression(triton_client, demo_model_name, algorithm):
    plain = infer_scores(triton_client, demo_model_name, requested_outputs=True)
    compressed = infer_scores(
        triton_client,
        demo_model_name,
        requested_outputs=True,
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_allclose(compressed, plain, rtol=1e-6)


@pytest.mark.parametrize("binary", [False, True])
def test_string_infer(triton_client, demo_model_name, binary):
    """simple_http_string_infer_client.py: BYTES inputs as JSON or binary, outputs both ways."""
    result = triton_client.infer(
        demo_model_name,
        score_inputs(binary_query=binary, binary_items=binary),
        outputs=[httpclient.InferRequestedOutput("scores", binary_data=binary)],
    )
    scores = result.as_numpy("scores")
    assert scores.dtype == np.float32 and scores.shape == (len(ITEMS), 2)
    assert scores[0, 0] > scores[1, 0]  # the matching title is the more relevant


def test_inference_statistics(triton_client, demo_model_name):
    infer_scores(triton_client, demo_model_name, requested_outputs=True)
    statistics = triton_client.get_inference_statistics(model_name=demo_model_name)
    assert len(statistics["model_stats"]) == 1
    stats = statistics["model_stats"][0]
    assert stats["name"] == demo_model_name
    assert stats["inference_count"] >= 1
    assert stats["inference_stats"]["success"]["count"] >= 1


def test_infer_with_wrong_model_name(triton_client):
    with pytest.raises(InferenceServerException) as raised:
        triton_client.infer("wrong_model_name", score_inputs(False, True))
    assert raised.value.message().startswith("Request for unknown model")


def test_unknown_v2_route_error_is_readable(triton_client):
    """`get_model_repository_index` is a Triton extension boundgen does not serve."""
    with pytest.raises(InferenceServerException) as raised:
        triton_client.get_model_repository_index()
    message = raised.value.message()
    assert isinstance(message, str)
    assert "/v2/repository/index" in message
