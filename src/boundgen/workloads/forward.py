"""The shared model node: packs the sequence groups of many requests into padding-free forwards
(`ModelRunner.rows`) and gives each request its rows back, in order."""

from __future__ import annotations

from typing import Any

import torch

from boundgen.runner import ModelRunner


class Forward:
    """A batching node's function: inputs `groups` (list of SequenceGroup) and `pooling` ("last" |
    "mean" | "tokens") of each request → output `rows` [N, H] (N: one row per output sequence, or
    one per token with "tokens"), split back per request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[tuple[list, list[str]], list[int]]:
        groups: list = []
        pooling: list[str] = []
        sizes: list[int] = []
        for it in items:
            n = sum(len(g.suffixes) for g in it["groups"])
            groups += it["groups"]
            pooling += [it["pooling"]] * n
            if it["pooling"] == "tokens":  # every token of every sequence (prefix + suffix)
                n = sum(
                    len(g.prefix) * len(g.suffixes) + g.num_tokens - len(g.prefix)
                    for g in it["groups"]
                )
            sizes.append(n)
        return (groups, pooling), sizes

    @staticmethod
    def split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(rows, sizes))

    @staticmethod
    def size(inputs: dict[str, Any]) -> int:
        return sum(g.num_tokens for g in inputs["groups"])

    def __call__(self, batch: tuple[list, list[str]]) -> torch.Tensor:
        groups, pooling = batch
        return self.runner.rows(groups, pooling)
