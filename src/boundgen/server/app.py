"""FastAPI app: thin handlers that validate, call the one `Infer` object, and shape the response.

`create_app(engine, config)` serves an `Engine` (or anything with its methods: `score`, `classify`,
`embed`, `beam_search`, `tokenizer`, `config`, `model_name`); pass `runtime=` to serve through the
DAG runtime instead. Nothing here blocks the event loop on the model.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import kserve
from boundgen.server.config import ServerConfig
from boundgen.server.errors import (
    BadRequest,
    NotFound,
    ServerError,
    TooLarge,
    Unauthorized,
    Unavailable,
    error_response,
)
from boundgen.server.infer import SERVER_TIMES, Infer
from boundgen.server.limits import Limits, parse_request
from boundgen.server.metrics import Metrics
from boundgen.server.schemas import (
    BeamRequest,
    BeamResponse,
    BeamResult,
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    Embedding,
    EmbeddingsRequest,
    EmbeddingsResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreRequest,
    ScoreResponse,
    Usage,
)

log = logging.getLogger("boundgen.server")

# Health probes answer without an API key (orchestrators cannot always send one).
_OPEN_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
# Text longer than this (total characters) is tokenized on a thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


def json_response(model: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        model.model_dump_json(exclude_none=True),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class ServerState:
    """Everything a handler needs: config, limits, the `Infer` object and model facts."""

    def __init__(
        self,
        engine: Any,
        config: ServerConfig,
        *,
        runtime: Any = None,
        tries: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        device = getattr(engine, "device", "cpu")
        self.tries = dict(tries) if tries is not None else load_tries(config, device)
        owns_runtime = False
        if runtime is None and config.runtime:
            runtime, owns_runtime = make_runtime(engine, config)
        self.runtime = runtime
        if runtime is not None:
            self.metrics.watch_runtime(runtime)
        self.infer = Infer(
            engine,
            metrics=self.metrics,
            max_queue=config.max_queue,
            workers=config.workers,
            runtime=runtime,
            owns_runtime=owns_runtime,
            retry_after_s=config.retry_after_s,
            tries=self.tries,
        )
        mc = engine.config
        ec = getattr(engine, "engine_config", None) or _default_engine_config()
        self.max_items = int(ec.max_items)
        self.max_beam_width = int(ec.max_beam_width)
        self.max_beam_steps = int(ec.max_beam_steps)
        self.model_name = (
            config.served_model_name or getattr(engine, "model_name", None) or "boundgen"
        )
        self.vocab_size = int(mc.vocab_size)
        self.hidden_size = int(getattr(mc, "hidden_size", 0) or 0)
        self.can_classify = getattr(mc, "task", "causal_lm") == "seq_cls"
        self.num_labels = int(getattr(mc, "num_labels", 0) or 0) if self.can_classify else 0
        self.id2label = list(getattr(mc, "id2label", None) or ())
        engine_limits = getattr(engine, "limits", None)
        self.max_positions = getattr(engine_limits, "max_seq_len", None) or getattr(
            mc, "max_position_embeddings", None
        )
        self.limits = Limits(config, self.vocab_size, self.max_positions)
        self.api_key = config.resolved_api_key()
        self.rerank_label_ids = self._rerank_labels()
        self.started = time.time()
        self.ready = True
        self.draining = False

    def _rerank_labels(self) -> list[int] | None:
        ids = []
        for label in self.config.rerank_label_tokens:
            toks = self.engine.tokenizer.encode(label)
            if len(toks) != 1:
                log.warning(
                    "rerank label %r is %d tokens %s, not 1: /v1/rerank is disabled",
                    label,
                    len(toks),
                    toks,
                )
                return None
            ids.append(int(toks[0]))
        return ids

    def timeout_ms(self, requested: int | None) -> int:
        return min(requested or self.config.timeout_ms, self.config.max_timeout_ms)

    async def encode(self, texts: list[str], special: bool = False) -> list[list[int]]:
        """`special`: add the tokenizer's special tokens, as the engine does for embed/classify texts."""
        tok = self.engine.tokenizer

        def run() -> list[list[int]]:
            return [tok.encode(t, add_special_tokens=special) for t in texts]

        if sum(len(t) for t in texts) <= _INLINE_TOKENIZE_CHARS:
            return run()
        return await asyncio.to_thread(run)


def make_runtime(engine: Any, config: ServerConfig) -> tuple[Any, bool]:
    """(runtime, whether the server owns it): the engine's own DAG runtime, or one built with the
    server's batching knobs; (None, False) for engine stand-ins, which are served directly."""
    from boundgen.engine import Engine

    if not isinstance(engine, Engine):
        return None, False
    if (
        config.cpu_workers is None
        and config.batch_token_budget is None
        and config.batch_max_wait_ms == 0.0
        and hasattr(engine, "runtime")
    ):
        return engine.runtime, False  # one executor for the engine's own calls and the server's
    from boundgen.runtime.pipelines import EngineRuntime

    return EngineRuntime(
        engine,
        cpu_workers=config.cpu_workers,
        token_budget=config.batch_token_budget,
        max_wait_ms=config.batch_max_wait_ms,
    ), True


