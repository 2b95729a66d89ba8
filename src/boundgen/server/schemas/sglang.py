"""SGLang: `/v1/score` and the reply of its `/v1/rerank` (`--rerank-v1-format sglang`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from boundgen.server.schemas.common import TokenIds, Usage, _Request


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


class RerankResult(BaseModel):
    """One entry of SGLang's `/v1/rerank` reply (a JSON list of these, best first)."""

    score: float
    document: str | None
    index: int
