"""A real `boundgen serve` subprocess on 127.0.0.1 (free port, API key on): every endpoint over
HTTP, the official openai / cohere / tritonclient clients unchanged, and a graceful SIGTERM drain
(last test)."""

from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from boundgen import Trie
from boundgen.server.testing import ServeProcess, tiny_model_dir

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TRIE_SEQS = [[5, 6, 7], [5, 6, 8], [5, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    model = tiny_model_dir(root)
    trie = root / "catalog.jsonl"
    Trie.from_sequences(TRIE_SEQS, item_ids=["a", "b", "c", "d"]).save(trie)
    proc = ServeProcess(
        "--model",
        str(model),
        "--api-key",
        KEY,
        "--tries",
        f"catalog={trie}",
        "--device",
        "cpu",
        "--drain-timeout-s",
        "60",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def test_every_endpoint_over_http(server, http):
    name = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post(
        "/v1/score",
        json={
            "query": "user likes",
            "items": [" shoes", " hats"],
            "label_token_ids": [1, 2],
            "apply_softmax": True,
        },
    )
    assert r.status_code == 200 and len(r.json()["scores"]) == 2, r.text
    r = http.post("/v1/rerank", json={"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
    r = http.post("/v1/embeddings", json={"input": ["a", "b"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
    r = http.post("/v1/classify", json={"input": "a"})  # a causal LM: clear 400
    assert r.status_code == 400 and "classification head" in r.json()["error"]["message"]
    r = http.post(
        "/v1/beam", json={"prompt": [1, 2], "beam_width": 4, "steps": 3, "trie": "catalog"}
    )
    assert r.status_code == 200, r.text
    assert {x["item_id"] for x in r.json()["results"]} <= {"a", "b", "c", "d"}
    r = http.post(
        f"/v2/models/{name}/infer",
        json={
            "inputs": [
                {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["q"]},
                {"name": "items", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
            ]
        },
    )
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 2], r.text
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get(f"/v2/models/{name}").json()["name"] == name
    assert http.get("/health").json() == {"status": "ok"}
    metrics = http.get("/metrics").text
    assert 'boundgen_requests_total{endpoint="score",status="200"}' in metrics
    assert "boundgen_runtime_node_seconds_bucket" in metrics


def test_api_key_required(server):
    r = httpx.post(
        server.url + "/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [1]}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client(server, http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    name = http.get("/v1/models").json()["data"][0]["id"]
    assert [m.id for m in client.models.list()] == [name]
    default = client.embeddings.create(
        model=name, input=["hello world", "bye"]
    )  # base64 on the wire
    floats = client.embeddings.create(
        model=name, input=["hello world", "bye"], encoding_format="float"
    )
    assert len(default.data) == 2 and default.usage.prompt_tokens > 0
    np.testing.assert_allclose(default.data[0].embedding, floats.data[0].embedding, rtol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=name, input="x", dimensions=3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").embeddings.create(
            model=name, input="x"
        )


def test_cohere_client(server):
    cohere = pytest.importorskip("cohere")
    docs = ["green salad", "fast car", "fresh fruit"]
    v2 = cohere.ClientV2(api_key=KEY, base_url=server.url).rerank(
        model="m", query="healthy food", documents=docs, top_n=2
    )
    v1 = cohere.Client(api_key=KEY, base_url=server.url).rerank(
        model="m", query="healthy food", documents=docs, top_n=2
    )
    assert len(v2.results) == 2
    assert [r.index for r in v2.results] == [r.index for r in v1.results]
    assert v2.results[0].relevance_score >= v2.results[1].relevance_score


def test_tritonclient(server, http):
    th = pytest.importorskip("tritonclient.http")
    name = http.get("/v1/models").json()["data"][0]["id"]
    client = th.InferenceServerClient(url=server.url.removeprefix("http://"))

    def auth():  # tritonclient writes its own headers into the dict it is given
        return dict(AUTH)

    assert client.is_server_live(headers=auth()) and client.is_server_ready(headers=auth())
    assert client.is_model_ready(name, headers=auth())
    assert client.get_model_metadata(name, headers=auth())["name"] == name

    def inputs(binary: bool):
        q = th.InferInput("query", [1], "BYTES")
        q.set_data_from_numpy(np.array([b"healthy food"], dtype=object), binary_data=binary)
        it = th.InferInput("items", [3], "BYTES")
        it.set_data_from_numpy(np.array([b"a", b"b", b"c"], dtype=object), binary_data=binary)
        return [q, it]

    binary = client.infer(name, inputs(True), headers=auth()).as_numpy("scores")  # binary both ways
    as_json = client.infer(
        name,
        inputs(False),
        headers=auth(),
        outputs=[th.InferRequestedOutput("scores", binary_data=False)],
    ).as_numpy("scores")
    assert binary.shape == (3, 2)
    np.testing.assert_allclose(binary, as_json, rtol=1e-6)
    np.testing.assert_allclose(binary.sum(-1), 1.0, rtol=1e-5)
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope", headers=auth())


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_sigterm_drains_in_flight_requests(server):
    """Last test: SIGTERM while requests run; every admitted request still gets its 200, then
    exit 0. A burst that ends before a poll sees it in flight (its searches take tens of ms; a poll
    under load as long) is sent again: the server is only signalled with requests in flight."""
    body = {"prompt": list(range(1, 481)), "beam_width": 64, "steps": 16}
    done_metric = r'boundgen_requests_total\{endpoint="beam",status="200"\}'

    def call() -> tuple[int, float]:
        r = httpx.post(server.url + "/v1/beam", json=body, headers=AUTH, timeout=120)
        return r.status_code, time.monotonic()

    def caught_in_flight(poll: httpx.Client, before: float, n: int) -> bool:
        """Wait until all `n` requests were admitted (SIGTERM closes connections whose request the
        server has not read yet, as any server does) while one still runs; False once all ended."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                text = poll.get("/metrics").text
            except httpx.HTTPError:
                continue
            inflight = _metric(text, "boundgen_inflight")
            done = _metric(text, done_metric) - before
            if inflight >= 1 and inflight + done >= n:
                return True
            if done >= n:
                return False
        return False

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as poll:
        for _ in range(5):
            before = _metric(poll.get("/metrics").text, done_metric)
            with cf.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(call) for _ in range(6)]
                if caught_in_flight(poll, before, len(futures)):
                    signaled = time.monotonic()
                    server.proc.send_signal(signal.SIGTERM)
                    results = [f.result(timeout=120) for f in futures]
                    break
                assert [f.result(timeout=120)[0] for f in futures] == [200] * 6
        else:
            pytest.fail("no burst of 6 searches was seen in flight by a poll of /metrics")
    assert [code for code, _ in results] == [200] * 6
    assert any(done > signaled for _, done in results), "nothing was in flight at SIGTERM"
    code, log = server.stop(timeout_s=60)
    # uvicorn re-raises the captured SIGTERM after a clean shutdown, so the exit status is -SIGTERM
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log and "Traceback" not in log, log
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
