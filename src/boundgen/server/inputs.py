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
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from boundgen.server.errors import BadRequest, TooLarge
from boundgen.server.handler_state import HandlerState
from boundgen.server.link import host_floats
from boundgen.text.sequences import SequenceGroup, shared_prefix_group
from boundgen.workloads.inputs import joined_sequences, out_of_vocabulary

# No tokenizer averages more than this many characters per token on real text (English ~4), so a
# text longer than this many per token of its limit is refused without tokenizing it.
CHARS_PER_TOKEN = 16
# Texts longer than this in all (characters) are tokenized off the event loop, by `encode_batch`
# (which releases the GIL) on one thread of their own; shorter ones inline (~1 ms).
_INLINE_TOKENIZE_CHARS = 2048
_tokenizer_thread: ThreadPoolExecutor | None = None
T = TypeVar("T")


def _tokenizer_pool() -> ThreadPoolExecutor:
    global _tokenizer_thread
    if _tokenizer_thread is None:
        _tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="boundgen-tokenize")
    return _tokenizer_thread


def token_limit(state: HandlerState, limit: int, option: str) -> tuple[int, str]:
    """(`limit` at most the model's context, how to name it in a message)."""
    context = state.max_positions
    if context and context < limit:
        return context, f"{option}, at most the model's context"
    return limit, option


def check_chars(state: HandlerState, what: str, texts: list[str], limit: int, option: str) -> None:
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
    total = sum(map(len, texts))
    if total > CHARS_PER_TOKEN * budget:
        raise TooLarge(
            f"{what} has {total} characters in all; the limit is {CHARS_PER_TOKEN * budget} "
            f"({CHARS_PER_TOKEN} per token of server option max_request_tokens={budget})"
        )


async def tokenizing(work: Callable[[], T], chars: int) -> T:
    """`work` (tokenizer calls that release the GIL: `encode_batch`, `encode_with_offsets`) inline
    when it is short, else on the tokenizer's own thread, so the event loop keeps serving."""
    if chars <= _INLINE_TOKENIZE_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_tokenizer_pool(), work)


async def encode(state: HandlerState, texts: list[str], special: bool = False) -> list[list[int]]:
    """Token ids of texts whose length was checked (`check_chars`). `special`: add the
    tokenizer's special tokens (as the engine does for embed/classify texts)."""
    tok = state.tokenizer
    if sum(map(len, texts)) <= _INLINE_TOKENIZE_CHARS:
        return [tok.encode(t, add_special_tokens=special) for t in texts]
    return await tokenizing(lambda: tok.encode_batch(texts, special), _INLINE_TOKENIZE_CHARS + 1)