def _default_engine_config() -> Any:
    from boundgen.config import EngineConfig

    return EngineConfig()


def load_tries(config: ServerConfig, device: Any = "cpu") -> dict[str, Any]:
    """The config's tries, on the engine's device (a beam request never copies a trie)."""
    paths = config.trie_paths()
    if not paths:
        return {}
    from boundgen import Trie

    return {name: Trie.from_file(path, device=device) for name, path in paths.items()}


# ----------------------------------------------------------------------------------------------
# handler plumbing: auth, error JSON and metrics around every endpoint


Handler = Callable[[Request, ServerState], Awaitable[Response]]


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
    name: str, state: ServerState, fn: Handler
) -> Callable[[Request], Awaitable[Response]]:
    kserve_errors = name.startswith("kserve.")

    async def handle(request: Request) -> Response:
        start = time.perf_counter()
        status, error_type = 200, None
        SERVER_TIMES.set(None)  # this task's: never a previous request's on the same connection
        try:
            _check_auth(request, state)
            response = await fn(request, state)
        except ServerError as exc:
            status, error_type = exc.status, exc.type
            response = exc.response(kserve_errors)
        except Exception:
            log.exception("internal error in %s", name)
            status, error_type = 500, "internal_error"
            response = ServerError("internal server error (see the server log)").response(
                kserve_errors
            )
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
    """`Server-Timing` header value (W3C): `app` (the whole handler: parse, checks, model, response) first,
    then what `Infer` recorded (`runtime`, and each DAG node, or `queue` + the call without the
    runtime).
    A client subtracts `app` from its own latency to see time spent outside the server."""
    parts = [f"app;dur={app_ms:.3f}"]
    for name, ms in times or ():
        parts.append(f"{_TOKEN_UNSAFE.sub('_', name)};dur={ms:.3f}")
    return ", ".join(parts)


_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9!#$%&'*+.^_`|~-]")  # a metric name must be an HTTP token


# ----------------------------------------------------------------------------------------------
# workload endpoints


async def _token_ids(
    state: ServerState,
    what: str,
    value: str | list[int],
    limit: int,
    option: str,
    allow_empty: bool = False,
) -> list[int]:
    ids = (await state.encode([value]))[0] if isinstance(value, str) else value
    if isinstance(value, list):
        state.limits.token_ids(what, ids)
    if ids or not allow_empty:
        state.limits.tokens(what, len(ids), limit, option)
    return list(ids)


async def _many_token_ids(
    state: ServerState, what: str, values: list[str] | list[list[int]], special: bool = False
) -> list[list[int]]:
    cfg = state.config
    state.limits.count(what, len(values), state.max_items, "max_items")
    if isinstance(values[0], str):
        if not all(isinstance(v, str) for v in values):
            raise BadRequest(f"{what}: mix of text and token ids; use one kind")
        seqs = await state.encode(values, special)  # type: ignore[arg-type]
    else:
        seqs = values  # type: ignore[assignment]
        for i, ids in enumerate(seqs):
            state.limits.token_ids(f"{what}[{i}]", ids)
    for i, ids in enumerate(seqs):
        state.limits.tokens(f"{what}[{i}]", len(ids), cfg.max_item_tokens, "max_item_tokens")
    return [list(s) for s in seqs]


async def _run_score(
    state: ServerState,
    query: list[int],
    items: list[list[int]],
    label_ids: list[int],
    apply_softmax: bool,
    item_first: bool,
    timeout_ms: int,
) -> list[list[float]]:
    state.limits.context("query + longest item", len(query) + max(len(i) for i in items))
    n_tokens = len(query) + sum(len(i) for i in items)
    scores = await state.infer(
        "score",
        dict(
            query=query,
            items=items,
            label_token_ids=label_ids,
            apply_softmax=apply_softmax,
            item_first=item_first,
            _tokens=n_tokens,
        ),
        timeout_ms,
    )
    state.metrics.items.labels("score").inc(len(items))
    return [[float(x) for x in row] for row in scores]


