"""boundgen's own `/v1/beam`: bounded beam search, optionally constrained to a trie's item IDs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from boundgen.server.schemas.common import TokenIds, Usage, _Request


class BeamRequest(_Request):
    # boundgen's own route, so no client's extras to tolerate: an unknown field is refused
    model_config = ConfigDict(extra="forbid", strict=True)

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
