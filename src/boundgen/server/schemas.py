"""Request/response types of the HTTP API, in the shapes users' clients already speak.

- `/v1/score`: SGLang `ScoringRequest`/`ScoringResponse`.
- `/v1/rerank`, `/v2/rerank`: Cohere / vLLM rerank.
- `/v1/classify`: vLLM / SGLang classify.
- `/v1/embeddings`: OpenAI embeddings.
- `/v1/beam`: boundgen's bounded beam search.
- `/v2/models/{name}/infer`: KServe v2 (JSON + Triton binary tensor extension), parsed in
  `kserve.py`.

Requests ignore unknown fields (clients send extras such as `user`), but known fields are strictly
typed: no silent coercion of `"1"` to `1` or `1` to `true`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TokenIds = list[StrictInt]
TimeoutMs = Annotated[StrictInt, Field(ge=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    timeout_ms: TimeoutMs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


# --- /v1/score (SGLang) ---
class ScoreRequest(_Request):
    query: StrictStr | TokenIds
    items: StrictStr | list[StrictStr] | list[TokenIds]
    label_token_ids: list[StrictInt] = Field(min_length=1)
    apply_softmax: StrictBool = False
    item_first: StrictBool = False


class ScoreResponse(BaseModel):
    scores: list[list[float]]
    model: str
    usage: Usage
    object: Literal["scoring"] = "scoring"


# --- /v1/rerank (Cohere v1/v2, vLLM) ---
class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: StrictStr


class RerankRequest(_Request):
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: Annotated[StrictInt, Field(ge=0)] | None = None
    return_documents: StrictBool | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]
    meta: dict[str, Any]


# --- /v1/classify (vLLM / SGLang) ---
class ClassifyRequest(_Request):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage


# --- /v1/embeddings (OpenAI) ---
class EmbeddingsRequest(_Request):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: StrictStr | None = None
    # boundgen extensions
    pooling: Literal["last", "mean"] | None = None
    normalize: StrictBool | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


# --- /v1/beam (boundgen) ---
class BeamRequest(_Request):
    prompt: StrictStr | TokenIds
    beam_width: Annotated[StrictInt, Field(ge=1)]
    steps: Annotated[StrictInt, Field(ge=1)]
    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    trie: StrictStr | None = None


class BeamResult(BaseModel):
    tokens: list[int]
    score: float
    item_id: Any = None  # the trie's item id of these tokens (with a trie)


class BeamResponse(BaseModel):
    object: Literal["beam"] = "beam"
    model: str
    results: list[BeamResult]
    usage: Usage