async def score(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, ScoreRequest, state.config)
    items = [req.items] if isinstance(req.items, str) else req.items
    if items and isinstance(req.query, str) != isinstance(items[0], str):
        raise BadRequest("query and items must both be text or both be token ids")
    cfg = state.config
    state.limits.count(
        "label_token_ids", len(req.label_token_ids), cfg.max_label_tokens, "max_label_tokens"
    )
    state.limits.token_ids("label_token_ids", req.label_token_ids)
    item_ids = await _many_token_ids(state, "items", items)
    query = await _token_ids(
        state, "query", req.query, cfg.max_query_tokens, "max_query_tokens", allow_empty=True
    )
    scores = await _run_score(
        state,
        query,
        item_ids,
        list(req.label_token_ids),
        req.apply_softmax,
        req.item_first,
        state.timeout_ms(req.timeout_ms),
    )
    n = len(query) * len(item_ids) + sum(len(i) for i in item_ids)
    return json_response(
        ScoreResponse(
            scores=scores,
            model=state.model_name,
            usage=Usage(prompt_tokens=n, total_tokens=n, completion_tokens=0),
        )
    )


async def rerank(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, RerankRequest, state.config)
    if state.rerank_label_ids is None:
        raise BadRequest(
            "rerank is not available: the server's rerank_label_tokens "
            f"{list(state.config.rerank_label_tokens)} are not single tokens of this "
            "model's vocabulary"
        )
    cfg = state.config
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    state.limits.count("documents", len(docs), state.max_items, "max_items")
    query_text = cfg.rerank_query_template.format(query=req.query)
    doc_ids = await _many_token_ids(
        state, "documents", [cfg.rerank_document_template.format(document=d) for d in docs]
    )
    query = await _token_ids(
        state, "query", query_text, cfg.max_query_tokens, "max_query_tokens", allow_empty=True
    )
    scores = await _run_score(
        state, query, doc_ids, state.rerank_label_ids, True, False, state.timeout_ms(req.timeout_ms)
    )
    order = sorted(range(len(docs)), key=lambda i: -scores[i][0])
    if req.top_n is not None:
        order = order[: req.top_n]
    with_docs = req.return_documents is not False
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i][0],
            document=RerankDocument(text=docs[i]) if with_docs else None,
        )
        for i in order
    ]
    n = len(query) * len(doc_ids) + sum(len(d) for d in doc_ids)
    return json_response(
        RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=state.model_name,
            results=results,
            usage={"total_tokens": n},
            meta={"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
        )
    )


