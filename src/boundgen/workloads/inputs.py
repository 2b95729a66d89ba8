"""Validation and tokenization of request inputs shared by every workload (clear `ValueError`s).
No torch: the server's HTTP frontends (`serve --frontends`) validate with these too."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from itertools import chain

import numpy as np

from boundgen.text.sequences import SequenceGroup, int64_array
from boundgen.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int
    max_items: int


def is_token_ids(x) -> bool:
    # `set(map(type, x))` runs in C: W2's 1,856 ids are checked ~4x faster than by a generator of
    # isinstance calls. `type(True)` is bool, so booleans are refused as before.
    return isinstance(x, (list, tuple)) and set(map(type, x)) <= _INT


_INT = {int}


def to_ids(
    x, tokenizer: Tokenizer, limits: Limits, what: str, add_special_tokens: bool = False
) -> list[int]:
    """Text → token ids (tokenized here), or token ids checked against the vocabulary."""
    if isinstance(x, str):
        return tokenizer.encode(x, add_special_tokens=add_special_tokens)
    if not is_token_ids(x):
        raise ValueError(f"{what} must be a string or a list of token ids, got {type(x).__name__}")
    if x and (min(x) < 0 or max(x) >= limits.vocab_size):
        bad = next(t for t in x if t < 0 or t >= limits.vocab_size)
        raise ValueError(
            f"{what} has token id {bad} outside the vocabulary [0, {limits.vocab_size})"
        )
    return list(x)


def check_token_ids(seqs, vocab_size: int) -> tuple[bool, np.ndarray | None]:
    """(ok, ids): whether every entry of `seqs` is a list (or tuple) of ints in [0, vocab_size),
    one pass in C over all of them (False sends the caller to its per-entry checks, which name the
    entry at fault); and, past `_FEW_IDS` ids, all of them flattened into one int64 array, which
    packing reads as it is (`SequenceGroup.ids`: the ids converted from Python ints once, here).
    Few ids get no array: packing converts them as cheaply, and on W3's `Engine.score` (64 ids)
    an array made here measured 3-5 µs more (2-core dev CPU, interleaved)."""
    if not set(map(type, seqs)) <= _SEQ:
        return False, None
    flat = list(chain.from_iterable(seqs))
    # every id exactly an int (first: struct takes a bool as an int): types counted in a list, not
    # gathered in a set (W2's 1,856 ids 28.1 → 19.3 µs, 2-core dev CPU)
    if list(map(type, flat)).count(int) != len(flat):
        return False, None
    if len(flat) <= _FEW_IDS:  # Python's min and max: no array to make, no numpy call to enter
        return not flat or (min(flat) >= 0 and max(flat) < vocab_size), None
    try:  # the range in numpy: Python's min and max compare the ints one by one
        ids = int64_array(flat, len(flat))
    except struct.error:  # beyond int64: out of any vocabulary
        return False, None
    if int(ids.min()) >= 0 and int(ids.max()) < vocab_size:
        return True, ids
    return False, None


_SEQ = {list, tuple}
# Up to here Python's min and max beat numpy's conversion and two reductions: 64 ids (W3) 1.8 µs,
# not 3.3; 256 at par; 1,856 (W2) 43 µs, not 31 (the 2-core dev CPU, 2026-12-06).
_FEW_IDS = 256


def many_ids(xs, tokenizer: Tokenizer, limits: Limits, what: str) -> list[list[int]]:
    """`to_ids` of each entry of `xs` (named `what[i]` in errors), all token-id lists checked at
    once (W5's 100 items of 16 ids: BENCHMARKS.md, the CPU sections of the eighth and twenty-first
    sessions)."""
    if check_token_ids(xs, limits.vocab_size)[0]:
        return list(map(list, xs))  # the copies in a C loop: W2's 100 items 7.8 → 6.8 µs
    return [to_ids(x, tokenizer, limits, f"{what}[{i}]") for i, x in enumerate(xs)]


def check_items(items, limits: Limits, what: str = "items") -> None:
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(items).__name__}")
    if len(items) == 0:
        raise ValueError(f"{what} is empty: give at least one")
    if len(items) > limits.max_items:
        raise ValueError(f"{what} has {len(items)} entries; the limit is {limits.max_items}")


def fit_length(
    ids: list[int], budget: int, truncate: bool, what: str, keep: str = "first"
) -> list[int]:
    """Keep a sequence within `budget` tokens: error, or when `truncate` keep its `first` (cut the
    tail) or `last` (cut the head) `budget` tokens."""
    if len(ids) <= budget:
        return ids
    if not truncate:
        raise ValueError(
            f"{what} has {len(ids)} tokens, over the limit of {budget}; shorten it or pass "
            "truncate=True"
        )
    budget = max(budget, 0)
    return ids[len(ids) - budget :] if keep == "last" else ids[:budget]


def prepare_texts(
    texts, tokenizer: Tokenizer, limits: Limits, truncate: bool
) -> list[SequenceGroup]:
    """Each text (or token-id list) as its own sequence; text gets the tokenizer's special
    tokens."""
    check_items(texts, limits, "texts")
    seqs = []
    for i, t in enumerate(texts):
        ids = to_ids(t, tokenizer, limits, f"texts[{i}]", add_special_tokens=True)
        if not ids:
            raise ValueError(f"texts[{i}] is empty")
        seqs.append(fit_length(ids, limits.max_seq_len, truncate, f"texts[{i}]"))
    return [SequenceGroup([], seqs)]


def out_of_vocabulary(token, vocab_size: int) -> str:
    # SGLang's words ("Token ID 9 is out of vocabulary") and vLLM's ("out of vocabulary range")
    return f"label_token_ids: Token ID {token!r} is out of vocabulary range [0, {vocab_size})"


def joined_sequences(
    tokenizer: Tokenizer, query: str, items: list[str], item_first: bool
) -> list[list[int]]:
    """SGLang's text semantics: each item's sequence is the tokenized joined string."""
    texts = [item + query if item_first else query + item for item in items]
    return tokenizer.encode_batch(texts)
