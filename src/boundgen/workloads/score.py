"""Label-token scoring (SGLang `/v1/score` semantics).

sequence = query + item (item + query when `item_first`). Text is joined first and the joined string
is tokenized, so a join inside a word tokenizes as that word; token ids are concatenated as given.
result[i][j] for label_token_ids[j] at the last token of item i's sequence:
- `apply_softmax`: the softmax over the label tokens' logits (only the label columns of the LM head
  are multiplied);
- otherwise: the label's probability under the softmax over the FULL vocabulary,
  exp(log_softmax(logits)[label]), in [0, 1].
The sequences' longest common token prefix (the query, for query-first text) is computed once for
all items (cascade); so is a token-id query.

Pipeline: prepare (CPU: tokenize → SequenceGroups) → forward (shared batching node) → head (DEVICE:
label columns, and the full vocabulary's log-sum-exp when asked, the softmax over the labels when
asked, one copy to pinned host memory) → finish (CPU: lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from boundgen.runner import ModelRunner
from boundgen.runtime.dag import Pipeline
from boundgen.text.sequences import SequenceGroup, shared_prefix_group
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.base import Workload, WorkloadContext, cpu_node, device_node
from boundgen.workloads.inputs import (
    Limits,
    check_items,
    check_token_ids,
    fit_length,
    joined_sequences,
    many_ids,
    out_of_vocabulary,
    to_ids,
)

# Full-vocabulary logits are made this many elements at a time (128 MiB of float32), so a request of
# many items never holds [N, vocab] at once.
_FULL_LOGITS_ELEMENTS = 1 << 25


@dataclass
class ScoreRequest:
    query: str | list[int]
    items: list
    label_token_ids: list[int] = field(default_factory=list)
    apply_softmax: bool = False
    item_first: bool = False
    truncate: bool = False
    # The label tokens' raw logits instead of either probability (what the server's rerank
    # relevance and its logit are computed from).
    raw_logits: bool = False


def check_labels(label_token_ids, limits: Limits) -> list[int]:
    if not isinstance(label_token_ids, (list, tuple)) or not label_token_ids:
        raise ValueError("label_token_ids must be a non-empty list of token ids")
    for t in label_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise ValueError(out_of_vocabulary(t, limits.vocab_size))
    return list(label_token_ids)


def prepare_score(req: ScoreRequest, tokenizer: Tokenizer, limits: Limits) -> list[SequenceGroup]:
    check_labels(req.label_token_ids, limits)
    check_items(req.items, limits)
    if isinstance(req.query, str) and all(isinstance(x, str) for x in req.items):
        return [_prepare_joined_text(req, tokenizer, limits)]
    # token ids: the query and the items checked at once, many of them kept as one array, which
    # packing reads as it is (`SequenceGroup.ids`); anything else (text, a bad id) checked entry by
    # entry, which names the entry at fault
    ok, ids = False, None
    if not isinstance(req.query, str):
        ok, ids = check_token_ids([req.query, *req.items], limits.vocab_size)
    if ok:
        query, items = list(req.query), list(map(list, req.items))
    else:
        query = to_ids(req.query, tokenizer, limits, "query")
        items = many_ids(req.items, tokenizer, limits, "items")
    if not query and any(not x for x in items):
        raise ValueError("query and an item are both empty: nothing to score")
    budget = limits.max_seq_len - 1 if items else limits.max_seq_len
    fitted = fit_length(query, budget, req.truncate, "query")
    budget = limits.max_seq_len - len(fitted)
    if max(map(len, items)) > budget:  # else all fit as they are (100 items: 2 µs, not 11)
        ids = None  # cut (or refused): the array no longer holds the lists' ids
        items = [
            fit_length(x, budget, req.truncate, f"query + items[{i}]") for i, x in enumerate(items)
        ]
    if req.item_first:
        return [SequenceGroup([], [x + fitted for x in items])]
    return [SequenceGroup(fitted, items, ids if fitted is query else None)]


def _prepare_joined_text(req: ScoreRequest, tokenizer: Tokenizer, limits: Limits) -> SequenceGroup:
    seqs = joined_sequences(tokenizer, req.query, req.items, req.item_first)
    for i, seq in enumerate(seqs):
        if not seq:
            raise ValueError(f"query and items[{i}] are both empty: nothing to score")
        if len(seq) > limits.max_seq_len:
            what = f"items[{i}] + query" if req.item_first else f"query + items[{i}]"
            # `truncate` cuts the item's side: its end after the query, its start before it
            keep = "last" if req.item_first else "first"
            seqs[i] = fit_length(seq, limits.max_seq_len, req.truncate, what, keep)
    return shared_prefix_group(seqs)


def label_scores(runner: ModelRunner, rows: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
    """rows [N, H] → float32 [N, C]: label logits (for softmax over them, or raw), or each label's
    probability under the full vocabulary."""
    labels = request.label_token_ids
    logits = runner.head(rows, labels)  # [N, C]
    if request.apply_softmax or request.raw_logits:
        return logits
    vocab = runner.config.vocab_size
    step = max(1, _FULL_LOGITS_ELEMENTS // vocab)
    lse = torch.cat([torch.logsumexp(runner.head(part), dim=-1) for part in rows.split(step)])
    return (logits - lse[:, None]).exp()


def request_scores(runner: ModelRunner, rows: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
    """The head node: `label_scores`, softmaxed over the label ids when asked, on the host (one
    non-blocking copy into pinned memory; the executor's event sync before `finish` is the only
    sync of the request: `runner.to_host`). The softmax over the label ids takes the logits in the
    model's dtype and computes in float32 (as a cast first would, in the same call): three torch
    calls in all, each a GIL round trip on a server (`ModelRunner.label_logits`)."""
    if request.apply_softmax and not request.raw_logits:
        logits = runner.label_logits(rows, request.label_token_ids)
        return runner.to_host(torch.softmax(logits, dim=-1, dtype=torch.float32))
    return runner.to_host(label_scores(runner, rows, request))


def finish_score(label_logits: torch.Tensor, request: ScoreRequest) -> list[list[float]]:
    """The request's final label scores float32 [N, C] (`request_scores`, on the host) → python
    lists. `tolist` alone: it keeps the GIL for a host tensor, where a `.cpu()` first (a no-op
    here) gives it up, and beside a busy thread waits up to the switch interval to take it back."""
    return label_logits.tolist()


def build(context: WorkloadContext) -> Pipeline:
    def prepare(request: ScoreRequest) -> tuple[list, str]:
        context.need_task("causal_lm", "score")
        return prepare_score(request, context.tokenizer, context.limits), "last"

    def head(rows: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
        return request_scores(context.runner, rows, request)

    return Pipeline(
        "score",
        {"request": ScoreRequest},
        [
            cpu_node(
                "prepare",
                prepare,
                {"request": ScoreRequest},
                {"groups": list, "pooling": str},
                raises=(ValueError,),
            ),
            context.forward,
            device_node(
                "head",
                head,
                {"rows": torch.Tensor, "request": ScoreRequest},
                {"label_logits": torch.Tensor},
            ),
            cpu_node(
                "finish",
                finish_score,
                {"label_logits": torch.Tensor, "request": ScoreRequest},
                {"scores": list},
            ),
        ],
        ["scores"],
    )


WORKLOAD = Workload("score", ScoreRequest, build)
