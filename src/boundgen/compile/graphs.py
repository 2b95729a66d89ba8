"""CUDA graphs for fixed shapes: capture once per bucket (or decode step), replay with static
buffers.

Launch cost dominates small forwards (DESIGN §11: HF eager spends 22.9 ms on one 64-token prompt,
mostly launches). A captured graph replays every kernel with one launch. Rules that make replay
correct:

- inputs are copied into the graph's own static buffers before each replay (`copy_`, never
  rebinding);
- every tensor the graph reads besides its inputs (weights, KV buffers) must keep its storage: no
  reallocation or buffer swapping between capture and replay (e.g. a beam KV that swaps double
  buffers needs one graph per buffer parity, or a copy-back reorder);
- the output is a static buffer too: it is overwritten by the next replay, so read it first (the
  caller holds `lock` across replay and read when several threads share a graph);
- AOTInductor packages must be loaded with `run_single_threaded=True` to be capturable (DESIGN
  §10).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from boundgen import grid_dependency
from boundgen.compile import programmatic
from boundgen.compile.aoti import flat_inputs
from boundgen.compile.buckets import Bucket
from boundgen.text.packing import PackedBatch


class StaticGraph:
    """`fn(*static_inputs)` captured once; `__call__(*inputs)` copies inputs in and replays."""

    def __init__(
        self, fn: Callable, static_inputs: list[torch.Tensor], warmup: int = 2, pool=None
    ) -> None:
        self.static_inputs = static_inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(
            side
        ):  # warm up outside the capture (lazy inits, autotuning, workspaces)
            for _ in range(warmup):
                fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        with programmatic.capture(pool=pool) as self.graph:
            self.output = fn(*static_inputs)
        self.lock = threading.Lock()

    def __call__(self, *inputs: torch.Tensor):
        for dst, src in zip(self.static_inputs, inputs):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.output


class GraphedBucket:
    """A bucket's packed forward (`fn(padded_batch) -> hidden`) behind a CUDA graph."""

    def __init__(
        self,
        fn: Callable[[PackedBatch], torch.Tensor],
        bucket: Bucket,
        device: torch.device,
        pool=None,
    ) -> None:
        self.bucket = bucket
        self.static = bucket.example(device)
        self._fn = fn
        self.graph = StaticGraph(lambda *_: fn(self.static), flat_inputs(self.static), pool=pool)
        self.lock = self.graph.lock

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """Returns the static output buffer: valid until the next call (hold `lock` to share)."""
        return self.graph(*flat_inputs(batch))


def capture_buckets(
    fns: dict[Bucket, Callable], device: torch.device, max_tokens: int, make: Callable | None = None
) -> dict:
    """Graph every bucket up to `max_tokens` tokens (largest first, one shared memory pool) with
    `make(fn, bucket, device, pool=pool)`: `GraphedBucket` by default, or
    `compile.staging.StagedBucket` (one staged input buffer, rows gathered in the graph)."""
    make = make or GraphedBucket
    pool = torch.cuda.graph_pool_handle()
    out = dict(fns)
    for bucket in sorted((b for b in fns if b.tokens <= max_tokens), key=lambda b: -b.tokens):
        # its kernels traced (compiled backends' warm-up) and its graph captured as its size
        # says (`grid_dependency`'s "small" mode)
        with grid_dependency.for_bucket(bucket.tokens):
            out[bucket] = make(fns[bucket], bucket, device, pool=pool)
    return out
