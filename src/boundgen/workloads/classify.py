"""Sequence classification: the score head of a `*ForSequenceClassification` checkpoint on each
text's last token (HF pools the last non-pad token; packing has no padding, so it is the last
token).

Pipeline: prepare (CPU: tokenize) → forward (shared batching node) → head (DEVICE: score head) →
finish (CPU: logits, or class probabilities when asked, as lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boundgen.runtime.dag import Pipeline
from boundgen.workloads.base import Workload, WorkloadContext, cpu_node, device_node
from boundgen.workloads.inputs import prepare_texts


@dataclass
class ClassifyRequest:
    texts: list
    truncate: bool = False
    softmax: bool = False  # class probabilities instead of logits


def finish_classify(logits: torch.Tensor, request: ClassifyRequest) -> list[list[float]]:
    logits = logits.float()
    if request.softmax:
        logits = torch.softmax(logits, dim=-1)
    return logits.cpu().tolist()


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
                lambda rows: context.runner.head(rows),
                {"rows": torch.Tensor},
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
