"""Sequence classification: the score head of a `*ForSequenceClassification` checkpoint on each text's
last token (HF pools the last non-pad token; packing has no padding, so it is the last token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boundgen.text.packing import SequenceGroup
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.inputs import Limits, check_items, fit_length, to_ids


@dataclass
class ClassifyRequest:
    texts: list
    truncate: bool = False


def prepare_texts(
    texts, tokenizer: Tokenizer, limits: Limits, truncate: bool
) -> list[SequenceGroup]:
    """Each text (or token-id list) as its own sequence; text gets the tokenizer's special tokens."""
    check_items(texts, limits, "texts")
    seqs = []
    for i, t in enumerate(texts):
        ids = to_ids(t, tokenizer, limits, f"texts[{i}]", add_special_tokens=True)
        if not ids:
            raise ValueError(f"texts[{i}] is empty")
        seqs.append(fit_length(ids, limits.max_seq_len, truncate, f"texts[{i}]"))
    return [SequenceGroup([], seqs)]


def finish_classify(logits: torch.Tensor) -> list[list[float]]:
    return logits.float().cpu().tolist()
