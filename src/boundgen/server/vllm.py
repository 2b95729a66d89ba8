"""vLLM's pooling API: `/score` (and `/v1/score` with vLLM's fields), `/classify` and
`/v1/classify`, `/pooling`, `/tokenize` (`{prompt}`), `/detokenize`."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import encodings, inputs
from boundgen.server.bodies import json_response, large_json_response, parse, read, read_object
from boundgen.server.errors import BadRequest
from boundgen.server.handler_state import HandlerState
from boundgen.server.json import Slices
from boundgen.server.schemas.common import Usage
from boundgen.server.schemas.vllm import (
    SCORE_PAIRS,
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    DetokenizeRequest,
    PoolingRequest,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
)

POOLING_TASKS = ("embed", "token_embed", "classify")

# ---- /score -------------------------------------------------------------------------------------


async def score(request: Request, state: HandlerState) -> Response:
    return await score_pairs(await read_object(request, state), state)


def _pairs(req: ScoreRequest) -> tuple[list[str], list[str]]:
    """(first, second) text per pair: one first text goes with every second, else one each."""
    given = [name for name in SCORE_PAIRS if getattr(req, name) is not None]
    if len(given) != 1:
        raise BadRequest(
            "send one pair of fields: queries + documents, text_1 + text_2 or data_1 + data_2"
        )
    first_name = given[0]
    partners = [name for name in SCORE_PAIRS[first_name] if getattr(req, name) is not None]
    if len(partners) != 1:
        raise BadRequest(f"{first_name} needs one of {' or '.join(SCORE_PAIRS[first_name])}")
    second_name = partners[0]
    first, second = getattr(req, first_name), getattr(req, second_name)
    first = [first] if isinstance(first, str) else first
    second = [second] if isinstance(second, str) else second
    if not first or not second:
        raise BadRequest(f"{first_name if not first else second_name} is empty")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise BadRequest(
            f"{first_name} has {len(first)} texts and {second_name} {len(second)}: give one "
            f"text in {first_name}, or as many as in {second_name}"
        )
    return first, second


async def score_pairs(body: dict[str, Any], state: HandlerState) -> Response:
    """vLLM's ScoreRequest: each pair's relevance, as the server's rerank computes it (its templates
    and label tokens); with `label_token_ids`, P(first label) over those labels after the two texts
    joined. `use_activation: false` gives the logit."""
    req = parse(ScoreRequest, body)
    firsts, seconds = _pairs(req)
    if req.label_token_ids is not None:
        if not req.label_token_ids:
            raise BadRequest("label_token_ids must contain at least one token ID")
        labels, templates = inputs.label_ids(state, req.label_token_ids), False
    else:
        labels, templates = inputs.rerank_labels(state), True
    cut = inputs.DocumentCut(total=inputs.truncation(state, req.truncate_prompt_tokens))
    by_query: dict[str, list[int]] = {}
    for i, q in enumerate(firsts):
        by_query.setdefault(q, []).append(i)
    timeout = state.timeout_ms(req.timeout_ms)
    results = await asyncio.gather(
        *(
            inputs.relevance(state, q, [seconds[i] for i in idx], labels, timeout, templates, cut)
            for q, idx in by_query.items()
        )
    )
    scores = [0.0] * len(seconds)
    for idx, rel in zip(by_query.values(), results):
        values = rel.logit if req.use_activation is False else rel.probability
        for i, v in zip(idx, values):
            scores[i] = v
    n = sum(r.prompt_tokens for r in results)
    return json_response(
        ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=state.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=Usage(prompt_tokens=n, total_tokens=n, completion_tokens=0),
        )
    )


# ---- /classify ----------------------------------------------------------------------------------


async def classify(request: Request, state: HandlerState) -> Response:
    req = await read(request, state, ClassifyRequest)
    cut = inputs.truncation(state, req.truncate_prompt_tokens, req.truncation_side)
    ids = await inputs.prompts(state, "input", req.input, req.add_special_tokens, cut)
    softmax = req.use_activation is not False
    probs = await inputs.classify(state, ids, state.timeout_ms(req.timeout_ms), softmax)
    data = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=p.__getitem__)
        data.append(ClassifyData(index=i, label=state.label(best), probs=p, num_classes=len(p)))
    n = sum(map(len, ids))
    return json_response(
        ClassifyResponse(
            id=f"classify-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=state.model_name,
            data=data,
            usage=Usage(prompt_tokens=n, total_tokens=n, completion_tokens=0),
        )
    )


# ---- /pooling -----------------------------------------------------------------------------------


async def pooling(request: Request, state: HandlerState) -> Response:
    """`task` embed → [H], token_embed → [L, H] (every token's hidden state), classify → [C]."""
    req = await read(request, state, PoolingRequest)
    task = req.task or ("classify" if state.can_classify else "embed")
    if task not in POOLING_TASKS:
        raise BadRequest(
            f"Unsupported task: {task!r}. boundgen serves the pooling tasks "
            + ", ".join(POOLING_TASKS)
        )
    inputs.check_dimensions(state, "dimensions", req.dimensions)
    encodings.check_binary_options(req.encoding_format, req.embed_dtype, req.endianness)
    cut = inputs.truncation(state, req.truncate_prompt_tokens, req.truncation_side)
    ids = await inputs.prompts(state, "input", req.input, req.add_special_tokens, cut)
    timeout = state.timeout_ms(req.timeout_ms)
    if task == "classify":
        if req.normalize is not None:
            raise BadRequest("normalize applies to the embed tasks; classify takes use_activation")
        probs = await inputs.classify(state, ids, timeout, req.use_activation is not False)
        outputs: list[Any] = probs
    else:
        normalize = inputs.normalize_flag(state, req.use_activation, req.normalize)
        if task == "embed":
            pooled = state.config.embed_pooling
            outputs = list(await inputs.embed(state, ids, pooled, normalize, timeout))
        else:
            outputs = await inputs.token_embeddings(state, ids, normalize, timeout)
    n = sum(map(len, ids))
    usage = Usage(prompt_tokens=n, total_tokens=n, completion_tokens=0)
    reply = dict(
        id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name, usage=usage
    )
    if req.encoding_format in ("bytes", "bytes_only"):
        return encodings.bytes_response(
            outputs, req.embed_dtype, req.endianness, reply, req.encoding_format
        )
    # vLLM's PoolingResponse (id, object, created, model, data, usage; each datum index, object,
    # data), built as plain JSON: no validation of every float
    data = [
        {
            "index": i,
            "object": "pooling",
            "data": encodings.json_value(out, req.encoding_format, req.embed_dtype, req.endianness),
        }
        for i, out in enumerate(outputs)
    ]
    size = sum(np.size(out) for out in outputs) // max(1, len(outputs))
    return await large_json_response(
        {
            "id": reply["id"],
            "object": "list",
            "created": reply["created"],
            "model": reply["model"],
            "data": Slices(data, size if req.encoding_format == "float" else 1),
            "usage": usage,
        }
    )


# ---- /tokenize, /detokenize ---------------------------------------------------------------------


async def tokenize_body(body: dict[str, Any], state: HandlerState) -> Response:
    req = parse(TokenizeRequest, body)
    tok = state.tokenizer
    tokens = (await inputs.encode(state, [req.prompt], req.add_special_tokens))[0]
    strs = [tok.id_to_token(t) or "" for t in tokens] if req.return_token_strs else None
    reply = TokenizeResponse(
        count=len(tokens), max_model_len=state.max_positions, tokens=tokens, token_strs=strs
    )
    return json_response(reply, exclude_none=False)


async def detokenize(request: Request, state: HandlerState) -> Response:
    req = await read(request, state, DetokenizeRequest)
    state.limits.token_ids("tokens", req.tokens)
    return json_response({"prompt": state.tokenizer.decode(req.tokens)})


REQUEST_MODELS = {
    score: ScoreRequest,
    classify: ClassifyRequest,
    pooling: PoolingRequest,
    detokenize: DetokenizeRequest,
}