async def _texts_or_ids(state: ServerState, value: Any) -> tuple[list[Any], list[list[int]]]:
    """OpenAI-style `input`: str | list[str] | list[int] | list[list[int]] → (engine inputs, token ids).

    The engine gets the texts themselves (it adds special tokens) or the token ids as given."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise BadRequest("input is empty")
    if isinstance(value[0], int):
        value = [value]
    ids = await _many_token_ids(state, "input", value, special=True)
    for i, seq in enumerate(ids):
        state.limits.context(f"input[{i}]", len(seq))
    return list(value), ids


async def classify(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, ClassifyRequest, state.config)
    if not state.can_classify:
        raise BadRequest(
            f"model {state.model_name!r} has no classification head; "
            "/v1/classify needs a *ForSequenceClassification checkpoint"
        )
    texts, ids = await _texts_or_ids(state, req.input)
    n = sum(len(s) for s in ids)
    rows = await state.infer(
        "classify", dict(texts=texts, _tokens=n), state.timeout_ms(req.timeout_ms)
    )
    data = []
    for i, logits in enumerate(rows):
        probs = _softmax([float(x) for x in logits])
        best = max(range(len(probs)), key=probs.__getitem__)
        label = state.id2label[best] if best < len(state.id2label) else f"LABEL_{best}"
        data.append(ClassifyData(index=i, label=str(label), probs=probs, num_classes=len(probs)))
    state.metrics.items.labels("classify").inc(len(data))
    return json_response(
        ClassifyResponse(
            id=f"classify-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=state.model_name,
            data=data,
            usage=Usage(prompt_tokens=n, total_tokens=n),
        )
    )


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    s = sum(es)
    return [e / s for e in es]


async def embeddings(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, EmbeddingsRequest, state.config)
    if req.dimensions is not None and req.dimensions != state.hidden_size:
        raise BadRequest(
            f"dimensions={req.dimensions} is not supported: model {state.model_name!r} "
            f"returns {state.hidden_size}-dimensional embeddings (omit `dimensions`)"
        )
    texts, ids = await _texts_or_ids(state, req.input)
    n = sum(len(s) for s in ids)
    pooling = req.pooling or state.config.embed_pooling
    normalize = state.config.embed_normalize if req.normalize is None else req.normalize
    vectors = await state.infer(
        "embed",
        dict(texts=texts, pooling=pooling, normalize=normalize, _tokens=n),
        state.timeout_ms(req.timeout_ms),
    )
    if req.encoding_format == "base64":
        data = [
            Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode())
            for i, v in enumerate(vectors)
        ]
    else:
        data = [Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
    state.metrics.items.labels("embeddings").inc(len(data))
    return json_response(
        EmbeddingsResponse(
            data=data, model=state.model_name, usage=Usage(prompt_tokens=n, total_tokens=n)
        )
    )


async def beam(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, BeamRequest, state.config)
    cfg = state.config
    if req.beam_width > state.max_beam_width:
        raise TooLarge(
            f"beam_width={req.beam_width}; the limit is {state.max_beam_width} "
            "(option max_beam_width)"
        )
    if req.steps > state.max_beam_steps:
        raise TooLarge(
            f"steps={req.steps}; the limit is {state.max_beam_steps} (option max_beam_steps)"
        )
    if req.top_k is not None and req.top_k > req.beam_width:
        raise BadRequest(f"top_k={req.top_k} must be <= beam_width={req.beam_width}")
    trie = None
    if req.trie is not None:
        trie = state.tries.get(req.trie)
        if trie is None:
            raise BadRequest(
                f"unknown trie {req.trie!r}; this server has "
                f"{sorted(state.tries) or 'no tries (server option tries)'}"
            )
    prompt = await _token_ids(state, "prompt", req.prompt, cfg.max_query_tokens, "max_query_tokens")
    state.limits.context("prompt + steps", len(prompt) + req.steps)
    beams = await state.infer(
        "beam",
        dict(
            prompt=prompt,
            beam_width=req.beam_width,
            steps=req.steps,
            top_k=req.top_k,
            trie=trie,
            _tokens=len(prompt),
        ),
        state.timeout_ms(req.timeout_ms),
    )
    results = []
    for tokens, score_ in beams:
        item_id = None
        if trie is not None:
            try:
                item_id = trie.item_ids(tokens[-trie.depth :])
            except (KeyError, ValueError):
                item_id = None
        results.append(BeamResult(tokens=tokens, score=score_, item_id=item_id))
    state.metrics.items.labels("beam").inc(len(results))
    n = len(prompt)
    return json_response(
        BeamResponse(
            model=state.model_name,
            results=results,
            usage=Usage(prompt_tokens=n, total_tokens=n + req.steps, completion_tokens=req.steps),
        )
    )


# ----------------------------------------------------------------------------------------------
# models, health, metrics


def model_card(state: ServerState) -> dict[str, Any]:
    tasks = ["score", "embed", "beam"] + (["rerank"] if state.rerank_label_ids is not None else [])
    if state.can_classify:
        tasks.append("classify")
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "boundgen",
        "max_model_len": state.max_positions,
        "vocab_size": state.vocab_size,
        "hidden_size": state.hidden_size,
        "num_labels": state.num_labels,
        "tasks": tasks,
        "tries": sorted(state.tries),
        "rerank_label_token_ids": state.rerank_label_ids,
    }


async def models(request: Request, state: ServerState) -> Response:
    import json

    return Response(
        json.dumps({"object": "list", "data": [model_card(state)]}), media_type="application/json"
    )


async def health(request: Request, state: ServerState) -> Response:
    if state.draining:
        raise Unavailable("server is shutting down")
    if not state.ready:
        raise Unavailable("model is not ready")
    return Response('{"status":"ok"}', media_type="application/json")


async def metrics(request: Request, state: ServerState) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


_REQUEST_MODELS = {
    "score": ScoreRequest,
    "rerank": RerankRequest,
    "classify": ClassifyRequest,
    "embeddings": EmbeddingsRequest,
    "beam": BeamRequest,
}


def create_app(
    engine: Any,
    config: ServerConfig | None = None,
    *,
    runtime: Any = None,
    tries: dict[str, Any] | None = None,
) -> FastAPI:
    config = (config or ServerConfig()).validate()
    state = ServerState(engine, config, runtime=runtime, tries=tries)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has drained in-flight requests by now (SIGTERM → graceful shutdown).
        state.draining = True
        state.infer.close(wait=True)

    app = FastAPI(
        title="boundgen", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None
    )
    app.state.boundgen = state

    schemas: dict[str, Any] = {}

    def route(path: str, name: str, fn: Handler, methods: tuple[str, ...] = ("POST",)) -> None:
        body = _REQUEST_MODELS.get(fn.__name__)
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
            endpoint(name, state, fn),
            methods=list(methods),
            name=name,
            response_model=None,
            openapi_extra=extra,
            summary=fn.__doc__,
        )

    route("/v1/score", "score", score)
    route("/v1/rerank", "rerank", rerank)
    route("/v2/rerank", "rerank", rerank)
    route("/rerank", "rerank", rerank)
    route("/v1/classify", "classify", classify)
    route("/v1/embeddings", "embeddings", embeddings)
    route("/v1/beam", "beam", beam)
    route("/v1/models", "models", models, ("GET",))
    route("/health", "health", health, ("GET",))
    route("/metrics", "metrics", metrics, ("GET",))
    kserve.add_routes(route, state)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        spec = default_openapi()
        spec.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return spec

    app.openapi = openapi

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
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
