"""Request-size limits and body parsing: every bad request ends here as a 400/413 with a clear
message."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from boundgen.server.config import ServerConfig
from boundgen.server.errors import BadRequest, TooLarge

M = TypeVar("M", bound=BaseModel)

_MAX_ERRORS = 3
_MAX_INPUT_ECHO = 60


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_n = int(declared)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if declared_n > max_bytes:
            raise TooLarge(
                f"request body is {declared_n} bytes; the limit is {max_bytes} "
                "(server option max_body_bytes)"
            )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(
                    f"request body exceeds {max_bytes} bytes (server option max_body_bytes)"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequest("client disconnected while sending the body") from None
    return b"".join(chunks)


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:_MAX_ERRORS]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or "body"
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            parts.append(f"body is not valid JSON: {ctx}".rstrip(": "))
            continue
        if err.get("type") == "missing":
            parts.append(f"{loc}: field required")
            continue
        given = err.get("input")
        echo = repr(given)
        if len(echo) > _MAX_INPUT_ECHO:
            echo = echo[:_MAX_INPUT_ECHO] + "..."
        # pydantic's error type in brackets, as vLLM's messages carry it ([literal_error])
        parts.append(f"{loc}: {msg} [{err.get('type')}] (got {type(given).__name__} {echo})")
    more = exc.error_count() - _MAX_ERRORS
    if more > 0:
        parts.append(f"and {more} more errors")
    return "; ".join(dict.fromkeys(parts))


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member tried into the location (`query.str`, `items.list[str]`).
    return isinstance(part, str) and (
        part in ("str", "int", "bool", "float")
        or "[" in part
        or part.startswith("function-")
        or part[:1].isupper()
    )


def parse_json(body: bytes, model: type[M]) -> M:
    if not body.strip():
        raise BadRequest(f"request body is empty; expected a JSON object for {model.__name__}")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from None
    except (RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


async def parse_request(request: Request, model: type[M], config: ServerConfig) -> M:
    return parse_json(await read_body(request, config.max_body_bytes), model)


class Limits:
    """Checks that depend on the model (vocabulary, context length) and on the server config."""

    def __init__(self, config: ServerConfig, vocab_size: int, max_positions: int | None):
        self.config = config
        self.vocab_size = vocab_size
        self.max_positions = max_positions

    def count(self, what: str, n: int, limit: int, option: str) -> None:
        if n == 0:
            raise BadRequest(f"{what} is empty")
        if n > limit:
            raise TooLarge(f"{what} has {n} entries; the limit is {limit} (option {option})")

    def token_ids(self, what: str, ids: list[int]) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):  # C loops: the common case
            return
        bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
        raise BadRequest(
            f"{what} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
        )

    def tokens(self, what: str, n: int, limit: int, option: str) -> None:
        if n == 0:
            raise BadRequest(f"{what} has no tokens")
        if n > limit:
            raise TooLarge(f"{what} has {n} tokens; the limit is {limit} (server option {option})")

    def context(self, what: str, n: int) -> None:
        if self.max_positions and n > self.max_positions:
            raise BadRequest(
                f"{what} needs {n} positions; the model's context is "
                f"{self.max_positions} (max_position_embeddings). Please reduce the length of "
                "the input."  # vLLM's words, which its clients' users look for
            )
