"""The peers' response types, as their tests validate replies (`Model.model_validate(body)`).

Written from the peers' protocol definitions (field names, types, required or default), not copied:
- vLLM `vllm/entrypoints/pooling/scoring/protocol.py` (ScoreResponse, RerankResponse),
  `.../classify/protocol.py`, `.../embed/protocol.py`, `.../pooling/protocol.py`, and
  `vllm/entrypoints/openai/engine/protocol.py` (UsageInfo);
- TEI `docs/openapi.json` (Rank, Prediction, SimpleToken, Info, ErrorResponse).

Unknown extra fields are allowed, as in the peers' models; a missing required field or a wrong
type fails validation, which is what "vLLM's own response model rejects the reply" means. Fields the
peers fill with a default factory (`id`, `created`) have a default here too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- vLLM ---
class UsageInfo(_Model):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class ScoreResponseData(_Model):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_Model):
    id: str = "generated"  # vLLM: a default factory ("embd-<uuid>", ...)
    object: str = "list"
    created: int = 0  # vLLM: a default factory (the time)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(_Model):
    text: str | None = None


class RerankResult(_Model):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Model):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Model):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(_Model):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Model):
    id: str = "generated"  # vLLM: a default factory ("embd-<uuid>", ...)
    object: str = "list"
    created: int = 0  # vLLM: a default factory (the time)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class EmbeddingResponseData(_Model):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_Model):
    id: str = "generated"  # vLLM: a default factory ("embd-<uuid>", ...)
    object: str = "list"
    created: int = 0  # vLLM: a default factory (the time)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(_Model):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(_Model):
    id: str = "generated"  # vLLM: a default factory ("embd-<uuid>", ...)
    object: str = "list"
    created: int = 0  # vLLM: a default factory (the time)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


# --- TEI ---
class Rank(_Model):
    index: int
    score: float
    text: str | None = None


class Prediction(_Model):
    label: str
    score: float


class SimpleToken(_Model):
    id: int
    text: str
    special: bool
    start: int | None = None
    stop: int | None = None


class Info(_Model):
    model_id: str
    model_dtype: str
    served_model_name: str
    model_type: dict  # one key: "classifier" | "embedding" | "reranker"
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str


class TeiError(_Model):
    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]
