"""text-embeddings-inference's routes, for clients pointed at a TEI server: `/embed`, `/embed_all`,
`/rerank` (`{query, texts}`), `/predict`, `/similarity`, `/tokenize` (`{inputs}`), `/decode`,
`/info`. Errors on these routes are TEI's `{"error", "error_type"}` (`error_response`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import inputs
from boundgen.server.bodies import json_response, large_json_response, parse, read
from boundgen.server.errors import BadRequest, ServerError
from boundgen.server.handler_state import HandlerState
from boundgen.server.json import Slices, floats
from boundgen.server.schemas.tei import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
    TokenizeRequest,
)

# TEI's error types and their statuses (router/src/http/types.rs, docs/openapi.json)
_STATUS = {
    "Empty": 400,
    "Validation": 422,
    "Tokenizer": 422,
    "Overloaded": 429,
    "Unhealthy": 503,
    "Backend": 424,
}


class Empty(BadRequest):
    """TEI's `Empty`: nothing to work on (400)."""

    tei_type = "Empty"


def error_response(exc: ServerError) -> Response:
    """A boundgen error in TEI's shape: a bad request is `Validation` (422), a full queue
    `Overloaded` (429), a server shutting down `Unhealthy` (503), a model failure or deadline
    `Backend` (424); an auth or routing error keeps its status."""
    kind = getattr(exc, "tei_type", None)
    status = exc.status
    if kind is None:
        kind = {429: "Overloaded", 503: "Unhealthy"}.get(status)
        if kind is None:
            kind = "Backend" if status >= 500 else "Validation"
        if status in (400, 413) or status >= 500:
            status = _STATUS[kind]
    else:
        status = _STATUS[kind]
    return json_response({"error": exc.message, "error_type": kind}, status, exc.headers)


def mark(request: Request) -> None:
    """Errors of this request are answered in TEI's shape (a path TEI shares with another peer)."""
    request.state.error_style = "tei"


def _cut(state: HandlerState, truncate: bool | None, direction: str) -> inputs.Truncation | None:
    """TEI's `truncate`: cut to the model's context (else over-long inputs are refused)."""
    return inputs.Truncation(state.max_positions, direction.lower()) if truncate else None


async def _prompt_ids(state: HandlerState, value: Any, truncate, direction) -> list[list[int]]:
    if value == "" or value == []:
        raise Empty("`inputs` cannot be empty")
    return await inputs.prompts(state, "inputs", value, True, _cut(state, truncate, direction))


# ---- /embed, /embed_all, /similarity ------------------------------------------------------------


async def embed(request: Request, state: HandlerState) -> Response:
    req = await read(request, state, EmbedRequest)
    inputs.check_dimensions(state, "dimensions", req.dimensions)
    ids = await _prompt_ids(state, req.inputs, req.truncate, req.truncation_direction)
    vectors = await inputs.embed(
        state, ids, state.config.embed_pooling, req.normalize, state.timeout_ms(req.timeout_ms)
    )
    return await large_json_response(Slices(floats(vectors), vectors.shape[-1]))


async def embed_all(request: Request, state: HandlerState) -> Response:
    """Every token's hidden state, per input: [[[float]]]."""
    req = await read(request, state, EmbedAllRequest)
    ids = await _prompt_ids(state, req.inputs, req.truncate, req.truncation_direction)
    rows = await inputs.token_embeddings(state, ids, False, state.timeout_ms(req.timeout_ms))
    size = sum(r.size for r in rows) // max(1, len(rows))
    return await large_json_response(Slices([floats(r) for r in rows], size))


async def similarity(request: Request, state: HandlerState) -> Response:
    """Cosine similarity of `source_sentence` with each of `sentences`."""
    req = await read(request, state, SimilarityRequest)
    if not req.inputs.sentences:
        raise Empty("`sentences` cannot be empty")
    texts = [req.inputs.source_sentence, *req.inputs.sentences]
    ids = await _prompt_ids(state, texts, req.truncate, req.truncation_direction)
    vectors = await inputs.embed(
        state, ids, state.config.embed_pooling, True, state.timeout_ms(req.timeout_ms)
    )
    return json_response((vectors[1:] @ vectors[0]).astype(np.float64).tolist())


# ---- /rerank ------------------------------------------------------------------------------------


async def rerank_body(request: Request, body: dict[str, Any], state: HandlerState) -> Response:
    """`[{index, score, text?}]` best first, ties higher index first (TEI sorts ascending, then
    reverses); `raw_scores`: the relevance's logit."""
    mark(request)
    req = parse(RerankRequest, body)
    if not req.texts:
        raise Empty("`texts` cannot be empty")
    cut = inputs.DocumentCut(total=_cut(state, req.truncate, req.truncation_direction))
    rel = await inputs.relevance(
        state,
        req.query,
        req.texts,
        inputs.rerank_labels(state),
        state.timeout_ms(req.timeout_ms),
        cut=cut,
    )
    scores = rel.logit if req.raw_scores else rel.probability
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], -i))
    return json_response(
        [
            {"index": i, "score": scores[i], **({"text": req.texts[i]} if req.return_text else {})}
            for i in order
        ]
    )


