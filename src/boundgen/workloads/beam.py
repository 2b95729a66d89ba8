"""Beam search as a workload: the request, its validation, and the pipeline.

Pipeline: prepare (CPU: validate, tokenize) → beam (batching, DEVICE: requests with the same width,
steps and trie share one search, `ModelRunner.beam_search`; one lane per such key, so searches of
different keys run side by side; each search's results come to the host once and become every
merged request's rows there, on the lane's finisher thread while the next merged search already
runs: the top results per prompt as lists, with the trie's item ids when asked). The search
itself (HF `generate` semantics) is `boundgen.search`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from boundgen import cuda_waits
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
    # each result row as (tokens, score, item id) — the trie's id of the beam's tokens, None
    # when they are no item — instead of (tokens, score)
    item_ids: bool = False


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


class ItemIndex:
    """A trie's items as a sorted array of their token rows: the item id of many beams in one
    vectorized lookup on the host (`lookup`), none where a row is not an item. What the server
    answers a beam's `item_id` with; a lookup per beam through the trie's own tensors was a few
    hundred small tensor ops each (with the trie on the GPU: kernel launches and a sync each)."""

    def __init__(self, trie: Trie) -> None:
        # row i is item i (the trie's item order); big-endian, so the rows' bytes sort as ints
        seqs = np.ascontiguousarray(trie.sequences(), dtype=">i8")
        self.depth = trie.depth
        keys = seqs.view(f"V{8 * self.depth}").ravel()
        order = np.argsort(keys, kind="stable")
        self._keys, self._order = keys[order], order  # 8 · (depth + 1) bytes per item
        # NOTE: item i's id by its index, only for the rows found (`trie.item_ids` of every item
        # walks the trie's tensors: 4.7 s for 100K items on the CPU)
        self._item_id = trie._item_id

    def lookup(self, rows: np.ndarray) -> list:
        """Item id (None: not an item) of each row of `rows` `[K, depth]`."""
        if len(rows) == 0 or len(self._keys) == 0:
            return [None] * len(rows)
        q = np.ascontiguousarray(rows, dtype=">i8").view(f"V{8 * self.depth}").ravel()
        pos = np.searchsorted(self._keys, q).clip(max=len(self._keys) - 1)
        hit = (self._keys[pos] == q).tolist()
        item_id = self._item_id
        return [item_id(i) if h else None for i, h in zip(self._order[pos].tolist(), hit)]


_INDEXES: dict[int, tuple[Trie, ItemIndex]] = {}
_INDEXES_LOCK = threading.Lock()
_MAX_INDEXES = 64


def item_index(trie: Trie) -> ItemIndex:
    """The `ItemIndex` of `trie`, made once per trie (a server makes its tries' at start-up)."""
    known = _INDEXES.get(id(trie))
    if known is not None and known[0] is trie:
        return known[1]
    index = ItemIndex(trie)
    with _INDEXES_LOCK:
        if len(_INDEXES) >= _MAX_INDEXES:  # tries made per call: do not keep them all alive
            _INDEXES.clear()
        _INDEXES[id(trie)] = (trie, index)
    return index


def to_host(tokens: torch.Tensor, scores: torch.Tensor) -> tuple:
    """A merged search's results on their way to the host: both copies queued, nothing waited
    for (`on_host` waits). On a GPU: non-blocking copies into pinned memory and an event after
    them — one device→host sync per search, whatever the number of requests and beams in it, on
    that event (not the stream: a search of another lane may be queued on it after this one)."""
    scores = scores.float()
    if tokens.device.type != "cuda":
        return tokens, scores, None
    tokens, scores = tokens.to("cpu", non_blocking=True), scores.to("cpu", non_blocking=True)
    copied = cuda_waits.event()
    copied.record()
    return tokens, scores, copied


def on_host(copies: tuple) -> tuple[np.ndarray, np.ndarray]:
    """What `to_host` queued, once it has landed: (tokens, scores) as numpy arrays."""
    tokens, scores, copied = copies
    if copied is not None:  # mostly run already: the lane's finisher waited for the flight
        cuda_waits.synchronize(copied)
    return tokens.numpy(), scores.numpy()


class _Beam:
    """The beam node: requests with the same (width, steps, trie) share one prefill + decode
    loop (the node keeps one lane per such key, so a search of one never waits behind a search
    of another). A call queues its searches and their copies to the host (`to_host`); `finish`,
    on the lane's finisher thread once they have run, makes every request's result rows: Python
    lists, the trie's item ids looked up for the whole search at once. Meanwhile the lane's
    leader forms and queues the next merged search, so the device does not idle while the host
    makes rows (`BatchingNode(finish=...)`)."""

    to_host = staticmethod(to_host)  # a test counts the transfers through it
    # a search's fixed cost dominates (H200: 1 prompt 6.1 ms, 16 prompts 9.7 ms): merge what
    # arrives until shortly before the running search ends (`BatchingNode(late_merge=True)`)
    late_merge = True

    def __init__(self, context: WorkloadContext) -> None:
        self.context = context
        # searches launched on as many streams as the runner has whole-search graph replicas:
        # a search formed while another runs starts beside it (`compile.search_streams`)
        self.batch_streams = getattr(context.runner, "search_streams", 1)

    @staticmethod
    def lane(inputs: dict[str, Any]) -> tuple:
        req = inputs["request"]
        return (req.beam_width, req.steps, id(req.trie) if req.trie is not None else None)

    @staticmethod
    def count(inputs: dict[str, Any]) -> int:
        return len(inputs["prompts"])

    def lane_max(self, key: tuple, inputs: dict[str, Any]) -> int | None:
        """The most prompts one search of lane `key` takes: the largest whole-search graph made
        for its width, steps and trie once the runner is sealed (more would be cut into several
        searches run one after the other, and every request in them answered after the last),
        else no limit (the token budget)."""
        req = inputs["request"]
        largest = getattr(self.context.runner, "largest_search", None)  # HF baseline: none
        if largest is None:
            return None
        return largest(req.beam_width, req.steps, req.trie, tuple(self.context.eos_token_ids))

    @staticmethod
    def merge(items: list[dict[str, Any]]) -> tuple[dict, list[tuple]]:
        by_key: dict[tuple, list[list[int]]] = {}
        owners: dict[tuple, list[int]] = {}  # key → the requests (merge order) in its search
        tries: dict[int, Trie] = {}
        ids: dict[tuple, bool] = {}  # key → whether a request in it wants item ids
        sizes = []
        for n, it in enumerate(items):
            req = it["request"]
            trie_id = id(req.trie) if req.trie is not None else None
            if req.trie is not None:
                tries[trie_id] = req.trie
            key = (req.beam_width, req.steps, trie_id)
            prompts = by_key.setdefault(key, [])
            owners.setdefault(key, []).append(n)
            ids[key] = ids.get(key, False) or (bool(req.item_ids) and req.trie is not None)
            top_k = req.top_k or req.beam_width
            sizes.append((key, len(prompts), len(it["prompts"]), top_k, bool(req.item_ids)))
            prompts.extend(it["prompts"])
        return {"groups": by_key, "tries": tries, "owners": owners, "ids": ids}, sizes

    def __call__(self, batch: dict, alive: list[Callable[[], bool]] | None = None) -> dict:
        """Queue one search per (width, steps, trie) group and its copies to the host; a group
        whose requests all stopped waiting (cancelled, past their deadline) is skipped. → what
        `finish` takes: the batch and per group its copies (None: skipped)."""
        copies = {}
        for key, prompts in batch["groups"].items():
            width, steps, trie_id = key
            if alive is not None and not any(alive[i]() for i in batch["owners"][key]):
                copies[key] = None
                continue
            trie = batch["tries"].get(trie_id) if trie_id is not None else None
            if self.context.traffic is not None:  # the prompt prefill is a plain forward
                self.context.traffic.forward([SequenceGroup([], prompts)], False, "beam")
            tokens, scores = self.context.runner.beam_search(
                prompts, width, steps, trie, self.context.eos_token_ids
            )
            copies[key] = self.to_host(tokens, scores)
        return {"batch": batch, "copies": copies}

    @staticmethod
    def finish(launched: dict) -> dict:
        """The searches' results on the host, per group: (tokens [B][W][S] lists, scores [B][W]
        lists, item ids [B·W] or None); a skipped group's are None (its results are empty)."""
        batch, out = launched["batch"], {}
        for key, copies in launched["copies"].items():
            if copies is None:
                out[key] = None
                continue
            tokens, scores = on_host(copies)
            ids = None
            if batch["ids"][key]:
                trie = batch["tries"][key[2]]
                ids = item_index(trie).lookup(tokens.reshape(-1, tokens.shape[-1]))
            out[key] = (tokens.tolist(), scores.tolist(), ids)
        return out

    @staticmethod
    def split(out: dict, sizes: list[tuple]) -> list[list]:
        """Each request's results: per prompt, its best `top_k` beams with a finite score as
        (tokens, score) — (tokens, score, item id) when it asked for item ids."""
        parts = []
        for key, start, n, top_k, want_ids in sizes:
            found = out[key]
            if found is None:  # nobody waited for this search
                parts.append([[] for _ in range(n)])
                continue
            tokens, scores, ids = found
            width = key[0]
            rows_of = []
            for b in range(start, start + n):
                row_tokens, row_scores = tokens[b], scores[b]
                rows = []
                for j in range(min(top_k, width)):
                    score = row_scores[j]
                    if not math.isfinite(score):
                        continue
                    if want_ids:
                        item = ids[b * width + j] if ids is not None else None
                        rows.append((row_tokens[j], score, item))
                    else:
                        rows.append((row_tokens[j], score))
                rows_of.append(rows)
            parts.append(rows_of)
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

    fn = _Beam(context)
    beam = context.batching(
        "beam",
        fn,
        inputs={"request": BeamRequest, "prompts": list},
        outputs={"results": list},
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
        ],
        ["results"],
    )


WORKLOAD = Workload("beam", BeamRequest, build)
