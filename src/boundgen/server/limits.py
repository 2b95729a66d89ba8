"""Request-size limits and body parsing: every bad request ends here as a 400/413 with a clear
message, each limit checked before the work it bounds.

A body's size and arrival are checked before it is read whole (`guard.py`). Parsing then costs at
most what `JsonBounds` allows: the number of JSON arrays and objects is counted in the raw bytes
before parsing (building one costs ~1 µs of GIL time, so a megabyte of `[1],` would stall the
server for half a second), duplicate keys and NaN/Infinity are refused while parsing, and every
list's length is checked before pydantic validates its elements.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from boundgen.server.config import ServerConfig
from boundgen.server.errors import BadRequest, TooLarge

M = TypeVar("M", bound=BaseModel)

_MAX_ERRORS = 3
_MAX_INPUT_ECHO = 60


@dataclass(frozen=True)
class JsonBounds:
    """What a request body may hold: `containers` JSON arrays + objects in all, `list_entries`
    entries in any one array."""

    containers: int
    list_entries: int

    @classmethod
    def for_server(cls, config: ServerConfig, max_items: int) -> JsonBounds:
        """A request needs about one array per item (its token ids) and a few more; its longest
        list is its items, or the token ids of its query, an item or its labels."""
        longest = max(
            max_items, config.max_query_tokens, config.max_item_tokens, config.max_label_tokens
        )
        return cls(4 * max_items + 64, longest)


async def read_body(request: Request) -> bytes:
    """The body, which the guard has already read whole within its limits."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise BadRequest("client disconnected while sending the body") from None


