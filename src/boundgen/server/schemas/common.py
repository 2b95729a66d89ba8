"""What every peer's request and response types share."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

TokenIds = list[StrictInt]
TimeoutMs = Annotated[StrictInt, Field(ge=1)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
# One text or token-id list, or a batch of either (OpenAI's `input`, TEI's `inputs`).
Prompt = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
# vLLM: keep this many tokens of each prompt; -1: the model's context.
TruncatePromptTokens = Annotated[StrictInt, Field(ge=-1)]

# Fields the peer defines that boundgen refuses: field → (the value that means "not used", why any
# other is refused), checked before validation (`bodies.parse`).
Refused = dict[str, tuple[Any, str]]
NO_CHAT = "chat `messages` are not supported: the served checkpoints have no chat template; send "
NO_PRIORITY = "no priority scheduling (requests run in arrival order); omit it or send 0"
NO_MULTIMODAL = "text models only"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    timeout_ms: TimeoutMs | None = None

    UNSUPPORTED: ClassVar[Refused] = {}


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None
