"""The FastAPI app: routes, and the plumbing around every handler (API key, JSON errors, metrics,
`Server-Timing`). `create_app(engine, config)` serves an `Engine`: HTTP → handler → `Infer` → the
engine's runtime → its runner.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from boundgen.engine import Engine
from boundgen.server import cohere, handlers, kserve, tei, vllm
from boundgen.server.config import ServerConfig
from boundgen.server.errors import (
    NotFound,
    ServerError,
    Unauthorized,
    error_response,
    kserve_error_response,
)
from boundgen.server.infer import SERVER_TIMES
from boundgen.server.state import ServerState
from boundgen.workloads.trie import Trie

log = logging.getLogger("boundgen.server")

# Health probes answer without an API key (orchestrators cannot always send one).
_OPEN_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})

# ----------------------------------------------------------------------------------------------
# handler plumbing: auth, error JSON and metrics around every endpoint


Handler = Callable[[Request, ServerState], Awaitable[Response]]

# How a route answers errors: OpenAI's object, KServe's `{"error": str}`, TEI's `{error,
# error_type}` (a handler of a shared path may switch its request to TEI's: `tei.mark`).
ERROR_STYLES: dict[str, Callable[[ServerError], Response]] = {
    "openai": lambda exc: exc.response(),
    "kserve": lambda exc: exc.response(kserve=True),
    "tei": tei.error_response,
}


def _check_auth(request: Request, state: ServerState) -> None:
    if state.api_key is None or request.url.path in _OPEN_PATHS:
        return
    header = request.headers.get("authorization", "")
    given = (
        header[7:].strip()
        if header[:7].lower() == "bearer "
        else request.headers.get("x-api-key", "")
    )
    if not given or not hmac.compare_digest(given.encode(), state.api_key.encode()):
        raise Unauthorized(
            "missing or wrong API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


def endpoint(
    name: str, state: ServerState, fn: Handler, errors: str = "openai"
) -> Callable[[Request], Awaitable[Response]]:
    def render(request: Request, exc: ServerError) -> Response:
        return ERROR_STYLES[getattr(request.state, "error_style", errors)](exc)

    async def handle(request: Request) -> Response:
        start = time.perf_counter()
        status, error_type = 200, None
        SERVER_TIMES.set(None)  # this task's: never a previous request's on the same connection
        try:
            _check_auth(request, state)
            response = await fn(request, state)
        except ServerError as exc:
            response = render(request, exc)
            status, error_type = response.status_code, exc.type
        except Exception:
            log.exception("internal error in %s", name)
            status, error_type = 500, "internal_error"
            response = render(request, ServerError("internal server error (see the server log)"))
        else:
            status = response.status_code
        elapsed = time.perf_counter() - start
        state.metrics.observe_request(name, status, elapsed, error_type)
        if state.config.server_timing:
            response.headers["server-timing"] = server_timing(elapsed * 1e3, SERVER_TIMES.get())
        return response

    handle.__name__ = f"{name.replace('.', '_')}_endpoint"
    return handle


def server_timing(app_ms: float, times: list[tuple[str, float]] | None) -> str:
    """`Server-Timing` header value (W3C): `app` (the whole handler: parse, checks, model,
    response) first, then what `Infer` recorded (`runtime`, and each DAG node, or `queue` + the
    call without the runtime). A client subtracts `app` from its own latency to see time spent
    outside the server."""
    parts = [f"app;dur={app_ms:.3f}"]
    for name, ms in times or ():
        parts.append(f"{_TOKEN_UNSAFE.sub('_', name)};dur={ms:.3f}")
    return ", ".join(parts)


_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9!#$%&'*+.^_`|~-]")  # a metric name must be an HTTP token


def create_app(
    engine: Engine, config: ServerConfig | None = None, *, tries: dict[str, Trie] | None = None
) -> FastAPI:
    """The HTTP API over `engine` (its runtime serves every request); `tries` replaces the config's
    (`NAME=PATH`) tries."""
    config = (config or ServerConfig()).validate()
    state = ServerState(engine, config, tries=tries)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has drained in-flight requests by now (SIGTERM → graceful shutdown).
        state.draining = True
        state.infer.close()

    app = FastAPI(
        title="boundgen", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None
    )
    app.state.boundgen = state

    schemas: dict[str, Any] = {}

    def route(
        path: str,
        name: str,
        fn: Handler,
        methods: tuple[str, ...] = ("POST",),
        errors: str | None = None,
    ) -> None:
        """`errors`: the route's error style (default: KServe's for `kserve.*` names, else
        OpenAI's)."""
        errors = errors or ("kserve" if name.startswith("kserve.") else "openai")
        body = handlers.REQUEST_MODELS.get(fn)
        extra = None
        if body is not None:
            # Handlers parse bodies themselves (clear 400s); the schema is for /docs only.
            schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[body.__name__] = schema
            ref = {"$ref": f"#/components/schemas/{body.__name__}"}
            extra = {
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
            }
        app.add_api_route(
            path,
            endpoint(name, state, fn, errors),
            methods=list(methods),
            name=name,
            response_model=None,
            openapi_extra=extra,
            summary=fn.__doc__,
        )

    # SGLang, vLLM, Cohere, OpenAI (docs/compat.md); a path two peers share dispatches on the body
    route("/v1/score", "score", handlers.score)
    route("/score", "score", vllm.score)
    route("/v1/rerank", "rerank", handlers.rerank_v1)
    route("/v2/rerank", "rerank", handlers.rerank_v2)
    route("/rerank", "rerank", handlers.rerank)
    route("/v1/classify", "classify", vllm.classify)
    route("/classify", "classify", vllm.classify)
    route("/v1/embeddings", "embeddings", handlers.embeddings)
    route("/pooling", "pooling", vllm.pooling)
    route("/tokenize", "tokenize", handlers.tokenize)
    route("/detokenize", "detokenize", vllm.detokenize)
    route("/v1/embed", "embed", cohere.embed_v1)
    route("/v2/embed", "embed", cohere.embed_v2)
    # boundgen's own
    route("/v1/beam", "beam", handlers.beam)
    route("/v1/models", "models", handlers.models, ("GET",))
    route("/health", "health", handlers.health, ("GET",))
    route("/metrics", "metrics", handlers.metrics, ("GET",))
    tei.add_routes(route)
    kserve.add_routes(route)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        spec = default_openapi()
        spec.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return spec

    app.openapi = openapi

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        if path == "/v2" or path.startswith("/v2/"):  # tritonclient reads `{"error": "<string>"}`
            message = f"no route {request.method} {path}"
            if exc.status_code == 405:
                message = f"method {request.method} is not allowed on {path}"
            return kserve_error_response(exc.status_code, message, getattr(exc, "headers", None))
        if exc.status_code == 404:
            return NotFound(f"no route {request.method} {request.url.path}").response()
        if exc.status_code == 405:
            return error_response(
                405,
                f"method {request.method} is not allowed on {request.url.path}",
                "invalid_request_error",
                405,
                headers=getattr(exc, "headers", None),
            )
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    return app


def _version() -> str:
    from boundgen import __version__

    return __version__
