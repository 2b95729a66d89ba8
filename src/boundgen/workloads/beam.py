"""Beam search as a workload: the request, its validation, and the pipeline.

Pipeline: prepare (CPU: validate, tokenize) → beam (batching, DEVICE: requests with the same width,
steps and trie share one search, `ModelRunner.beam_search`) → finish (CPU: the top results per
prompt as lists). The search itself (HF `generate` semantics) is `boundgen.search`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from boundgen.runtime.dag import Pipeline
from boundgen.text.packing import SequenceGroup
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.base import BeamBounds, Workload, WorkloadContext, cpu_node
from boundgen.workloads.inputs import Limits, check_items, fit_length, to_ids
from boundgen.workloads.trie import Trie


@dataclass
class BeamRequest:
    prompts: list
    beam_width: int
    steps: int
    top_k: int | None = None
    trie: Trie | None = None
    truncate: bool = False


def _positive_int(value, name: str, bound: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > bound:
        raise ValueError(f"{name} {value} is above the configured bound of {bound}")
    return value


def prepare_beam(
    req: BeamRequest, tokenizer: Tokenizer, limits: Limits, bounds: BeamBounds
) -> list[list[int]]:
    width = _positive_int(req.beam_width, "beam_width", bounds.max_width)
    steps = _positive_int(req.steps, "steps", bounds.max_steps)
    if req.top_k is not None:
        _positive_int(req.top_k, "top_k", width)
    if req.trie is not None:
        if not isinstance(req.trie, Trie):
            raise ValueError(f"trie must be a boundgen.Trie, got {type(req.trie).__name__}")
        if req.trie.depth != steps:
            raise ValueError(
                f"trie depth {req.trie.depth} != steps {steps}: every item ID must take exactly "
                f"`steps` tokens"
            )
        req.trie.check_vocab(limits.vocab_size)
    check_items(req.prompts, limits, "prompts")
    prompts = []
    for i, p in enumerate(req.prompts):
        ids = to_ids(p, tokenizer, limits, f"prompts[{i}]")
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: beam search needs at least one prompt token")
        prompts.append(
            fit_length(ids, limits.max_seq_len - steps, req.truncate, f"prompts[{i}] + steps")
        )
    return prompts


class _Beam:
    """The beam node: requests with the same (width, steps, trie) share one prefill + decode
    loop."""

    def __init__(self, context: WorkloadContext) -> None:
        self.context = context

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[dict, list[tuple]]:
        by_key: dict[tuple, list[list[int]]] = {}
        owners: dict[tuple, list[int]] = {}  # key → the requests (merge order) in its search
        tries: dict[int, Trie] = {}
        sizes = []
        for n, it in enumerate(items):
            req = it["request"]
            trie_id = id(req.trie) if req.trie is not None else None
            if req.trie is not None:
                tries[trie_id] = req.trie
            key = (req.beam_width, req.steps, trie_id)
            prompts = by_key.setdefault(key, [])
            owners.setdefault(key, []).append(n)
            sizes.append((key, len(prompts), len(it["prompts"])))
            prompts.extend(it["prompts"])
        return {"groups": by_key, "tries": tries, "owners": owners}, sizes

    def __call__(self, batch: dict, alive: list[Callable[[], bool]] | None = None) -> dict:
        """One search per (width, steps, trie) group; a group whose requests all stopped waiting
        (cancelled, past their deadline) is skipped: its results are empty."""
        out = {}
        for key, prompts in batch["groups"].items():
            width, steps, trie_id = key
            if alive is not None and not any(alive[i]() for i in batch["owners"][key]):
                out[key] = (
                    torch.zeros(len(prompts), width, steps, dtype=torch.long),
                    torch.full((len(prompts), width), float("-inf")),
                )
                continue
            trie = batch["tries"].get(trie_id) if trie_id is not None else None
            if self.context.traffic is not None:  # the prompt prefill is a plain forward
                self.context.traffic.forward([SequenceGroup([], prompts)], False, "beam")
            out[key] = self.context.runner.beam_search(
                prompts, width, steps, trie, self.context.eos_token_ids
            )
        return out

    @staticmethod
    def split(out: dict, sizes: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        for key, start, n in sizes:
            tokens, scores = out[key]
            parts.append((tokens[start : start + n], scores[start : start + n]))
        return parts

    @staticmethod
    def shapes(items: list[dict[str, Any]]) -> list[tuple]:
        """One per search a merged batch runs: (width, steps, trie, prompts) — what a whole-search
        graph is compiled for (with the prompts' bucket, which the node does not see)."""
        prompts: dict[tuple, int] = {}
        for it in items:
            req = it["request"]
            key = (req.beam_width, req.steps, id(req.trie) if req.trie is not None else None)
            prompts[key] = prompts.get(key, 0) + len(it["prompts"])
        return [(*key, n) for key, n in prompts.items()]

    @staticmethod
    def size(inputs: dict[str, Any]) -> int:
        req = inputs["request"]
        prompts = inputs["prompts"]
        return sum(len(p) for p in prompts) + len(prompts) * req.beam_width * req.steps


def build(context: WorkloadContext) -> Pipeline:
    def prepare(request: BeamRequest) -> list:
        context.need_task("causal_lm", "beam search")
        return prepare_beam(request, context.tokenizer, context.limits, context.beam_bounds)

    def finish(tokens: torch.Tensor, beam_scores: torch.Tensor, request: BeamRequest) -> list:
        return finish_beam(tokens, beam_scores, request.top_k or request.beam_width)

    beam = context.batching(
        "beam",
        _Beam(context),
        inputs={"request": BeamRequest, "prompts": list},
        outputs={"tokens": torch.Tensor, "beam_scores": torch.Tensor},
        raises=(ValueError,),  # a runner that cannot decode says so (the HF baseline runner)
    )
    return Pipeline(
        "beam",
        {"request": BeamRequest},
        [
            cpu_node(
                "prepare", prepare, {"request": BeamRequest}, {"prompts": list}, (ValueError,)
            ),
            beam,
            cpu_node(
                "finish",
                finish,
                {"tokens": torch.Tensor, "beam_scores": torch.Tensor, "request": BeamRequest},
                {"results": list},
            ),
        ],
        ["results"],
    )


def finish_beam(
    tokens: torch.Tensor, scores: torch.Tensor, top_k: int
) -> list[list[tuple[list[int], float]]]:
    tokens, scores = tokens.cpu(), scores.float().cpu()
    out = []
    for b in range(tokens.shape[0]):
        rows = [
            (tokens[b, j].tolist(), float(scores[b, j]))
            for j in range(min(top_k, tokens.shape[1]))
            if torch.isfinite(scores[b, j])
        ]
        out.append(rows)
    return out


WORKLOAD = Workload("beam", BeamRequest, build)
