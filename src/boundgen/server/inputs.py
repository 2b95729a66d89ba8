"""The handler core the HTTP routes and KServe v2 share: text or token ids → checked token ids
(tokenized once, off the event loop when long), then the workload through `Infer`. Handlers only
translate request and response shapes around these calls.

Every limit is checked before the work it bounds: a text's length in characters before it is
tokenized (`CHARS_PER_TOKEN` per token of its limit), its tokens after, and the request's tokens
for the model (`max_request_tokens`) before `Infer` admits it. Token limits are at most the
model's context.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from boundgen.server.errors import BadRequest, TooLarge
from boundgen.server.state import ServerState

# No tokenizer averages more than this many characters per token on real text (English ~4), so a
# text longer than this many per token of its limit is refused without tokenizing it.
CHARS_PER_TOKEN = 16
# Texts longer than this in all (characters) are tokenized off the event loop, by `encode_batch`
# (which releases the GIL) on one thread of their own; shorter ones inline (~1 ms).
_INLINE_TOKENIZE_CHARS = 2048
_tokenizer_thread: ThreadPoolExecutor | None = None


def _tokenizer_pool() -> ThreadPoolExecutor:
    global _tokenizer_thread
    if _tokenizer_thread is None:
        _tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="boundgen-tokenize")
    return _tokenizer_thread


def token_limit(state: ServerState, limit: int, option: str) -> tuple[int, str]:
    """(`limit` at most the model's context, how to name it in a message)."""
    context = state.max_positions
    if context and context < limit:
        return context, f"{option}, at most the model's context"
    return limit, option


def check_chars(state: ServerState, what: str, texts: list[str], limit: int, option: str) -> None:
    """Before tokenizing: each text at most CHARS_PER_TOKEN × its token limit in characters, and
    all of them at most CHARS_PER_TOKEN × max_request_tokens (413)."""
    cap = CHARS_PER_TOKEN * limit
    for i, text in enumerate(texts):
        if len(text) > cap:
            name = what if len(texts) == 1 else f"{what}[{i}]"
            raise TooLarge(
                f"{name} has {len(text)} characters; the limit is {cap} "
                f"({CHARS_PER_TOKEN} per token of the {limit}-token limit, server option {option})"
            )
    budget = state.config.max_request_tokens
    total = sum(len(t) for t in texts)
    if total > CHARS_PER_TOKEN * budget:
        raise TooLarge(
            f"{what} has {total} characters in all; the limit is {CHARS_PER_TOKEN * budget} "
            f"({CHARS_PER_TOKEN} per token of server option max_request_tokens={budget})"
        )


async def encode(state: ServerState, texts: list[str], special: bool = False) -> list[list[int]]:
    """Token ids of texts whose length was checked (`check_chars`). `special`: add the
    tokenizer's special tokens (as the engine does for embed/classify texts)."""
    tok = state.engine.tokenizer
    if sum(len(t) for t in texts) <= _INLINE_TOKENIZE_CHARS:
        return [tok.encode(t, add_special_tokens=special) for t in texts]
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_tokenizer_pool(), tok.encode_batch, texts, special)


async def token_ids(
    state: ServerState,
    what: str,
    value: str | list[int],
    limit: int,
    option: str,
    allow_empty: bool = False,
) -> list[int]:
    limit, option = token_limit(state, limit, option)
    if isinstance(value, str):
        check_chars(state, what, [value], limit, option)
        ids = (await encode(state, [value]))[0]
    else:
        ids = value
        state.limits.token_ids(what, ids)
    if ids or not allow_empty:
        state.limits.tokens(what, len(ids), limit, option)
    return list(ids)


async def many_token_ids(
    state: ServerState, what: str, values: list[str] | list[list[int]], special: bool = False
) -> list[list[int]]:
    """Texts (tokenized, with special tokens when `special`) or token-id lists, each checked."""
    state.limits.count(what, len(values), state.max_items, "max_items")
    limit, option = token_limit(state, state.config.max_item_tokens, "max_item_tokens")
    if isinstance(values[0], str):
        if not all(isinstance(v, str) for v in values):
            raise BadRequest(f"{what}: mix of text and token ids; use one kind")
        check_chars(state, what, values, limit, option)  # type: ignore[arg-type]
        seqs = await encode(state, values, special)  # type: ignore[arg-type]
    else:
        seqs = values  # type: ignore[assignment]
        for i, ids in enumerate(seqs):
            state.limits.token_ids(f"{what}[{i}]", ids)
    for i, ids in enumerate(seqs):
        state.limits.tokens(f"{what}[{i}]", len(ids), limit, option)
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
    # what the model runs: the query once as the items' shared prefix, or before each item
    tokens = len(query) * (len(items) if item_first else 1) + sum(len(i) for i in items)
    state.limits.request_tokens(tokens)
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
    state.limits.request_tokens(tokens)
    probs = await state.infer("classify", dict(texts=ids, softmax=True), timeout_ms, tokens)
    state.metrics.items.labels("classify").inc(len(ids))
    return probs


async def embed(
    state: ServerState, ids: list[list[int]], pooling: str, normalize: bool, timeout_ms: int
) -> np.ndarray:
    """float32 [N, D] embeddings."""
    request = dict(texts=ids, pooling=pooling, normalize=normalize)
    tokens = sum(len(s) for s in ids)
    state.limits.request_tokens(tokens)
    vectors = await state.infer("embed", request, timeout_ms, tokens)
    state.metrics.items.labels("embeddings").inc(len(ids))
    # a device tensor: the copy waits for the GPU, so not on the event loop
    return await asyncio.to_thread(lambda: vectors.float().cpu().numpy())
