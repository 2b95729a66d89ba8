"""Live servers for the peers' ported tests (issue 18).

One `boundgen serve` per kind for the whole session (each start costs ~8 s on the CPU):
- `demo_server`: `boundgen serve` with no `--model` (the shipped demo model, its `catalog` trie),
  exactly what a new user starts;
- `seqcls_server`: a tiny `*ForSequenceClassification` checkpoint with 3 labels, for classify;
- `sglang_rerank_server`: the demo model with `/v1/rerank` answering in SGLang's shape
  (`--rerank-v1-format sglang`; SGLang and Cohere both own `/v1/rerank` with the same request
  fields, so only the server can choose).

Assertions are kept as the peers wrote them; what boundgen does differently is in docs/compat.md.
The one strict xfail left is transformers' `AutoTokenizer` on the demo directory (docs/compat.md,
section "transformers"): it fails once transformers loads the shipped tokenizer.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from boundgen.demo import default_model_path
from boundgen.server.testing import ServeProcess, tiny_model_dir

SEQ_CLS_LABELS = 3


@pytest.fixture(scope="session")
def demo_server():
    server = ServeProcess()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seqcls_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("compat-models"), seq_cls=SEQ_CLS_LABELS)


@pytest.fixture(scope="session")
def seqcls_server(seqcls_dir):
    server = ServeProcess("--model", str(seqcls_dir), "--device", "cpu")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_rerank_server():
    server = ServeProcess("--rerank-v1-format", "sglang")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_http(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def seqcls_http(seqcls_server):
    with httpx.Client(base_url=seqcls_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def demo_model_name(demo_http):
    """The served model id; the peers' tests send their own model name here."""
    return demo_http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def seqcls_model_name(seqcls_http):
    return seqcls_http.get("/v1/models").json()["data"][0]["id"]


def fast_tokenizer(model_dir):
    """The checkpoint's own tokenizer.json in transformers' fast tokenizer, the one the server
    runs. (`AutoTokenizer` on the demo directory builds a `Qwen2Tokenizer` with Qwen2's split
    rules instead: see test_sglang_score_hf.py.)"""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def demo_tokenizer():
    return fast_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def seqcls_tokenizer(seqcls_dir):
    return fast_tokenizer(seqcls_dir)
