"""HTTP errors as `{"error": {"message", "type", "code"}}` (the OpenAI shape clients already
parse), or in the shape of the peer whose route answers: SGLang's flat object (`sglang_response`),
KServe's `{"error": str}` (`kserve_error_response`); TEI's is in `tei.py`."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class ServerError(Exception):
    status = 500
    type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: Any = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.headers = headers or {}
        if status is not None:
            self.status = status

    def response(self, kserve: bool = False) -> JSONResponse:
        if kserve:
            return kserve_error_response(self.status, self.message, self.headers)
        return error_response(self.status, self.message, self.type, self.code, self.headers)


class BadRequest(ServerError):
    status, type = 400, "invalid_request_error"


class Unauthorized(ServerError):
    status, type = 401, "authentication_error"


class Forbidden(ServerError):
    status, type = 403, "permission_error"


class NotFound(ServerError):
    status, type = 404, "not_found_error"


class RequestTimeout(ServerError):
    status, type = 408, "request_timeout"


class TooLarge(ServerError):
    status, type = 413, "request_too_large"


class UnsupportedMediaType(ServerError):
    status, type = 415, "invalid_request_error"


class Overloaded(ServerError):
    status, type = 429, "overloaded_error"


class Unavailable(ServerError):
    status, type = 503, "unavailable_error"


class Timeout(ServerError):
    status, type = 504, "timeout_error"


def error_response(
    status: int, message: str, type_: str, code: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    # `code`: the HTTP status unless a more specific code is given (vLLM does the same).
    body = {
        "error": {"message": message, "type": type_, "code": code if code is not None else status}
    }
    return JSONResponse(body, status_code=status, headers=headers)


def kserve_error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    # KServe v2 / Triton clients expect `{"error": "<message>"}` (tritonclient fails on an object).
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def sglang_response(exc: ServerError) -> JSONResponse:
    """SGLang's `ErrorResponse`, flat: its clients and tests read `type` and `message` at the top
    (`serving_base.create_error_response`)."""
    body = {
        "object": "error",
        "message": exc.message,
        "type": SGLANG_TYPES.get(exc.status, exc.type),
        "param": None,
        "code": exc.status,
    }
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


# The types SGLang's handlers give a bad request and a server failure; it has no name of its own
# for the other statuses (a 413, 429, 503, 504 keep boundgen's type).
SGLANG_TYPES = {400: "BadRequestError", 500: "InternalServerError"}
