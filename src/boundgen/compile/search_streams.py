"""Whole-search graphs for searches that run at the same time on several CUDA streams.

A small search does not fill the GPU: W4 with one prompt is ~1,800 kernels of 1–7 µs, most of
them a few thread blocks, so most SMs idle through it. Two whole-search graph instances replayed
at once on two streams ran 1.49x the searches a second of one stream at batch 1 and 1.10x at
batch 32 (H200, BENCHMARKS.md 2026-12-04 fifteenth session, `bench_beam.py --overlap`). The beam
node launches its merged searches on as many streams (`BatchingNode(batch_streams=...)`), so a
search formed while another runs starts at once beside it instead of queueing behind it.

Over HTTP that lost (`/v1/beam` under wrk, W4 with the trie, same machine, both orders;
BENCHMARKS.md 2026-12-04 sixteenth session): a busy server merges 8–22 requests a search, where
two at once gain little in process (1.10x at 32) and each slows the other (a search's run 16.5 →
21.0 ms at ~900 req/s): 64 connections 1,425–1,467 req/s with one stream against 1,140 with two,
p99 at ~1,060 req/s 50–54 ms against 67–73. So one stream is the default;
`BOUNDGEN_BEAM_STREAMS=2` keeps the layout for traffic of single small searches.

Two searches at once cannot share one `SearchGraphs`: its graphs share one memory pool and each
bucket's buffers, and both may be used by one replay at a time only. `SearchStreams` keeps one
`SearchGraphs` per stream it is given (`replicas`, each with its own pool, buffers and capture
stream), binds each calling stream to one of them on first sight (in turn), and orders a replica
after its last use when a different stream takes it over (an event), so any stream may call it
safely. Until sealed, a search makes its bucket in every replica (a warm-up on one stream leaves
each of them ready for the server's streams); the compiled layers are shared (one compile).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from boundgen.compile.decode import SearchGraphs

# Concurrent whole searches a CUDA runner keeps graphs for; the beam node runs its searches on as
# many streams. 1 by measurement (the module docstring).
STREAMS = int(os.environ.get("BOUNDGEN_BEAM_STREAMS", "1"))


def search_graphs(model, device, backend, compile_layers: bool, streams: int = STREAMS):
    """The whole-search graphs of a runner: one `SearchGraphs`, or with `streams` > 1 on CUDA a
    `SearchStreams` of that many."""
    if streams < 1:
        raise ValueError(f"BOUNDGEN_BEAM_STREAMS={streams}: expected 1 or more")
    device = torch.device(device)
    if streams == 1 or device.type != "cuda":
        return SearchGraphs(model, device, backend, compile_layers=compile_layers)
    return SearchStreams(model, device, backend, streams, compile_layers=compile_layers)


class SearchStreams:
    """`SearchGraphs`' interface over `replicas` of it, one per concurrent stream (the module
    docstring)."""

    def __init__(self, model, device, backend, replicas: int, **kwargs: Any) -> None:
        self.device = torch.device(device)
        self.replicas = [SearchGraphs(model, device, backend, **kwargs) for _ in range(replicas)]
        for r in self.replicas[1:]:  # a search no graph takes is named once, not per replica
            r._missed = self.replicas[0]._missed
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._bound: dict[Any, int] = {}  # calling stream (or thread on CPU) → replica
        self._turn = 0
        # per replica: held while a search is queued on it; the stream that used it last and an
        # event after that use (a search on another stream waits for it first)
        self._locks = [threading.Lock() for _ in range(replicas)]
        self._last: list[Any] = [None] * replicas
        self._done: list[Any] = [None] * replicas

    # ---- SearchGraphs' interface -------------------------------------------------------------

    @property
    def streams(self) -> int:
        """How many searches may run at once (what the beam node launches on)."""
        return len(self.replicas)

    @property
    def sealed(self) -> bool:
        return self.replicas[0].sealed

    @property
    def slots(self) -> dict:
        """The buckets made (the same in every replica)."""
        return self.replicas[0].slots

    @property
    def searches(self) -> int:
        return sum(r.searches for r in self.replicas)

    @property
    def misses(self) -> int:
        return sum(r.misses for r in self.replicas)

    def seal(self) -> None:
        for r in self.replicas:
            r.seal()

    def largest_made(self, width: int, steps: int, trie: Any, banned: tuple = ()) -> int | None:
        return self.replicas[0].largest_made(width, steps, trie, banned)

    def run(self, prompts, width: int, steps: int, trie: Any = None, banned: tuple = ()):
        """The search on the replica bound to the calling stream; before sealing, a bucket it
        made is made in the other replicas too (their results are not used)."""
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        caller = (stream.device_index, stream.cuda_stream) if self._cuda else threading.get_ident()
        mine = self._bind(caller)
        out = self._on(mine, caller, stream, prompts, width, steps, trie, banned)
        if out is not None and not self.sealed:
            made = self.replicas[mine].slots.keys()
            for i, other in enumerate(self.replicas):
                if other.slots.keys() != made:
                    self._on(i, caller, stream, prompts, width, steps, trie, banned)
        return out

    # ---- replicas and streams ----------------------------------------------------------------

    def _bind(self, caller) -> int:
        """The calling stream's (or, on the CPU, thread's) replica: bound on first sight, in
        turn."""
        with self._lock:
            i = self._bound.get(caller)
            if i is None:
                i = self._bound[caller] = self._turn % self.streams
                self._turn += 1
            return i

    def _on(self, i: int, caller, stream, prompts, width, steps, trie, banned):
        """`prompts` searched on replica `i` from `stream` (None: the CPU), ordered after the
        replica's last use by another caller."""
        with self._locks[i]:
            if stream is not None and self._last[i] not in (None, caller):
                stream.wait_event(self._done[i])
            out = self.replicas[i].run(prompts, width, steps, trie, banned)
            if stream is not None:
                self._done[i] = stream.record_event()
            self._last[i] = caller
            return out
