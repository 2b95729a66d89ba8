"""HTTP handlers of boundgen's own routes and of the routes several peers share: each reads its
body, calls the shared core (`inputs`), and shapes the response. Peer-only routes live in
`vllm.py`, `cohere.py`, `tei.py` and `kserve.py`. Nothing here blocks the event loop on the model.

Shared paths pick the peer from the body (docs/compat.md): `/v1/score` is vLLM's with `queries`,
`text_1` or `data_1`, else SGLang's; `/rerank` is TEI's with `texts`; `/tokenize` is TEI's with
`inputs`; `/v1/rerank` answers in the format the server option `rerank_v1_format` names.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import cohere, encodings, inputs, tei, vllm
from boundgen.server.bodies import json_response, large_json_response, parse, read, read_object
from boundgen.server.errors import BadRequest, TooLarge, Unavailable
from boundgen.server.handler_state import HandlerState
from boundgen.server.json import Slices
from boundgen.server.schemas.boundgen import BeamRequest
from boundgen.server.schemas.cohere import RerankRequest
from boundgen.server.schemas.common import Usage
from boundgen.server.schemas.openai import EmbeddingsRequest
from boundgen.server.schemas.sglang import RerankResult, ScoreRequest, score_reply
from boundgen.server.schemas.vllm import TokenizeRequest
from boundgen.server.timing import SERVER_TIMES

# ---- /v1/score: SGLang, or vLLM's ScoreRequest -------------------------------------------------


async def score(request: Request, state: HandlerState) -> Response:
    """SGLang's `/v1/score` (its flat error body), or vLLM's with vLLM's fields (its nested one)."""
    body = await read_object(request, state)
    if body.keys() & vllm.SCORE_PAIRS.keys():
        request.state.error_style = "openai"
        return await vllm.score_pairs(body, state)
    req = parse(ScoreRequest, body)
    items = [req.items] if isinstance(req.items, str) else req.items
    if not items:  # SGLang answers no scores, without a model call
        return json_response(score_reply([], state.model_name, 0))
    if isinstance(req.query, str) != isinstance(items[0], str):
        raise BadRequest("query and items must both be text or both be token ids")
    labels = inputs.label_ids(state, req.label_token_ids)
    item_first = req.item_first
    if isinstance(req.query, str):
        group = await inputs.joined_text(state, req.query, items, item_first)
        query, item_ids, item_first = group.prefix, group.suffixes, False
    else:
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
        item_first,
        state.timeout_ms(req.timeout_ms),
    )
    n = len(query) * len(item_ids) + sum(map(len, item_ids))
    return json_response(score_reply(scores, state.model_name, n))


# ---- rerank: Cohere / vLLM, SGLang's reply, TEI's {query, texts} --------------------------------


async def rerank(request: Request, state: HandlerState) -> Response:
    """`/rerank`: TEI's with `texts`, else Cohere's / vLLM's."""
    body = await read_object(request, state)
    if "texts" in body:
        return await tei.rerank_body(request, body, state)
    return await cohere.rerank_body(body, state)


async def rerank_v1(request: Request, state: HandlerState) -> Response:
    """`/v1/rerank`: Cohere's reply, or SGLang's with `rerank_v1_format: sglang`."""
    body = await read_object(request, state)
    if state.config.rerank_v1_format == "sglang":
        return await sglang_rerank(body, state)
    return await cohere.rerank_body(body, state)


async def rerank_v2(request: Request, state: HandlerState) -> Response:
    return await cohere.rerank_body(await read_object(request, state), state)


async def sglang_rerank(body: dict[str, Any], state: HandlerState) -> Response:
    """SGLang's `/v1/rerank` reply: a list of `{score, document, index}`, best first (`document`
    null when `return_documents` is false)."""
    req = parse(RerankRequest, body)
    ranking = await cohere.rank(state, req)
    with_docs = req.return_documents is not False
    return json_response(
        [
            RerankResult(
                score=ranking.scores[i],
                document=ranking.texts[i] if with_docs else None,
                index=i,
            )
            for i in ranking.order
        ],
        exclude_none=False,
    )


# ---- /tokenize: vLLM's {prompt} or TEI's {inputs} ------------------------------------------------


async def tokenize(request: Request, state: HandlerState) -> Response:
    body = await read_object(request, state)
    if "inputs" in body:
        return await tei.tokenize_body(request, body, state)
    return await vllm.tokenize_body(body, state)


# ---- /v1/embeddings (OpenAI, with vLLM's extras) -------------------------------------------------