# ---- /predict (sequence classifiers) ------------------------------------------------------------


async def predict(request: Request, state: HandlerState) -> Response:
    """All labels with their probability (logits with `raw_scores`), best first; a text gives one
    list, a batch (a list of one-text lists) one list per text."""
    req = await read(request, state, PredictRequest)
    value = req.inputs
    if isinstance(value, str):
        texts, batch = [value], False
    elif value and all(isinstance(v, str) for v in value):
        if len(value) != 1:
            raise BadRequest(
                "inputs: a list of texts is a text pair in TEI; pairs are not supported (decoder "
                "classifiers have no pair format): send a text, or a batch of one-text lists"
            )
        texts, batch = list(value), False
    else:
        if any(len(v) != 1 for v in value):
            raise BadRequest(
                "inputs: text pairs are not supported (decoder classifiers have no pair format); "
                "a batch is a list of one-text lists"
            )
        texts, batch = [v[0] for v in value], True
    ids = await _prompt_ids(state, texts, req.truncate, req.truncation_direction)
    scores = await inputs.classify(
        state, ids, state.timeout_ms(req.timeout_ms), softmax=not req.raw_scores
    )
    predictions = [
        [
            {"label": state.label(j), "score": s}
            for j, s in sorted(enumerate(row), key=lambda js: -js[1])
        ]
        for row in scores
    ]
    return json_response(predictions if batch else predictions[0])


# ---- /tokenize, /decode, /info ------------------------------------------------------------------


async def tokenize_body(request: Request, body: dict[str, Any], state: HandlerState) -> Response:
    """Per input `[{id, text, special, start, stop}]`: a special token's text is the token, any
    other's the characters it came from."""
    mark(request)
    req = parse(TokenizeRequest, body)
    texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    if not texts:
        raise Empty("`inputs` cannot be empty")
    state.limits.count("inputs", len(texts), state.max_items, "max_items")
    tok = state.tokenizer
    out = []
    for text, enc in zip(texts, tok.encode_with_offsets(texts, req.add_special_tokens)):
        tokens = []
        for token_id, (start, stop), special in zip(enc.ids, enc.offsets, enc.special):
            if special:
                tokens.append(
                    {"id": token_id, "text": tok.id_to_token(token_id) or "", "special": True}
                )
            else:
                tokens.append(
                    {
                        "id": token_id,
                        "text": text[start:stop],
                        "special": False,
                        "start": start,
                        "stop": stop,
                    }
                )
        out.append(tokens)
    return json_response(out)


async def decode(request: Request, state: HandlerState) -> Response:
    req = await read(request, state, DecodeRequest)
    ids = req.ids
    batch = [ids] if not ids or isinstance(ids[0], int) else ids
    for i, seq in enumerate(batch):
        state.limits.token_ids(f"ids[{i}]", seq)
    tok = state.tokenizer
    return json_response(
        [tok.decode(seq, skip_special_tokens=req.skip_special_tokens) for seq in batch]
    )


async def info(request: Request, state: HandlerState) -> Response:
    from boundgen import __version__

    facts = state.facts
    if state.can_classify:
        labels = {str(i): state.label(i) for i in range(state.num_labels)}
        model_type: dict[str, Any] = {
            "classifier": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}
        }
    else:
        model_type = {"embedding": {"pooling": state.config.embed_pooling}}
    return json_response(
        {
            "model_id": facts.model_path,
            "model_sha": None,
            "model_dtype": facts.dtype,
            "model_type": model_type,
            "served_model_name": state.model_name,
            "max_concurrent_requests": state.config.max_queue,
            "max_input_length": state.max_positions,
            "max_batch_tokens": facts.token_budget,
            "max_batch_requests": None,
            "max_client_batch_size": state.max_items,
            "auto_truncate": False,
            "tokenization_workers": facts.cpu_workers,
            "version": __version__,
        }
    )


def add_routes(route) -> None:
    """TEI's own paths (`/rerank` and `/tokenize` are shared: `handlers` dispatches them)."""
    route("/embed", "tei.embed", embed, errors="tei")
    route("/embed_all", "tei.embed_all", embed_all, errors="tei")
    route("/similarity", "tei.similarity", similarity, errors="tei")
    route("/predict", "tei.predict", predict, errors="tei")
    route("/decode", "tei.decode", decode, errors="tei")
    route("/info", "tei.info", info, ("GET",), errors="tei")


REQUEST_MODELS = {
    embed: EmbedRequest,
    embed_all: EmbedAllRequest,
    similarity: SimilarityRequest,
    predict: PredictRequest,
    decode: DecodeRequest,
}
