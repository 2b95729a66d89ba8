"""vLLM's pooling API: `/score` (and `/v1/score` with these fields), `/classify`, `/pooling`,
`/tokenize`, `/detokenize` (vllm `entrypoints/pooling/*/protocol.py`, `entrypoints/openai`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, StrictBool, StrictInt, StrictStr

from boundgen.server.schemas.common import (
    NO_CHAT,
    NO_MULTIMODAL,
    NO_PRIORITY,
    PositiveInt,
    Prompt,
    Refused,
    TokenIds,
    TruncatePromptTokens,
    Usage,
    _Request,
)
from boundgen.server.schemas.openai import EmbedDType, EncodingFormat, Endianness

_POOLING_UNSUPPORTED: Refused = {
    "messages": (None, NO_CHAT + "`input`"),
    "priority": (0, NO_PRIORITY),
    "mm_processor_kwargs": (None, NO_MULTIMODAL),
}

Texts = StrictStr | list[StrictStr]

# vLLM's pairs of fields, first → second: the first is one text (scored against every second) or as
# many texts as the second.
SCORE_PAIRS = {"queries": ("documents", "items"), "text_1": ("text_2",), "data_1": ("data_2",)}


class ScoreRequest(_Request):
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    label_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    use_activation: StrictBool | None = None

    UNSUPPORTED: ClassVar[Refused] = {
        "priority": (0, NO_PRIORITY),
        "mm_processor_kwargs": (None, NO_MULTIMODAL),
    }


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class ClassifyRequest(_Request):
    input: Prompt
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    truncation_side: Literal["left", "right"] = "right"
    add_special_tokens: StrictBool = True
    use_activation: StrictBool | None = None  # false: logits instead of probabilities

    UNSUPPORTED: ClassVar[Refused] = _POOLING_UNSUPPORTED


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


class PoolingRequest(_Request):
    input: Prompt
    task: StrictStr | None = None  # embed | token_embed | classify (default: the model's)
    encoding_format: EncodingFormat = "float"
    dimensions: PositiveInt | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    truncation_side: Literal["left", "right"] = "right"
    add_special_tokens: StrictBool = True
    use_activation: StrictBool | None = None
    normalize: StrictBool | None = None
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"

    UNSUPPORTED: ClassVar[Refused] = _POOLING_UNSUPPORTED


class TokenizeRequest(_Request):
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    UNSUPPORTED: ClassVar[Refused] = {"messages": (None, NO_CHAT + "`prompt`")}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    tokens: TokenIds
