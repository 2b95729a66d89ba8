"""Label-token scoring (SGLang `/v1/score` semantics).

sequence = query + item (item + query when `item_first`); result[i][j] = logit of label_token_ids[j]
at item i's last token, or the softmax over the label ids when `apply_softmax`. Only the label
columns of the LM head are multiplied. Query-first requests share the query as a cascade prefix.

Pipeline: prepare (CPU: tokenize → SequenceGroups) → forward (shared batching node) → head (DEVICE:
label columns of the LM head) → finish (CPU: softmax, lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from boundgen.runtime.dag import Pipeline
from boundgen.text.packing import SequenceGroup
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.base import Workload, WorkloadContext, cpu_node, device_node
from boundgen.workloads.inputs import Limits, check_items, fit_length, to_ids


@dataclass
class ScoreRequest:
    query: str | list[int]
    items: list
    label_token_ids: list[int] = field(default_factory=list)
    apply_softmax: bool = False
    item_first: bool = False
    truncate: bool = False


def check_labels(label_token_ids, limits: Limits) -> list[int]:
    if not isinstance(label_token_ids, (list, tuple)) or not label_token_ids:
        raise ValueError("label_token_ids must be a non-empty list of token ids")
    for t in label_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise ValueError(
                f"label token id {t!r} is outside the vocabulary [0, {limits.vocab_size})"
            )
    return list(label_token_ids)


def prepare_score(req: ScoreRequest, tokenizer: Tokenizer, limits: Limits) -> list[SequenceGroup]:
    check_labels(req.label_token_ids, limits)
    check_items(req.items, limits)
    query = to_ids(req.query, tokenizer, limits, "query")
    items = [to_ids(x, tokenizer, limits, f"items[{i}]") for i, x in enumerate(req.items)]
    if not query and any(not x for x in items):
        raise ValueError("query and an item are both empty: nothing to score")
    budget = limits.max_seq_len - 1 if items else limits.max_seq_len
    query = fit_length(query, budget, req.truncate, "query")
    budget = limits.max_seq_len - len(query)
    items = [
        fit_length(x, budget, req.truncate, f"query + items[{i}]") for i, x in enumerate(items)
    ]
    if req.item_first:
        return [SequenceGroup([], [x + query for x in items])]
    return [SequenceGroup(query, items)]


def finish_score(label_logits: torch.Tensor, request: ScoreRequest) -> list[list[float]]:
    """label_logits: float32 [N, C] → python lists (softmax over the label ids when asked)."""
    if request.apply_softmax:
        label_logits = torch.softmax(label_logits, dim=-1)
    return label_logits.cpu().tolist()


def build(context: WorkloadContext) -> Pipeline:
    def prepare(request: ScoreRequest) -> tuple[list, str]:
        context.need_task("causal_lm", "score")
        return prepare_score(request, context.tokenizer, context.limits), "last"

    def head(rows: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
        return context.runner.head(rows, request.label_token_ids)

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