async def token_ids(
    state: HandlerState,
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
    state: HandlerState, what: str, values: list[str] | list[list[int]], special: bool = False
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
        state.limits.many_token_ids(what, seqs)
    lengths = list(map(len, seqs))
    if min(lengths) == 0 or max(lengths) > limit:  # in C: the common case; else name the first
        for i, n in enumerate(lengths):
            state.limits.tokens(f"{what}[{i}]", n, limit, option)
    # the lists are this request's own, and lists (validated from its body, or the tokenizer's
    # `.ids`): no copies (py-spy put ~10 % of the event loop's GIL time at W5's saturation on the
    # line that copied a W2 request's 100 item lists)
    return seqs


def label_ids(state: HandlerState, ids: list[int]) -> list[int]:
    """Score label token ids: how many, and each inside the vocabulary."""
    cfg = state.config
    state.limits.count("label_token_ids", len(ids), cfg.max_label_tokens, "max_label_tokens")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise BadRequest(out_of_vocabulary(bad[0], state.vocab_size))
    return list(ids)


def as_sequences(what: str, value) -> list:
    """A text, texts, token ids or lists of token ids as a list of texts or id lists (400 when
    empty): the shapes OpenAI-style `input` fields take."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequest(f"{what} is empty")
    return [value] if isinstance(value[0], int) else value


async def text_inputs(state: HandlerState, what: str, value) -> list[list[int]]:
    """OpenAI-style `input` (str | list[str] | list[int] | list[list[int]]) → token ids per text,
    text with the tokenizer's special tokens (what classify and embed run on)."""
    ids = await many_token_ids(state, what, as_sequences(what, value), special=True)
    for i, seq in enumerate(ids):
        state.limits.context(f"{what}[{i}]", len(seq))
    return ids


async def score(
    state: HandlerState,
    query: list[int],
    items: list[list[int]],
    label_ids: list[int],
    apply_softmax: bool,
    item_first: bool,
    timeout_ms: int,
    raw_logits: bool = False,
) -> list[list[float]]:
    """Per item: the label scores of `workloads.score` (`raw_logits`: the label logits)."""
    lengths = list(map(len, items))  # in C: 5 µs, against 9 for two generator passes (100 items)
    state.limits.context("query + longest item", len(query) + max(lengths))
    request = dict(
        query=query,
        items=items,
        label_token_ids=label_ids,
        apply_softmax=apply_softmax,
        item_first=item_first,
        raw_logits=raw_logits,
    )
    # what the model runs: the query once as the items' shared prefix, or before each item
    tokens = len(query) * (len(items) if item_first else 1) + sum(lengths)
    state.limits.request_tokens(tokens)
    scores = await state.infer("score", request, timeout_ms, tokens)
    state.metrics.items.labels("score").inc(len(items))
    return scores


async def classify(
    state: HandlerState, ids: list[list[int]], timeout_ms: int, softmax: bool = True
) -> list[list[float]]:
    """Class probabilities per text (logits unless `softmax`)."""
    if not state.can_classify:
        raise BadRequest(
            f"model {state.model_name!r} has no classification head; classify needs a "
            "*ForSequenceClassification checkpoint"
        )
    tokens = sum(map(len, ids))
    state.limits.request_tokens(tokens)
    probs = await state.infer("classify", dict(texts=ids, softmax=softmax), timeout_ms, tokens)
    state.metrics.items.labels("classify").inc(len(ids))
    return probs


async def embed(
    state: HandlerState, ids: list[list[int]], pooling: str, normalize: bool, timeout_ms: int
) -> np.ndarray:
    """float32 [N, D] embeddings."""
    request = dict(texts=ids, pooling=pooling, normalize=normalize)
    tokens = sum(map(len, ids))
    state.limits.request_tokens(tokens)
    vectors = await state.infer("embed", request, timeout_ms, tokens)
    state.metrics.items.labels("embeddings").inc(len(ids))
    return await host_floats(vectors)


async def token_embeddings(
    state: HandlerState, ids: list[list[int]], normalize: bool, timeout_ms: int
) -> list[np.ndarray]:
    """float32 [L, D] per text: every token's hidden state (each row normalized when asked)."""
    request = dict(texts=ids, pooling="tokens", normalize=normalize)
    vectors = await state.infer("embed", request, timeout_ms, sum(map(len, ids)))
    state.metrics.items.labels("embeddings").inc(len(ids))
    return await host_floats(vectors)


# ---- the peers' inputs: truncation, prompts, joined text, pair relevance (issue 18) -------------


@dataclass(frozen=True)
class Truncation:
    """Keep at most `tokens` tokens: the first ones (`side` "right": the end is cut) or the last
    ones ("left")."""

    tokens: int
    side: str = "right"

    def apply(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.tokens:
            return ids
        return ids[len(ids) - self.tokens :] if self.side == "left" else ids[: self.tokens]


def truncation(
    state: HandlerState,
    tokens: int | None,
    side: str = "right",
    what: str = "truncate_prompt_tokens",
) -> Truncation | None:
    """vLLM's `truncate_prompt_tokens` (-1: the model's context) as a `Truncation`."""
    if tokens is None:
        return None
    context = state.max_positions
    if tokens == -1:
        tokens = context
    if tokens > context:
        raise BadRequest(
            f"{what}={tokens} is greater than max_model_len={context}. Please request a smaller "
            "truncation size."
        )
    if tokens < 1:
        raise BadRequest(f"{what}={tokens} keeps no tokens; give a positive count, or -1")
    return Truncation(tokens, side.lower())


async def prompts(
    state: HandlerState,
    what: str,
    value: str | list,
    special: bool = True,
    cut: Truncation | None = None,
) -> list[list[int]]:
    """A text, texts, token ids or lists of them → token ids per prompt: text tokenized (with the
    tokenizer's special tokens when `special`), each cut by `cut` before the checks (vocabulary,
    max_item_tokens, the model's context)."""
    value = as_sequences(what, value)
    state.limits.count(what, len(value), state.max_items, "max_items")
    if isinstance(value[0], str):
        if not all(isinstance(v, str) for v in value):
            raise BadRequest(f"{what}: mix of text and token ids; use one kind")
        # a text `cut` shortens (a peer's truncation) may be longer than the context: its
        # characters are bounded by max_item_tokens, not by the context
        check_chars(state, what, value, state.config.max_item_tokens, "max_item_tokens")
        seqs = await encode(state, value, special)
    else:
        seqs = [list(v) for v in value]
        for i, ids in enumerate(seqs):
            state.limits.token_ids(f"{what}[{i}]", ids)
    if cut is not None:
        seqs = [cut.apply(ids) for ids in seqs]
    for i, ids in enumerate(seqs):  # the context first: it is the limit a peer's client knows
        state.limits.context(f"{what}[{i}]", len(ids))
        state.limits.tokens(
            f"{what}[{i}]", len(ids), state.config.max_item_tokens, "max_item_tokens"
        )
    return seqs


async def joined_text(
    state: HandlerState, query: str, items: list[str], item_first: bool
) -> SequenceGroup:
    """SGLang's text scoring: each joined string tokenized (`workloads.score`), the sequences'
    common prefix shared; checked like a query and its items."""
    tok, cfg = state.tokenizer, state.config
    state.limits.count("items", len(items), state.max_items, "max_items")
    check_chars(
        state, "query", [query], *token_limit(state, cfg.max_query_tokens, "max_query_tokens")
    )
    check_chars(state, "items", items, *token_limit(state, cfg.max_item_tokens, "max_item_tokens"))

    def run() -> tuple[list[list[int]], int]:
        return joined_sequences(tok, query, items, item_first), len(tok.encode_batch([query])[0])

    seqs, query_tokens = await tokenizing(run, len(query) * len(items) + sum(map(len, items)))
    check_joined(state, seqs, query_tokens, "items")
    return shared_prefix_group(seqs)


def check_joined(state: HandlerState, seqs: list[list[int]], query_tokens: int, what: str) -> None:
    """Joined query + item sequences against the limits: the query's tokens (`query_tokens`, as
    tokenized alone) and what each item adds to them, and the model's context."""
    cfg = state.config
    if query_tokens:
        state.limits.tokens("query", query_tokens, cfg.max_query_tokens, "max_query_tokens")
    for i, ids in enumerate(seqs):
        if not ids:
            raise BadRequest(f"query and {what}[{i}] are both empty: nothing to score")
        state.limits.context(f"query + {what}[{i}]", len(ids))
        if len(ids) > query_tokens:
            n = len(ids) - query_tokens
            state.limits.tokens(f"{what}[{i}]", n, cfg.max_item_tokens, "max_item_tokens")


def rerank_labels(state: HandlerState) -> list[int]:
    """The server's rerank label token ids (400 when they are not single tokens)."""
    if state.rerank_label_ids is None:
        raise BadRequest(
            "rerank is not available: the server's rerank_label_tokens "
            f"{list(state.config.rerank_label_tokens)} are not single tokens of this "
            "model's vocabulary"
        )
    return state.rerank_label_ids


@dataclass(frozen=True)
class Relevance:
    """Per pair: P(first label) under the softmax over the label tokens (one label: the sigmoid of
    its logit), its logit, and the tokens the pairs took."""

    probability: list[float]
    logit: list[float]
    prompt_tokens: int


@dataclass(frozen=True)
class DocumentCut:
    """How a pair's second text (a document) is cut; the query and template text stay whole:
    `doc_tokens` keeps that many of the document's tokens, `total` (then) cuts more of them until
    the whole pair fits."""

    doc_tokens: int | None = None
    total: Truncation | None = None


async def relevance(
    state: HandlerState,
    query: str,
    documents: list[str],
    labels: list[int],
    timeout_ms: int,
    templates: bool = True,
    cut: DocumentCut = DocumentCut(),
) -> Relevance:
    """The relevance of (query, document) pairs: sequence = query template + document template
    (`templates`; else the two texts), tokenized joined as `/v1/score` does, the label tokens read
    at its last token."""
    cfg, tok = state.config, state.tokenizer
    q_text = cfg.rerank_query_template.format(query=query) if templates else query
    before, after = "", ""
    if templates:
        before, _, after = cfg.rerank_document_template.format(document="\0").partition("\0")
    texts = [q_text + before + d + after for d in documents]
    spans = [(len(q_text) + len(before), len(q_text) + len(before) + len(d)) for d in documents]

    def run() -> tuple[list[list[int]], int]:
        seqs = [
            _cut_document(e.ids, e.offsets, span, cut, i)
            for i, (e, span) in enumerate(zip(tok.encode_with_offsets(texts), spans))
        ]
        return seqs, len(tok.encode_batch([q_text])[0])

    state.limits.count("documents", len(documents), state.max_items, "max_items")
    check_chars(
        state, "query", [query], *token_limit(state, cfg.max_query_tokens, "max_query_tokens")
    )
    # a document the request cuts (`max_tokens_per_doc`, truncation) may be longer than the
    # context: its characters are bounded by max_item_tokens, not by the context
    check_chars(state, "documents", documents, cfg.max_item_tokens, "max_item_tokens")
    seqs, query_tokens = await tokenizing(run, sum(map(len, texts)))
    check_joined(state, seqs, query_tokens, "documents")
    group = shared_prefix_group(seqs)
    logits = await score(
        state, group.prefix, group.suffixes, labels, False, False, timeout_ms, raw_logits=True
    )
    logit = [_first_label_logit(row) for row in logits]
    probability = [1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0 for x in logit]
    return Relevance(probability, logit, sum(map(len, seqs)))


def _first_label_logit(row: list[float]) -> float:
    """logit of P(first label) under the softmax over the labels: l0 - logsumexp(others)."""
    if len(row) == 1:
        return row[0]
    others = np.asarray(row[1:], dtype=np.float64)
    return float(row[0] - np.logaddexp.reduce(others))


def _cut_document(
    ids: list[int], offsets: list, span: tuple[int, int], cut: DocumentCut, index: int
) -> list[int]:
    """`ids` with some of the document's own tokens (those overlapping its character `span`)
    removed, as `cut` says."""
    a, b = span
    doc = [i for i, (s, e) in enumerate(offsets) if s < b and e > a]
    drop: list[int] = []
    if cut.doc_tokens is not None and len(doc) > cut.doc_tokens:
        drop, doc = doc[cut.doc_tokens :], doc[: cut.doc_tokens]
    total = cut.total
    excess = len(ids) - len(drop) - total.tokens if total is not None else 0
    if excess > 0:
        if excess > len(doc):
            raise BadRequest(
                f"documents[{index}]: the query and template text alone take "
                f"{len(ids) - len(drop) - len(doc)} tokens, more than the {total.tokens} a pair "
                "may keep (only document tokens are cut). Please reduce the length of the input."
            )
        more = doc[:excess] if total.side == "left" else doc[len(doc) - excess :]
        drop += more
    if not drop:
        return ids
    gone = set(drop)
    return [t for i, t in enumerate(ids) if i not in gone]


def normalize_flag(
    state: HandlerState, use_activation: bool | None, normalize: bool | None
) -> bool:
    """vLLM's `use_activation` and boundgen's `normalize` mean the same for embeddings; the server
    option `embed_normalize` when neither is given."""
    if use_activation is not None and normalize is not None and use_activation != normalize:
        raise BadRequest(
            f"use_activation={use_activation} and normalize={normalize} disagree; they are the "
            "same switch (vLLM's and boundgen's names): send one"
        )
    chosen = normalize if use_activation is None else use_activation
    return state.config.embed_normalize if chosen is None else chosen


def check_dimensions(state: HandlerState, what: str, value: int | None) -> None:
    if value is not None and value != state.hidden_size:
        raise BadRequest(
            f"{what}={value} is not supported: model {state.model_name!r} returns "
            f"{state.hidden_size}-dimensional embeddings (omit `{what}`)"
        )
