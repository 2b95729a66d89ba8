"""OpenAI `/v1/embeddings`, with vLLM's extras (`truncate_prompt_tokens`, `use_activation`,
`embed_dtype`, `endianness`, `encoding_format: "bytes"`) and boundgen's (`pooling`, `normalize`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, StrictBool, StrictStr

from boundgen.server.schemas.common import (
    NO_CHAT,
    NO_MULTIMODAL,
    NO_PRIORITY,
    PositiveInt,
    Prompt,
    Refused,
    TruncatePromptTokens,
    Usage,
    _Request,
)

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16"]
Endianness = Literal["native", "big", "little"]


class EmbeddingsRequest(_Request):
    input: Prompt
    encoding_format: EncodingFormat = "float"
    dimensions: PositiveInt | None = None
    user: StrictStr | None = None
    # vLLM
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    truncation_side: Literal["left", "right"] = "right"
    add_special_tokens: StrictBool = True
    use_activation: StrictBool | None = None  # vLLM's name for `normalize`
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    # boundgen
    pooling: Literal["last", "mean"] | None = None
    normalize: StrictBool | None = None

    UNSUPPORTED: ClassVar[Refused] = {
        "messages": (None, NO_CHAT + "`input`"),
        "priority": (0, NO_PRIORITY),
        "mm_processor_kwargs": (None, NO_MULTIMODAL),
    }


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage
