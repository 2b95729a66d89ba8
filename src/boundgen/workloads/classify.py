"""Sequence classification: the score head of a `*ForSequenceClassification` checkpoint on each
text's last token (HF pools the last non-pad token; packing has no padding, so it is the last
token).

Pipeline: prepare (CPU: tokenize) → forward (shared batching node) → head (DEVICE: score head) →
finish (CPU: the head's float32 logits, or class probabilities when asked, as lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boundgen.runner import ModelRunner
from boundgen.runtime.dag import Pipeline
from boundgen.workloads.base import Workload, WorkloadContext, cpu_node, device_node
from boundgen.workloads.inputs import prepare_texts


@dataclass
class ClassifyRequest:
    texts: list
    truncate: bool = False
    softmax: bool = False  # class probabilities instead of logits


def class_scores(runner: ModelRunner, rows: torch.Tensor, request: ClassifyRequest) -> torch.Tensor:
    """The head node: float32 class logits [N, C] (probabilities with `softmax`) on their way to
    the host (`runner.to_host`: the executor's event sync before `finish` is the request's only
    sync). The softmax computes in float32 from the model's dtype, in the same call."""
    logits = runner.head(rows)
    if request.softmax:
        return runner.to_host(torch.softmax(logits, dim=-1, dtype=torch.float32))
    return runner.to_host(logits.float())


def finish_classify(logits: torch.Tensor, request: ClassifyRequest) -> list[list[float]]:
    """`class_scores`' result, on the host → python lists (`tolist` alone keeps the GIL:
    `finish_score`)."""
    return logits.tolist()


def build(context: WorkloadContext) -> Pipeline:
    def prepare(request: ClassifyRequest) -> tuple[list, str]:
        context.need_task("seq_cls", "classify")
        groups = prepare_texts(request.texts, context.tokenizer, context.limits, request.truncate)
        return groups, "last"

    return Pipeline(
        "classify",
        {"request": ClassifyRequest},
        [
            cpu_node(
                "prepare",
                prepare,
                {"request": ClassifyRequest},
                {"groups": list, "pooling": str},
                raises=(ValueError,),
            ),
            context.forward,
            device_node(
                "head",
                lambda rows, request: class_scores(context.runner, rows, request),
                {"rows": torch.Tensor, "request": ClassifyRequest},
                {"logits": torch.Tensor},
            ),
            cpu_node(
                "finish",
                finish_classify,
                {"logits": torch.Tensor, "request": ClassifyRequest},
                {"class_scores": list},
            ),
        ],
        ["class_scores"],
    )


WORKLOAD = Workload("classify", ClassifyRequest, build)
