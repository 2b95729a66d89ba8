"""Cohere's routes: rerank (`/v1/rerank`, `/v2/rerank`, `/rerank`; vLLM's rerank fields too) and
embed (`/v1/embed`, `/v2/embed`), in the shapes `cohere.Client` and `cohere.ClientV2` read."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import encodings, inputs
from boundgen.server.bodies import json_response, large_json_response, parse, read
from boundgen.server.errors import BadRequest
from boundgen.server.handler_state import HandlerState
from boundgen.server.json import Slices, floats
from boundgen.server.schemas.cohere import (
    INPUT_TYPES,
    EmbedRequest,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
)

# ---- rerank -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranking:
    order: list[int]  # document indices, best first (cut to top_n)
    scores: list[float]  # per document: relevance, or its logit (use_activation false)
    texts: list[str]  # what was ranked per document
    prompt_tokens: int


def document_text(doc: str | RerankDocument, rank_fields: list[str] | None, index: int) -> str:
    """What is ranked: a string document, an object's `text`, or its `rank_fields` as `k: v`
    lines (Cohere v1)."""
    if isinstance(doc, str):
        if rank_fields:
            raise BadRequest("rank_fields applies to object documents; these are strings")
        return doc
    fields = doc.model_dump(exclude_none=True)
    if not rank_fields:
        if doc.text is None:
            raise BadRequest(f"documents[{index}] has no `text`; give one, or rank_fields")
        return doc.text
    lines = []
    for name in rank_fields:
        value = fields.get(name)
        if not isinstance(value, str):
            raise BadRequest(f"documents[{index}].{name} (a rank_fields entry) must be a string")
        lines.append(f"{name}: {value}")
    return "\n".join(lines)


async def rank(state: HandlerState, req: RerankRequest) -> Ranking:
    """The shared rerank core: relevance of the query with each document, best first."""
    labels = inputs.rerank_labels(state)
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise BadRequest(
            f"max_tokens_per_doc must be a positive integer, got {req.max_tokens_per_doc}"
        )
    texts = [document_text(d, req.rank_fields, i) for i, d in enumerate(req.documents)]
    cut = inputs.DocumentCut(
        req.max_tokens_per_doc, inputs.truncation(state, req.truncate_prompt_tokens)
    )
    rel = await inputs.relevance(
        state, req.query, texts, labels, state.timeout_ms(req.timeout_ms), cut=cut
    )
    scores = rel.logit if req.use_activation is False else rel.probability
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:  # 0 or absent: every document
        order = order[: req.top_n]
    return Ranking(order, scores, texts, rel.prompt_tokens)


async def rerank_body(body: dict[str, Any], state: HandlerState) -> Response:
    """Cohere's (and vLLM's) rerank reply: `{id, model, results: [{index, relevance_score,
    document}], usage, meta}`; documents come back unless `return_documents` is false, objects
    whole."""
    req = parse(RerankRequest, body)
    ranking = await rank(state, req)
    with_docs = req.return_documents is not False

    def document(i: int) -> dict[str, Any]:
        doc = req.documents[i]
        return {"text": doc} if isinstance(doc, str) else doc.model_dump(exclude_none=True)

    results = [
        RerankResult(
            index=i,
            relevance_score=ranking.scores[i],
            document=document(i) if with_docs else None,
        )
        for i in ranking.order
    ]
    n = ranking.prompt_tokens
    return json_response(
        RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=state.model_name,
            results=results,
            usage={"prompt_tokens": n, "total_tokens": n},
            meta={"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
        )
    )


# ---- embed --------------------------------------------------------------------------------------


async def embed_v1(request: Request, state: HandlerState) -> Response:
    return await _embed(await read(request, state, EmbedRequest), state, version=1)


async def embed_v2(request: Request, state: HandlerState) -> Response:
    return await _embed(await read(request, state, EmbedRequest), state, version=2)


async def _embed(req: EmbedRequest, state: HandlerState, version: int) -> Response:
    """v1 without `embedding_types`: `embeddings_floats` ([[float]]); otherwise, and always in v2,
    `embeddings_by_type` ({type: [...]})."""
    if req.input_type is not None and req.input_type not in INPUT_TYPES:
        raise BadRequest(
            f"Unsupported input_type {req.input_type!r}. Supported values: "
            + ", ".join(INPUT_TYPES)
        )
    inputs.check_dimensions(state, "output_dimension", req.output_dimension)
    context = state.max_positions
    limit = min(req.max_tokens or context, context)
    cut = None
    if req.truncate != "NONE":
        cut = inputs.Truncation(limit, "left" if req.truncate == "START" else "right")
    prefix = state.input_type_prefixes.get(req.input_type or "", "")
    ids = await inputs.prompts(state, "texts", [prefix + t for t in req.texts], True, cut)
    for i, seq in enumerate(ids):
        if len(seq) > limit:  # truncate NONE under a max_tokens below the context
            raise BadRequest(
                f"texts[{i}] has {len(seq)} tokens, over max_tokens={limit} (truncate is NONE). "
                "Please reduce the length of the input."
            )
    cfg = state.config
    vectors = await inputs.embed(
        state, ids, cfg.embed_pooling, cfg.embed_normalize, state.timeout_ms(req.timeout_ms)
    )
    n = sum(map(len, ids))
    meta = {
        "api_version": {"version": str(version)},
        "billed_units": {"input_tokens": n},
        "tokens": {"input_tokens": n},
    }
    reply: dict[str, Any] = {"id": uuid.uuid4().hex, "texts": req.texts, "meta": meta}
    if version == 1 and req.embedding_types is None:
        embeddings: Any = Slices(floats(vectors), vectors.shape[-1])
        reply.update(response_type="embeddings_floats", embeddings=embeddings)
    else:
        types = req.embedding_types or ["float"]
        by_type = encodings.cohere_embeddings(vectors, types)
        width = vectors.shape[-1]
        embeddings = {kind: Slices(values, width) for kind, values in by_type.items()}
        reply.update(response_type="embeddings_by_type", embeddings=embeddings)
    return await large_json_response(reply)


REQUEST_MODELS = {embed_v1: EmbedRequest, embed_v2: EmbedRequest}
