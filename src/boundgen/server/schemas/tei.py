"""text-embeddings-inference's routes (TEI `docs/openapi.json`): `/embed`, `/embed_all`, `/rerank`
(`{query, texts}`), `/predict`, `/similarity`, `/tokenize` (`{inputs}`), `/decode`. Replies are
bare JSON arrays, built in `server/tei.py`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, StrictBool, StrictStr

from boundgen.server.schemas.common import PositiveInt, Prompt, Refused, TokenIds, _Request

Direction = Literal["Right", "Left", "right", "left"]
NO_PROMPTS = "this server has no prompts configured (TEI's --default-prompt-name)"


class EmbedRequest(_Request):
    inputs: Prompt
    normalize: StrictBool = True
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"
    dimensions: PositiveInt | None = None

    UNSUPPORTED: ClassVar[Refused] = {"prompt_name": (None, NO_PROMPTS)}


class EmbedAllRequest(_Request):
    inputs: Prompt
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"

    UNSUPPORTED: ClassVar[Refused] = {"prompt_name": (None, NO_PROMPTS)}


class RerankRequest(_Request):
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"


class PredictRequest(_Request):
    inputs: StrictStr | list[StrictStr] | list[list[StrictStr]]
    raw_scores: StrictBool = False
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"


class SimilarityInputs(BaseModel):
    model_config = _Request.model_config
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityRequest(_Request):
    inputs: SimilarityInputs
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"

    UNSUPPORTED: ClassVar[Refused] = {"prompt_name": (None, NO_PROMPTS)}


class TokenizeRequest(_Request):
    inputs: StrictStr | list[StrictStr]
    add_special_tokens: StrictBool = True

    UNSUPPORTED: ClassVar[Refused] = {"prompt_name": (None, NO_PROMPTS)}


class DecodeRequest(_Request):
    ids: TokenIds | list[TokenIds]
    skip_special_tokens: StrictBool = True