def load_json(body: bytes, bounds: JsonBounds) -> Any:
    """Parse `body` within `bounds`: 413 when it holds too many arrays and objects (counted before
    parsing) or a list too long; 400 on bad JSON, a duplicate key, NaN or Infinity."""
    containers = body.count(b"[") + body.count(b"{")  # brackets in strings count too: an overcount
    if containers > bounds.containers:
        raise TooLarge(
            f"request body holds {containers} JSON arrays and objects; the limit is "
            f"{bounds.containers} (4 per item of max_items, and 64)"
        )
    try:
        fast = _fast_loads(body, bounds.list_entries)
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    if fast is not None:
        return fast
    try:
        text = body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); json.loads would pass surrogates
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Refused as exc:
        raise BadRequest(str(exc)) from None
    except (RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    try:
        _check_values(value, bounds.list_entries, "body", bool(_SURROGATE_ESCAPE.search(text)))
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    return value


def _fast_loads(body: bytes, limit: int) -> Any | None:
    """The body parsed by orjson (~3x json's speed on token-id bodies) with every list at most
    `limit` long (413), or None where json's path must decide: any backslash (escapes: lone
    surrogates, escaped quotes), anything orjson refuses (bad JSON, NaN/Infinity: json's messages
    say why), any float (orjson reads an integer beyond 64 bits as one, json as an int), or a
    duplicate key — orjson keeps the last, so the strings are counted: without escapes every `"`
    opens or closes a key or a string value, and a duplicate leaves fewer keys parsed than the
    body holds."""
    if b"\\" in body:
        return None
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    strings = _scan(value, limit, "body")
    if strings is None or body.count(b'"') != 2 * strings:
        return None
    return value


def _scan(value: Any, limit: int, where: str) -> int | None:
    """`_check_values`'s list lengths, and the keys and string values in `value` counted, in one
    walk; None when it holds a float."""
    kind = type(value)
    if kind is str:
        return 1
    if kind is float:
        return None
    if kind is dict:
        n = len(value)
        for k, v in value.items():
            if type(v) in _SCAN:
                inner = _scan(v, limit, k if where == "body" else f"{where}.{k}")
                if inner is None:
                    return None
                n += inner
        return n
    if kind is not list:
        return 0
    if len(value) > limit:
        _too_long(where, len(value), limit)
    kinds = set(map(type, value))  # at C speed: most lists are flat token ids
    if not kinds & _SCAN:
        return 0
    if float in kinds:
        return None
    if kinds == _LIST and max(map(len, value)) <= limit:
        # lists of token-id lists (a request's items): their elements' kinds in one C pass
        inner = set(map(type, chain.from_iterable(value)))
        if not inner & _SCAN:
            return 0
    n = 0
    for i, v in enumerate(value):
        if type(v) in _SCAN:
            inner = _scan(v, limit, f"{where}[{i}]")
            if inner is None:
                return None
            n += inner
    return n


class _Refused(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {key[:_MAX_INPUT_ECHO]!r} in a JSON object")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _check_values(value: Any, limit: int, where: str, strings: bool) -> None:
    """Every list at most `limit` long (413); with `strings`, every string valid Unicode (400:
    JSON's `\\ud800` escapes make lone surrogates, which no tokenizer takes)."""
    kind = type(value)
    if kind is list:
        if len(value) > limit:
            _too_long(where, len(value), limit)
        kinds = set(map(type, value))  # at C speed: most lists are flat token ids
        if kinds & _NESTED or (strings and str in kinds):
            for i, v in enumerate(value):
                if type(v) in _NESTED or (strings and type(v) is str):
                    _check_values(v, limit, f"{where}[{i}]", strings)
    elif kind is dict:
        for k, v in value.items():
            if type(v) in _NESTED or (strings and type(v) is str):
                _check_values(v, limit, k if where == "body" else f"{where}.{k}", strings)
    elif kind is str and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(
                f"{where}: a string holds a lone surrogate (\\ud800-\\udfff)"
            ) from None


def _too_long(where: str, n: int, limit: int) -> None:
    raise TooLarge(
        f"{where} has {n} entries; no list in a request may have more than {limit} (server "
        "options max_items and max_*_tokens)"
    )


_NESTED = frozenset({list, dict})
_SCAN = frozenset({list, dict, str, float})
_LIST = {list}
# a \uD800-\uDFFF escape: only then can a parsed string hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:_MAX_ERRORS]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or "body"
        msg = err.get("msg", "invalid")
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

    def _in_vocab(self, ids: list[int]) -> bool:
        return not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)  # C loops

    def token_ids(self, what: str, ids: list[int]) -> None:
        if self._in_vocab(ids):  # the common case
            return
        bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
        raise BadRequest(
            f"{what} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
        )

    def many_token_ids(self, what: str, seqs: list[list[int]]) -> None:
        """`token_ids` of every list in `seqs` (named `what[i]`), the common case in C loops over
        all of them. Only the range: the request's schema made them lists of strict ints, and the
        workload checks types again on a CPU worker (`workloads.inputs`). With the types scanned
        here too a W5 request's check took the event loop 85.5 µs, the range alone 51.1
        (development machine, BENCHMARKS.md)."""
        try:
            if self._in_vocab(list(chain.from_iterable(seqs))):
                return
        except TypeError:  # a caller that skipped the schema: a 400, not a 500
            raise BadRequest(f"{what} must be lists of token ids") from None
        for i, ids in enumerate(seqs):
            self.token_ids(f"{what}[{i}]", ids)

    def tokens(self, what: str, n: int, limit: int, option: str) -> None:
        if n == 0:
            raise BadRequest(f"{what} has no tokens")
        if n > limit:
            raise TooLarge(f"{what} has {n} tokens; the limit is {limit} (server option {option})")

    def request_tokens(self, n: int) -> None:
        """The tokens a request has the model process, within `max_request_tokens` (413)."""
        limit = self.config.max_request_tokens
        if n > limit:
            raise TooLarge(
                f"request has {n} tokens for the model; the limit is {limit} (server option "
                "max_request_tokens)"
            )

    def context(self, what: str, n: int) -> None:
        if self.max_positions and n > self.max_positions:
            raise BadRequest(
                f"{what} needs {n} positions; the model's context is "
                f"{self.max_positions} (max_position_embeddings). Please reduce the length of "
                "the input."  # vLLM's words, which its clients' users look for
            )
