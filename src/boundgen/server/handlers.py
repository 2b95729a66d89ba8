"""HTTP handlers in the shapes users' clients speak: each parses its body (`schemas`), calls the
shared core (`inputs`), and shapes the response. Nothing here blocks the event loop on the model."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import inputs
from boundgen.server.errors import BadRequest, TooLarge, Unavailable
from boundgen.server.limits import parse_request
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
from boundgen.server.state import ServerState


def json_response(model: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        model.model_dump_json(exclude_none=True),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def score(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, ScoreRequest, state.config)
    items = [req.items] if isinstance(req.items, str) else req.items
    if items and isinstance(req.query, str) != isinstance(items[0], str):
        raise BadRequest("query and items must both be text or both be token ids")
    labels = inputs.label_ids(state, req.label_token_ids)
    item_ids = await inputs.many_token_ids(state, "items", items)
    cfg = state.config
    query = await inputs.token_ids(
        state, "query", req.query, cfg.max_query_tokens, "max_query_tokens", allow_empty=True
    )
    scores = await inputs.score(
        state,
        query,
        item_ids,
        labels,
        req.apply_softmax,
        req.item_first,
        state.timeout_ms(req.timeout_ms),
    )
    n = len(query) * len(item_ids) + sum(len(i) for i in item_ids)
    usage = Usage(prompt_tokens=n, total_tokens=n, completion_tokens=0)
    return json_response(ScoreResponse(scores=scores, model=state.model_name, usage=usage))


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
    doc_ids = await inputs.many_token_ids(
        state, "documents", [cfg.rerank_document_template.format(document=d) for d in docs]
    )
    query = await inputs.token_ids(
        state,
        "query",
        cfg.rerank_query_template.format(query=req.query),
        cfg.max_query_tokens,
        "max_query_tokens",
        allow_empty=True,
    )
    scores = await inputs.score(
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


async def classify(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, ClassifyRequest, state.config)
    ids = await inputs.text_inputs(state, "input", req.input)
    probs = await inputs.classify(state, ids, state.timeout_ms(req.timeout_ms))
    data = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=p.__getitem__)
        data.append(ClassifyData(index=i, label=state.label(best), probs=p, num_classes=len(p)))
    n = sum(len(s) for s in ids)
    return json_response(
        ClassifyResponse(
            id=f"classify-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=state.model_name,
            data=data,
            usage=Usage(prompt_tokens=n, total_tokens=n),
        )
    )


async def embeddings(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, EmbeddingsRequest, state.config)
    if req.dimensions is not None and req.dimensions != state.hidden_size:
        raise BadRequest(
            f"dimensions={req.dimensions} is not supported: model {state.model_name!r} "
            f"returns {state.hidden_size}-dimensional embeddings (omit `dimensions`)"
        )
    ids = await inputs.text_inputs(state, "input", req.input)
    pooling = req.pooling or state.config.embed_pooling
    normalize = state.config.embed_normalize if req.normalize is None else req.normalize
    vectors = await inputs.embed(state, ids, pooling, normalize, state.timeout_ms(req.timeout_ms))
    if req.encoding_format == "base64":
        data = [
            Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode())
            for i, v in enumerate(vectors)
        ]
    else:
        data = [Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
    n = sum(len(s) for s in ids)
    usage = Usage(prompt_tokens=n, total_tokens=n)
    return json_response(EmbeddingsResponse(data=data, model=state.model_name, usage=usage))


async def beam(request: Request, state: ServerState) -> Response:
    req = await parse_request(request, BeamRequest, state.config)
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
    cfg = state.config
    prompt = await inputs.token_ids(
        state, "prompt", req.prompt, cfg.max_query_tokens, "max_query_tokens"
    )
    state.limits.context("prompt + steps", len(prompt) + req.steps)
    request_fields = dict(
        prompts=[prompt], beam_width=req.beam_width, steps=req.steps, top_k=req.top_k, trie=trie
    )
    (beams,) = await state.infer(
        "beam", request_fields, state.timeout_ms(req.timeout_ms), len(prompt)
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
    usage = Usage(prompt_tokens=n, total_tokens=n + req.steps, completion_tokens=req.steps)
    return json_response(BeamResponse(model=state.model_name, results=results, usage=usage))


# ---- models, health, metrics --------------------------------------------------------------------


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
    body = json.dumps({"object": "list", "data": [model_card(state)]})
    return Response(body, media_type="application/json")


async def health(request: Request, state: ServerState) -> Response:
    if state.draining:
        raise Unavailable("server is shutting down")
    if not state.ready:
        raise Unavailable("model is not ready")
    return Response('{"status":"ok"}', media_type="application/json")


async def metrics(request: Request, state: ServerState) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


# body schema of each handler, for /docs (handlers parse bodies themselves, with clear 400s)
REQUEST_MODELS = {
    score: ScoreRequest,
    rerank: RerankRequest,
    classify: ClassifyRequest,
    embeddings: EmbeddingsRequest,
    beam: BeamRequest,
}