async def embeddings(request: Request, state: HandlerState) -> Response:
    req = await read(request, state, EmbeddingsRequest)
    inputs.check_dimensions(state, "dimensions", req.dimensions)
    encodings.check_binary_options(req.encoding_format, req.embed_dtype, req.endianness)
    normalize = inputs.normalize_flag(state, req.use_activation, req.normalize)
    cut = inputs.truncation(state, req.truncate_prompt_tokens, req.truncation_side)
    ids = await inputs.prompts(state, "input", req.input, req.add_special_tokens, cut)
    pooling = req.pooling or state.config.embed_pooling
    vectors = await inputs.embed(state, ids, pooling, normalize, state.timeout_ms(req.timeout_ms))
    n = sum(map(len, ids))
    usage = Usage(prompt_tokens=n, total_tokens=n)
    reply = dict(model=state.model_name, usage=usage)
    if req.encoding_format in ("bytes", "bytes_only"):
        return encodings.bytes_response(
            list(vectors), req.embed_dtype, req.endianness, reply, req.encoding_format
        )
    # EmbeddingsResponse's fields, in its order, without validating every float
    fmt = req.encoding_format, req.embed_dtype, req.endianness
    data = [
        {"object": "embedding", "index": i, "embedding": encodings.json_value(v, *fmt)}
        for i, v in enumerate(vectors)
    ]
    width = vectors.shape[-1] if req.encoding_format == "float" else 1
    return await large_json_response(
        {"object": "list", "data": Slices(data, width), "model": state.model_name, "usage": usage}
    )


# ---- /v1/beam (boundgen) ------------------------------------------------------------------------


async def beam(request: Request, state: HandlerState) -> Response:
    t0 = time.perf_counter()
    req = await read(request, state, BeamRequest)
    t_parse = time.perf_counter()
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
        prompts=[prompt],
        beam_width=req.beam_width,
        steps=req.steps,
        top_k=req.top_k,
        trie=trie,
        item_ids=trie is not None,  # looked up for the whole merged search, off the event loop
    )
    # admission counts what the beam node counts: the prompt and every beam's decoded tokens
    units = len(prompt) + req.beam_width * req.steps
    t_prep = time.perf_counter()
    (beams,) = await state.infer("beam", request_fields, state.timeout_ms(req.timeout_ms), units)
    t_infer = time.perf_counter()
    # the rows come back as lists (made once per merged search): the reply is plain data, its
    # keys those of `BeamResponse` (None left out, as `json_response` leaves it)
    if trie is not None:
        results = [
            {"tokens": t, "score": s} if i is None else {"tokens": t, "score": s, "item_id": i}
            for t, s, i in beams
        ]
    else:
        results = [{"tokens": t, "score": s} for t, s in beams]
    state.metrics.items.labels("beam").inc(len(results))
    n = len(prompt)
    usage = {"prompt_tokens": n, "total_tokens": n + req.steps, "completion_tokens": req.steps}
    reply = {"object": "beam", "model": state.model_name, "results": results, "usage": usage}
    response = json_response(reply)
    stages(t0, t_parse, t_prep, t_infer)
    return response


def stages(t0: float, t_parse: float, t_prep: float, t_infer: float) -> None:
    """The handler's own stages in `Server-Timing`, before the runtime's entries: `parse` (body,
    JSON, schema), `prep` (checks, token ids), `infer` (submit to the runtime until the result is
    back on the event loop), `hops` (`infer` less the runtime's own time: the hand-over to a
    worker thread and back to the loop), `reply` (results to JSON bytes)."""
    ms = 1e3
    times = SERVER_TIMES.get() or []
    runtime = next((v for k, v in times if k == "runtime"), None)
    infer = (t_infer - t_prep) * ms
    own = [
        ("parse", (t_parse - t0) * ms),
        ("prep", (t_prep - t_parse) * ms),
        ("infer", infer),
    ]
    if runtime is not None:
        own.append(("hops", max(0.0, infer - runtime)))
    own.append(("reply", (time.perf_counter() - t_infer) * ms))
    SERVER_TIMES.set(own + times)


# ---- models, health, metrics --------------------------------------------------------------------


def model_card(state: HandlerState) -> dict[str, Any]:
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
        "trie_depths": dict(sorted(state.facts.trie_depths.items())),
        "rerank_label_token_ids": state.rerank_label_ids,
    }


async def models(request: Request, state: HandlerState) -> Response:
    return json_response({"object": "list", "data": [model_card(state)]})


async def health(request: Request, state: HandlerState) -> Response:
    if state.draining:
        raise Unavailable("server is shutting down")
    if not state.ready:
        raise Unavailable(f"model is not ready: {state.unready}")
    return Response('{"status":"ok"}', media_type="application/json")


async def metrics(request: Request, state: HandlerState) -> Response:
    body, content_type = await state.metrics_text()
    return Response(body, media_type=content_type)


# body schema of each handler, for /docs (handlers parse bodies themselves, with clear 400s); a
# shared path shows its first peer's type
REQUEST_MODELS = {
    score: ScoreRequest,
    rerank: RerankRequest,
    rerank_v1: RerankRequest,
    rerank_v2: RerankRequest,
    tokenize: TokenizeRequest,
    embeddings: EmbeddingsRequest,
    beam: BeamRequest,
    **vllm.REQUEST_MODELS,
    **cohere.REQUEST_MODELS,
    **tei.REQUEST_MODELS,
}
