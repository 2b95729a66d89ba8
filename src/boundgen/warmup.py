"""Warm an engine up before it takes traffic: run requests shaped like the expected ones once.

What the first request of a shape would otherwise pay: a beam search's whole-search CUDA graph is
captured on its first use per (prompt bucket, batch, width, steps, trie), and its layers are
compiled by `torch.compile` once for all shapes (~14 s for the Qwen2.5-0.5B shape on the H200
the first time; the result is kept in the compile cache, `compile.torch_cache`, so a later start
or a copied cache loads it); cuBLAS handles, the allocator's first blocks and the eager head's
kernels load on first use too. Compiled forward buckets are warmed when they load
(`CompileOptions.warmup`), so a warm-up request per kind is enough for them. A server seals its
runner after the warm-up: nothing is compiled or captured on a request's path from then on
(`SearchGraphs.seal`; `boundgen_compiles_after_ready_total` counts any that still happen).

The shapes are the profile format of `boundgen compile --profile` (`compile.planner`), so one file
plans the buckets and warms them:

    [{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, "count": 10},
     {"kind": "embed", "texts": [64, 128]},
     {"kind": "beam", "prompt_tokens": 128, "width": 16, "steps": 4, "count": 8, "trie": "items"}]

A beam entry warms every batch size its searches can be padded to (1, 2, 4, ... up to `count`
prompts, `compile.decode.BATCH_SIZES`: concurrent requests are merged, and more than `count` are
cut into these sizes);
`prompt_tokens` is the longest prompt its graphs take (a longer one runs on the plain path, with
a WARNING); `trie` names one of the tries given (the server's `--trie NAME=FILE`), and its `steps`
default to the trie's depth. Token ids are drawn from a fixed seed, so a warm-up is the same
every start.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boundgen.compile import torch_cache
from boundgen.compile.decode import BATCH_SIZES
from boundgen.compile.events import COMPILES, TORCH_COMPILE, watch_dynamo
from boundgen.compile.planner import profile_entries

# beam searches merged per whole-search graph that a default warm-up makes (1, 2, 4, 8): more
# concurrent requests are cut into these (`SearchGraphs`), never compiled on a request's path
DEFAULT_MERGE = 8


def default_profile(engine: Any, tries: dict[str, Any] | None = None) -> list[dict]:
    """One small request per workload the model serves, and one beam search per trie (its depth as
    steps): what a server warms when it is given no profile."""
    if engine.config.task != "causal_lm":
        return [{"kind": "classify", "texts": [64]}]
    profile: list[dict] = [
        {"kind": "score", "query_tokens": 64, "items": 4, "item_tokens": 16},
        {"kind": "embed", "texts": [64]},
        {"kind": "beam", "prompt_tokens": 64, "width": 4, "steps": 2, "count": DEFAULT_MERGE},
    ]
    for name in sorted(tries or {}):
        profile.append(
            {"kind": "beam", "prompt_tokens": 64, "width": 16, "trie": name, "count": DEFAULT_MERGE}
        )
    return profile


def warm_up(
    engine: Any,
    profile: list[dict],
    tries: dict[str, Any] | None = None,
    progress: bool | Callable[[dict], None] = False,
) -> list[dict]:
    """Run every request the profile describes once through `engine`'s public calls. Returns one
    row per request run: {"what", "seconds"}. Raises ValueError for a profile that is not valid
    (the planner's checks, plus an unknown trie name) before anything runs."""
    return run(requests(engine, profile, tries), progress)


def requests(
    engine: Any, profile: list[dict], tries: dict[str, Any] | None = None
) -> list[tuple[str, Callable[[], Any]]]:
    """The warm-up requests of `profile` as (what, call) pairs, checked but not run (ValueError
    for a profile that is not valid)."""
    return _calls(engine, profile, tries or {})


class Stopped(Exception):
    """The warm-up was asked to stop (`run`'s `stop`) before all its requests had run."""


def run(
    calls: list[tuple[str, Callable[[], Any]]],
    progress: bool | Callable[[dict], None] = False,
    cache_root: str | Path | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Run warm-up requests in order; `progress`: True for a progress bar on stderr, or a
    callable given each {"what", "seconds"} row as it finishes. `cache_root`: the compile cache
    whose `torch.compile` results are loaded first and, when the warm-up compiled, saved after
    (`compile.torch_cache`: a later start, or a copy of the cache on another machine, then
    compiles nothing). `stop()`, asked before each request: True raises `Stopped` (a server
    shutting down during its warm-up)."""
    watch_dynamo()
    if cache_root is not None:
        torch_cache.load(cache_root)
    compiled = COMPILES.total(TORCH_COMPILE)
    rows = _run(calls, progress, stop)
    if cache_root is not None and COMPILES.total(TORCH_COMPILE) > compiled:
        torch_cache.save(cache_root)
    return rows


def _run(calls, progress, stop=None) -> list[dict]:
    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=len(calls), desc="warm-up", unit="request", file=sys.stderr)
    rows = []
    for what, call in calls:
        if stop is not None and stop():
            if bar is not None:
                bar.close()
            raise Stopped(f"warm-up stopped after {len(rows)} of {len(calls)} requests")
        t0 = time.perf_counter()
        call()
        row = {"what": what, "seconds": round(time.perf_counter() - t0, 3)}
        rows.append(row)
        if bar is not None:
            bar.set_postfix_str(what)
            bar.update(1)
        elif callable(progress):
            progress(row)
    if bar is not None:
        bar.close()
    return rows


def load_profile(path: str) -> list[dict]:
    """A profile file (JSON list), ValueError naming the file when it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"warm-up profile {path}: {exc}") from None


def _calls(engine: Any, profile: list[dict], tries: dict[str, Any]) -> list[tuple[str, Callable]]:
    profile_entries(profile)  # the planner's checks: a list, kinds, keys, positive sizes
    entries = [dict(item) for item in profile]
    for i, item in enumerate(entries):
        if item["kind"] == "beam" and "trie" in item:
            name = item["trie"]
            if name not in tries:
                known = ", ".join(sorted(tries)) or "none"
                raise ValueError(f"profile entry {i}: unknown trie {name!r} (tries: {known})")
            item.setdefault("steps", tries[name].depth)
    rng = random.Random(0)
    low, high = 10, max(11, min(engine.config.vocab_size, 50_000))

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    calls: list[tuple[str, Callable]] = []
    for item in entries:
        kind = item["kind"]
        if kind == "score":
            query = ids(item["query_tokens"])
            items = [ids(item["item_tokens"]) for _ in range(item["items"])]
            first = bool(item.get("item_first", False))
            what = f"score {len(query)}+{len(items)}x{len(items[0])}"
            calls.append(
                (what, lambda q=query, it=items, f=first: engine.score(q, it, [1, 2], item_first=f))
            )
        elif kind in ("embed", "classify"):
            texts = [ids(n) for n in item["texts"]]
            fn = engine.embed if kind == "embed" else engine.classify
            calls.append((f"{kind} {len(texts)} texts", lambda t=texts, fn=fn: fn(t)))
        else:
            trie = tries[item["trie"]] if "trie" in item else None
            width, steps = item.get("width", 1), item.get("steps", 1)
            count = item.get("count", 1)
            for b in BATCH_SIZES:  # the batch sizes a whole-search graph pads to
                prompts = [ids(item["prompt_tokens"]) for _ in range(b)]
                what = f"beam {b}x{item['prompt_tokens']} W{width} S{steps}" + (
                    f" trie {item['trie']}" if trie is not None else ""
                )
                calls.append(
                    (
                        what,
                        lambda p=prompts, w=width, s=steps, t=trie: engine.beam_search_batch(
                            p, w, s, trie=t
                        ),
                    )
                )
                if b >= count:
                    break
    return calls
