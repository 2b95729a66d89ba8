"""Request bodies in, JSON replies out: what every handler module shares.

Bodies are read once into a dict, so a route several peers share can pick the peer's type from the
fields sent (`/v1/score`, `/rerank`, `/tokenize`) and a refused field is named before validation
(a chat `messages` body is "messages: not supported", not "input: field required").
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import fields, json
from boundgen.server.errors import BadRequest
from boundgen.server.handler_state import HandlerState
from boundgen.server.limits import JsonBounds, describe_validation_error, load_json, read_body
from boundgen.server.schemas.common import _Request

M = TypeVar("M", bound=_Request)


async def read_object(request: Request, state: HandlerState) -> dict[str, Any]:
    """The body as a JSON object (400 for anything else)."""
    body = await read_body(request)  # the guard has read it whole, within max_body_bytes
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    # bounded before parsing (containers counted), strict while parsing (duplicate keys, NaN, lone
    # surrogates refused), every list's length checked before pydantic sees it
    data = load_json(body, JsonBounds.for_server(state.config, state.max_items))
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}")
    return data


def parse(model: type[M], data: dict[str, Any]) -> M:
    """`data` as the peer's request type: refused fields by name first, then unknown fields (a near
    miss of a known one is a typo), then strict validation."""
    for name, (unused, why) in model.UNSUPPORTED.items():
        if name in data and data[name] != unused:
            raise BadRequest(f"{name}: not supported: {why}")
    fields.check(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from None


async def read(request: Request, state: HandlerState, model: type[M]) -> M:
    return parse(model, await read_object(request, state))


def json_response(
    model: BaseModel | list[BaseModel] | Any,
    status: int = 200,
    headers: dict[str, str] | None = None,
    exclude_none: bool = True,
) -> Response:
    """A pydantic model (None fields left out unless `exclude_none` is false), a list of them, or
    plain JSON data."""
    body = json.encode(_plain(model, exclude_none))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def large_json_response(value: Any) -> Response:
    """Plain JSON data whose long parts are marked `json.Slices`: written a slice at a time, so
    the event loop keeps serving other requests while a reply of millions of floats is built."""
    body = await json.encode_async(value)
    return Response(body, media_type="application/json")


def _plain(value: Any, exclude_none: bool) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=exclude_none)
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [_plain(v, exclude_none) for v in value]
    return value
