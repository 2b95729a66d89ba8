"""The FastAPI app: routes, the guard in front of them (`guard.py`: Host, Origin, API key,
Content-Type, body size and deadline), and the plumbing around every handler (load shedding, JSON
errors, metrics, `Server-Timing`). `create_app(engine, config)` serves an `Engine`: HTTP → guard →
handler → `Infer` → the engine's runtime → its runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import cohere, handlers, kserve, loop_lag, tei, vllm
from boundgen.server.config import ServerConfig
from boundgen.server.dispatch import Endpoint, FixedRoutes
from boundgen.server.errors import (
    NotFound,
    ServerError,
    error_response,
    kserve_error_response,
    sglang_response,
)
from boundgen.server.guard import Guard
from boundgen.server.handler_state import HandlerState
from boundgen.server.timing import SERVER_TIMES, server_timing

if TYPE_CHECKING:  # `create_app` imports them when called: a frontend process has no engine
    from boundgen.engine import Engine
    from boundgen.workloads.trie import Trie

log = logging.getLogger("boundgen.server")

# ----------------------------------------------------------------------------------------------
# handler plumbing: load shedding, error JSON and metrics around every endpoint


Handler = Callable[[Request, HandlerState], Awaitable[Response]]

# How a route answers errors: OpenAI's object, SGLang's flat one, KServe's `{"error": str}`, TEI's
# `{error, error_type}` (a handler of a shared path may switch its request to another peer's:
# `request.state.error_style`, e.g. `tei.mark`).
ERROR_STYLES: dict[str, Callable[[ServerError], Response]] = {
    "openai": lambda exc: exc.response(),
    "sglang": sglang_response,
    "kserve": lambda exc: exc.response(kserve=True),
    "tei": tei.error_response,
}


def endpoint(
    name: str, state: HandlerState, fn: Handler, errors: str = "openai"
) -> Callable[[Request], Awaitable[Response]]:
    def render(request: Request, exc: ServerError) -> Response:
        return ERROR_STYLES[getattr(request.state, "error_style", errors)](exc)

    async def handle(request: Request) -> Response:
        start = time.perf_counter()
        status, error_type = 200, None
        SERVER_TIMES.set(None)  # this task's: never a previous request's on the same connection
        try:
            if request.method == "POST":  # shed before parsing what would be refused anyway
                state.infer.check_load()
            response = await fn(request, state)
        except asyncio.CancelledError:  # the client went away (the guard cancelled the request)
            state.metrics.observe_request(name, 499, time.perf_counter() - start, "client_closed")
            raise
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


def create_app(
    engine: Engine, config: ServerConfig | None = None, *, tries: dict[str, Trie] | None = None
) -> FastAPI:
    """The HTTP API over `engine` (its runtime serves every request); `tries` replaces the config's
    (`NAME=PATH`) tries."""
    from boundgen.server.state import ServerState

    config = (config or ServerConfig()).validate()
    state = ServerState(engine, config, tries=tries)
    log_exposure(config)
    lag: list[asyncio.Task] = []

    async def start() -> None:
        state.start_warm_up()
        metrics = state.metrics
        lag.append(asyncio.create_task(loop_lag.probe(metrics.loop_lag, metrics.loop_lag_max)))

    def stop() -> None:
        for task in lag:
            task.cancel()
        state.stop_warm_up()  # (before the runtime closes under it)
        state.infer.close()
        state.close()

    return build_app(state, config, on_start=start, on_stop=stop)


def build_app(
    state: HandlerState,
    config: ServerConfig,
    *,
    on_start: Callable[[], Awaitable[None]],
    on_stop: Callable[[], None],
) -> FastAPI:
    """The routes over `state` (a `ServerState`, or a frontend process's `FrontendState`):
    `on_start` runs in the app's lifespan before it serves, `on_stop` after uvicorn has drained
    the in-flight requests."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await on_start()
        yield
        # uvicorn has drained in-flight requests by now (SIGTERM → graceful shutdown).
        state.draining = True
        on_stop()

    app = FastAPI(
        title="boundgen", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None
    )
    app.state.boundgen = state

    schemas: dict[str, Any] = {}
    fixed: dict[tuple[str, str], Endpoint] = {}  # (method, path) → endpoint, for FixedRoutes

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
        handle = endpoint(name, state, fn, errors)
        if "{" not in path:
            fixed.update({(method, path): handle for method in methods})
        app.add_api_route(
            path,
            handle,
            methods=list(methods),
            name=name,
            response_model=None,
            openapi_extra=extra,
            summary=fn.__doc__,
        )

    # SGLang, vLLM, Cohere, OpenAI (docs/compat.md); a path two peers share dispatches on the body.
    # `/v1/score` is SGLang's unless the body is vLLM's; `/v1/rerank` is the configured peer's.
    route("/v1/score", "score", handlers.score, errors="sglang")
    route("/score", "score", vllm.score)
    rerank_v1_errors = "sglang" if config.rerank_v1_format == "sglang" else "openai"
    route("/v1/rerank", "rerank", handlers.rerank_v1, errors=rerank_v1_errors)
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

    app.add_middleware(FixedRoutes, routes=fixed)  # innermost: guard and CORS come first
    if config.allowed_origins:  # browser pages of these origins: answer their CORS preflights
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-api-key"],
        )

    def refused(status: int, error_type: str) -> None:
        state.metrics.observe_request("guard", status, 0.0, error_type)

    app.add_middleware(Guard, config=config, api_key=state.api_key, on_refuse=refused)  # outermost

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


def log_exposure(config: ServerConfig) -> None:
    """Say where the API key came from (never the key), and warn about an open server."""
    key, source = config.api_key_source()
    if key is not None:
        log.info("API key from %s", source)
        if config.api_key:
            log.warning(
                "the API key was given as an option: on the command line it is visible to every "
                "user in `ps`; prefer --api-key-file or BOUNDGEN_API_KEY(_FILE)"
            )
    elif not _is_loopback_host(config.host):
        log.warning(
            "serving on %s without an API key: anyone who can reach it may use it "
            "(set --api-key-file or BOUNDGEN_API_KEY_FILE; docs/security.md)",
            config.host,
        )


def _is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _version() -> str:
    from boundgen import __version__

    return __version__
