"""The handler core the HTTP routes and KServe v2 share: text or token ids → checked token ids
(tokenized once, off the event loop when long), then the workload through `Infer`. Handlers only
translate request and response shapes around these calls."""

from __future__ import annotations

import asyncio

import numpy as np

from boundgen.server.errors import BadRequest
from boundgen.server.state import ServerState

# Text longer than this (total characters) is tokenized on a thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


async def encode(state: ServerState, texts: list[str], special: bool = False) -> list[list[int]]:
    """`special`: add the tokenizer's special tokens (as the engine does for embed/classify
    texts)."""
    tok = state.engine.tokenizer

    def run() -> list[list[int]]:
        return [tok.encode(t, add_special_tokens=special) for t in texts]

    if sum(len(t) for t in texts) <= _INLINE_TOKENIZE_CHARS:
        return run()
    return await asyncio.to_thread(run)


async def token_ids(
    state: ServerState,
    what: str,
    value: str | list[int],
    limit: int,
    option: str,
    allow_empty: bool = False,
) -> list[int]:
    ids = (await encode(state, [value]))[0] if isinstance(value, str) else value
    if isinstance(value, list):
        state.limits.token_ids(what, ids)
    if ids or not allow_empty:
        state.limits.tokens(what, len(ids), limit, option)
    return list(ids)


async def many_token_ids(
    state: ServerState, what: str, values: list[str] | list[list[int]], special: bool = False
) -> list[list[int]]:
    """Texts (tokenized, with special tokens when `special`) or token-id lists, each checked."""
    state.limits.count(what, len(values), state.max_items, "max_items")
    if isinstance(values[0], str):
        if not all(isinstance(v, str) for v in values):
            raise BadRequest(f"{what}: mix of text and token ids; use one kind")
        seqs = await encode(state, values, special)  # type: ignore[arg-type]
    else:
        seqs = values  # type: ignore[assignment]
        for i, ids in enumerate(seqs):
            state.limits.token_ids(f"{what}[{i}]", ids)
    for i, ids in enumerate(seqs):
        state.limits.tokens(
            f"{what}[{i}]", len(ids), state.config.max_item_tokens, "max_item_tokens"
        )
    return [list(s) for s in seqs]


def label_ids(state: ServerState, ids: list[int]) -> list[int]:
    """Score label token ids: how many, and each inside the vocabulary."""
    cfg = state.config
    state.limits.count("label_token_ids", len(ids), cfg.max_label_tokens, "max_label_tokens")
    state.limits.token_ids("label_token_ids", ids)
    return list(ids)


async def text_inputs(state: ServerState, what: str, value) -> list[list[int]]:
    """OpenAI-style `input` (str | list[str] | list[int] | list[list[int]]) → token ids per text,
    text with the tokenizer's special tokens (what classify and embed run on)."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise BadRequest(f"{what} is empty")
    if isinstance(value[0], int):
        value = [value]
    ids = await many_token_ids(state, what, value, special=True)
    for i, seq in enumerate(ids):
        state.limits.context(f"{what}[{i}]", len(seq))
    return ids


async def score(
    state: ServerState,
    query: list[int],
    items: list[list[int]],
    label_ids: list[int],
    apply_softmax: bool,
    item_first: bool,
    timeout_ms: int,
) -> list[list[float]]:
    state.limits.context("query + longest item", len(query) + max(len(i) for i in items))
    request = dict(
        query=query,
        items=items,
        label_token_ids=label_ids,
        apply_softmax=apply_softmax,
        item_first=item_first,
    )
    tokens = len(query) + sum(len(i) for i in items)
    scores = await state.infer("score", request, timeout_ms, tokens)
    state.metrics.items.labels("score").inc(len(items))
    return scores


async def classify(state: ServerState, ids: list[list[int]], timeout_ms: int) -> list[list[float]]:
    """Class probabilities per text."""
    if not state.can_classify:
        raise BadRequest(
            f"model {state.model_name!r} has no classification head; classify needs a "
            "*ForSequenceClassification checkpoint"
        )
    tokens = sum(len(s) for s in ids)
    probs = await state.infer("classify", dict(texts=ids, softmax=True), timeout_ms, tokens)
    state.metrics.items.labels("classify").inc(len(ids))
    return probs


async def embed(
    state: ServerState, ids: list[list[int]], pooling: str, normalize: bool, timeout_ms: int
) -> np.ndarray:
    """float32 [N, D] embeddings."""
    request = dict(texts=ids, pooling=pooling, normalize=normalize)
    vectors = await state.infer("embed", request, timeout_ms, sum(len(s) for s in ids))
    state.metrics.items.labels("embeddings").inc(len(ids))
    # a device tensor: the copy waits for the GPU, so not on the event loop
    return await asyncio.to_thread(lambda: vectors.float().cpu().numpy())
