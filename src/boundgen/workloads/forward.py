"""The shared model node: packs the sequence groups of many requests into padding-free forwards
(`ModelRunner.rows`) and gives each request its rows back, in order. A piece of the forward whose
rows all belong to requests no longer wanted (cancelled, past their deadline) is skipped."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import torch

from boundgen.runner import ModelRunner
from boundgen.workloads.traffic import TrafficLog


class Forward:
    """A batching node's function: inputs `groups` (list of SequenceGroup) and `pooling` ("last" |
    "mean" | "tokens") of each request → output `rows` [N, H] (N: one row per output sequence, or
    one per token with "tokens"), split back per request."""

    def __init__(self, runner: ModelRunner, traffic: TrafficLog | None = None) -> None:
        self.runner = runner
        self.traffic = traffic

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[tuple[list, list[str], list[int]], list[int]]:
        """((groups, pooling per row, first row of each request), rows per request)."""
        groups: list = []
        pooling: list[str] = []
        sizes: list[int] = []
        starts: list[int] = []
        for it in items:
            n = sum(len(g.suffixes) for g in it["groups"])
            starts.append(len(pooling))
            groups += it["groups"]
            pooling += [it["pooling"]] * n
            if it["pooling"] == "tokens":  # every token of every sequence (prefix + suffix)
                n = sum(
                    len(g.prefix) * len(g.suffixes) + g.num_tokens - len(g.prefix)
                    for g in it["groups"]
                )
            sizes.append(n)
        return (groups, pooling, starts), sizes

    @staticmethod
    def split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Each request's rows, as views. Slices, not `torch.split`: a basic slice keeps the GIL,
        where `split` is an op call that gives it up and, beside a busy event loop, may wait up to
        the switch interval to take it back (BENCHMARKS.md, CPU twenty-third session). A batch of
        one request that owns every row gets `rows` itself: a slice is a new tensor (W3's
        `Engine.score`, the model stubbed, ~5 µs less on the 2-core dev CPU, 2026-12-06)."""
        if len(sizes) == 1 and sizes[0] == rows.shape[0]:  # not `len`: a Python call of torch's
            return [rows]
        out, first = [], 0
        for n in sizes:
            out.append(rows[first : first + n])
            first += n
        return out

    @staticmethod
    def size(inputs: dict[str, Any]) -> int:
        return sum(g.num_tokens for g in inputs["groups"])

    def __call__(
        self,
        batch: tuple[list, list[str], list[int]],
        alive: Sequence[Callable[[], bool]] | None = None,
    ) -> torch.Tensor:
        groups, pooling, starts = batch
        if self.traffic is not None:
            self.traffic.forward(groups, self.runner.shares_prefix(groups, pooling))
        wanted = None if alive is None else _rows_wanted(starts, alive)
        return self.runner.rows(groups, pooling, wanted)


def _rows_wanted(
    starts: list[int], alive: Sequence[Callable[[], bool]]
) -> Callable[[int, int], bool]:
    """`wanted(first, end)`: whether a request owning a row in [first, end) is alive (requests
    own consecutive rows, request i from `starts[i]`)."""

    def wanted(first: int, end: int) -> bool:
        i = bisect_right(starts, first) - 1
        while i < len(starts) and starts[i] < end:
            if alive[i]():
                return True
            i += 1
        return False

    return wanted
