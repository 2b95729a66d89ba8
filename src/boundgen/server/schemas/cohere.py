"""Cohere's `/v1|v2/rerank` (with vLLM's rerank fields; the same routes serve both) and
`/v1|v2/embed` (cohere-python `raw_base_client.py`, `v2/raw_client.py` and `types/`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from boundgen.server.schemas.common import (
    NO_MULTIMODAL,
    NO_PRIORITY,
    PositiveInt,
    Refused,
    TruncatePromptTokens,
    _Request,
)


class RerankDocument(BaseModel):
    """A document as Cohere v1 allows it: an object whose `text` (or `rank_fields`) is ranked and
    which comes back whole (e.g. with its `title`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    text: StrictStr | None = None


class RerankRequest(_Request):
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: Annotated[StrictInt, Field(ge=0)] | None = None  # 0 or absent: every document
    return_documents: StrictBool | None = None
    rank_fields: list[StrictStr] | None = None  # Cohere v1: fields of object documents, in order
    max_tokens_per_doc: StrictInt | None = None  # Cohere v2 / vLLM: a cut of each document
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM
    use_activation: StrictBool | None = None  # vLLM: false gives the relevance's logit

    UNSUPPORTED: ClassVar[Refused] = {
        "max_chunks_per_doc": (
            None,
            "documents are never chunked; cut them with max_tokens_per_doc",
        ),
        "priority": (0, NO_PRIORITY),
        "mm_processor_kwargs": (None, NO_MULTIMODAL),  # vLLM's
    }


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]
    meta: dict[str, Any]


EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
INPUT_TYPES = ("search_document", "search_query", "classification", "clustering")


class EmbedRequest(_Request):
    texts: list[StrictStr]
    input_type: StrictStr | None = None
    embedding_types: list[EmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: PositiveInt | None = None  # v2
    output_dimension: PositiveInt | None = None  # v2: the hidden size only

    UNSUPPORTED: ClassVar[Refused] = {
        "images": (None, NO_MULTIMODAL + ": embed `texts`"),
        "inputs": (None, NO_MULTIMODAL + ": embed `texts`"),
    }
