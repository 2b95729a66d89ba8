"""One replay per small request: a bucket's per-call inputs staged through ONE host buffer (pinned
on CUDA) and ONE device buffer whose views are the bucket graph's static inputs (issue 25).

    StagedInputs(bucket, device)   the two buffers and their views, laid out once per bucket
    StagedBucket(fn, bucket, ...)  the bucket's forward + the gather of its output rows over those
                                   views, captured as one CUDA graph (a plain call off CUDA)

Per call (`StagedBucket.rows`): the batch's host layout (`pack_arrays`) is written padded into the
host buffer through numpy views (`buckets.write_padded`: no tensor, no padded copy first), copied
with one non-blocking H2D into the device buffer, the graph is replayed (the forward, then
`hidden[rows]` into its static output), and the k wanted rows are copied out once. No pooled buffer,
no per-call event object, no per-input device-to-device copy.

By default (`COPY_IN_GRAPH`, `BOUNDGEN_STAGED_COPY=graph`; `call` for the copy before the replay;
W4 −0.06 to −0.08 ms on an H100, fortieth session; the GPU suite passed with it on, forty-first)
the captured graph copies its inputs in itself — an H2D memcpy node from the pinned host buffer,
its first node — so a call fills the host buffer and replays, and the copy call's host time (37 µs
of W3's 1.08 ms call on an H100's host, BENCHMARKS.md thirty-ninth session) leaves the path before
the replay. A call with a device batch of its own (`__call__`) then stages it into the host
buffer by device-to-host copies queued before the replay (no wait).

Buffer layout (byte offsets, each field on a 16-byte boundary: AOTInductor kernels assume aligned
inputs and copy a misaligned one on every call):

    [ input_ids i64 [T] | positions i64 [T] | rows i64 [R] | cu_seqlens i32 [S+1]
      | cu_prefix i32 [G+1] | cu_group_q i32 [G+1]            (the last two in cascade buckets)
      | lengths i64 [R] ]                                     (with `lengths`: a beam search's)

Every field but `rows` is written whole on each call (a padded batch has the bucket's exact
shapes), so nothing of an earlier, larger request survives; `rows` beyond the request's k rows is
zeroed (row 0: a valid row whose gathered copy is never returned).

Reuse rules: the host buffer is rewritten only once the previous call's copy out of it has run
(its event, recorded right after the copy — inside the graph where the graph copies — queried;
waited on only if the device is that far behind, counted in `waits`); a call
on another stream than the previous one first waits (on the device) for the previous call's
replay, so the device buffer is never rewritten under a replay that still reads it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

import torch

from boundgen import cuda_waits
from boundgen.compile.buckets import Bucket, write_padded
from boundgen.compile.graphs import StaticGraph
from boundgen.settings import env_choice
from boundgen.text.packing import HostLayout, PackedBatch

_ALIGN = 16
# Whether a captured bucket copies its inputs in inside its graph ("graph") or each call copies
# them before the replay ("call"): read when a bucket is captured
COPY_IN_GRAPH = (
    env_choice(
        "BOUNDGEN_STAGED_COPY", os.environ.get("BOUNDGEN_STAGED_COPY", "graph"), ("call", "graph")
    )
    == "graph"
)


def _fields(bucket: Bucket, rows: int, lengths: bool) -> list[tuple[str, torch.dtype, int]]:
    out = [
        ("input_ids", torch.int64, bucket.tokens),
        ("positions", torch.int64, bucket.tokens),
        ("rows", torch.int64, rows),
        ("cu_seqlens", torch.int32, bucket.segments + 1),
    ]
    if bucket.cascade:
        out += [("cu_prefix", torch.int32, bucket.groups + 1)]
        out += [("cu_group_q", torch.int32, bucket.groups + 1)]
    if lengths:
        out += [("lengths", torch.int64, rows)]
    return out


class StagedInputs:
    """A bucket's per-call inputs: one host buffer (pinned when CUDA is present), one buffer on
    `device` (a second plain buffer on CPU, so the same copy runs there), typed views of both, and
    the static device `PackedBatch` the bucket's graph reads. `capacity`: most output rows a call
    may ask for (default: the bucket's segments). `lengths`: also each output row's sequence
    length (a whole-search bucket's prompts, `compile.decode.SearchGraphs`), 1 past the rows
    written. `by_graph`: the graph that reads the device buffer copies the host buffer in as its
    first node (`copy_in`), so a call copies nothing before its replay (`before_replay`) and a
    device batch goes to the host buffer (`assign`)."""

    def __init__(
        self,
        bucket: Bucket,
        device: torch.device | str,
        rows: int | None = None,
        lengths: bool = False,
        by_graph: bool = False,
    ) -> None:
        self.bucket = bucket
        self.by_graph = by_graph
        self.device = torch.device(device)
        self.capacity = rows or bucket.segments
        self.layout: dict[str, tuple[torch.dtype, int, int]] = {}  # name → (dtype, byte, numel)
        off = 0
        for name, dtype, n in _fields(bucket, self.capacity, lengths):
            self.layout[name] = (dtype, off, n)
            off += -(-(n * dtype.itemsize) // _ALIGN) * _ALIGN
        self.nbytes = off
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(off, dtype=torch.uint8, pin_memory=cuda)
        self.staged = torch.zeros(off, dtype=torch.uint8, device=self.device)
        self.allocations = 2  # the two buffers above; nothing else is ever allocated here
        self.host_views = self._views(self.host)
        self.views = self._views(self.staged)
        self._np = {k: v.numpy() for k, v in self.host_views.items()}
        example = bucket.example("cpu").attn
        v = self.views
        self.batch = PackedBatch(
            v["input_ids"],
            v["positions"],
            dataclasses.replace(
                example,
                cu_seqlens=v["cu_seqlens"],
                cu_prefix=v.get("cu_prefix"),
                cu_group_q=v.get("cu_group_q"),
            ),
            v["rows"],
            v["rows"][:0],
            v["rows"][:0],
            [],
        )
        self.rows = v["rows"]
        self.fills = 0
        self.copies = 0  # host → device copies
        self.waits = 0  # fills that had to wait for the previous copy out of the host buffer
        # the last copy out of `host` ran. Where the graph copies it in, the graph records it right
        # after that copy (an external event: a record node, not a fork in the capture), so the
        # next call may fill the host buffer while the rest of this call's graph still runs; when
        # the host recorded it after the replay, each fill waited for the whole previous replay:
        # W1's pieces of one bucket ran back to back with the GPU idle for the fill and the launch
        # between them (0.6 ms a t8192 piece on an H100, forty-eighth session)
        self._copied = cuda_waits.event(external=by_graph) if cuda else None
        self._done = cuda_waits.event() if cuda else None  # the last replay over `staged` ran
        self._stream = None  # the stream of the last call

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: buf[off : off + n * dtype.itemsize].view(dtype)
            for name, (dtype, off, n) in self.layout.items()
        }

    def fill(self, lay: HostLayout | None) -> int:
        """Write a batch's host layout (`pack_arrays`), padded into this bucket, into the host
        buffer (`buckets.write_padded`: no tensor on the way); None: all padding. Returns its
        number of output rows k (gathered by the graph)."""
        b = self.bucket
        k = 0 if lay is None else len(lay.last)
        if lay is not None:
            p, q = lay.num_prefix_tokens, lay.num_shared_tokens
            P, Q = b.prefix_tokens, b.shared_tokens  # (0, 0) in a plain bucket
            tail = len(lay.input_ids) - p - q
            if k > self.capacity or p > P or q > Q or tail > b.tokens - P - Q:
                raise ValueError(
                    f"staging {b.name}: a batch of {len(lay.input_ids)} tokens and {k} rows does "
                    f"not fit (capacity {self.capacity} rows)"
                )
        self._wait_copied()
        write_padded(b, lay, self._np)
        self._np["rows"][k:] = 0
        lengths = self._np.get("lengths")
        if lengths is not None:
            if k:
                lengths[:k] = lay.length
            lengths[k:] = 1
        self.fills += 1
        return k

    def _wait_copied(self) -> None:
        """Before the host buffer is rewritten: the last copy out of it has run (queried; waited
        on only when the device is that far behind, counted)."""
        if self._copied is not None and not self._copied.query():
            self.waits += 1
            self._copied.synchronize()

    def copy(self) -> None:
        """The one host → device copy of this call (non-blocking: the host buffer is pinned)."""
        self.order()
        self.copy_in()
        self.copied()

    def copy_in(self) -> None:
        """The copy and the mark after it where a later fill may rewrite the host buffer (what a
        graph that copies its inputs in captures: a record node; no count)."""
        self.staged.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def graph_prologue(self) -> None:
        """The first work of the body a graph captures over these inputs: the host buffer in
        where the graph copies it (`by_graph`); nothing where each call copies it before."""
        if self.by_graph:
            self.copy_in()

    def copied(self) -> None:
        """After the work that copies the host buffer out (`copy`, or a replay whose graph
        copies it in): count it (`copy_in` marked it)."""
        self.copies += 1

    def before_replay(self) -> None:
        """After a `fill`, before the replay that reads the device buffer: the copy in — this
        call's (`copy`), or only the stream order where the graph copies it in (`by_graph`)."""
        if self.by_graph:
            self.order()
        else:
            self.copy()

    def after_replay(self) -> None:
        """After that replay: where the graph copied the host buffer in, that copy counted."""
        if self.by_graph:
            self.copied()

    def assign(self, batch: PackedBatch) -> None:
        """A device batch of this layout into the inputs (`StagedBucket.__call__`: a caller that
        staged its batch itself): into the device buffer's views, or with `by_graph` into the host
        buffer's, by device-to-host copies queued before the replay that copies it back in (no
        wait)."""
        self.order()
        if self.by_graph:
            self._wait_copied()
            self._batch_into(self.host_views, batch)
        else:
            self._batch_into(self.views, batch)

    def _batch_into(self, views: dict[str, torch.Tensor], batch: PackedBatch) -> None:
        """A batch's inputs into `views` (the device buffer's or the host buffer's), queued."""
        a = batch.attn
        views["input_ids"].copy_(batch.input_ids, non_blocking=True)
        views["positions"].copy_(batch.positions, non_blocking=True)
        views["cu_seqlens"].copy_(a.cu_seqlens, non_blocking=True)
        if self.bucket.cascade:
            views["cu_prefix"].copy_(a.cu_prefix, non_blocking=True)
            views["cu_group_q"].copy_(a.cu_group_q, non_blocking=True)

    def order(self) -> None:
        """On another stream than the previous call: wait (on the device) for that call's replay
        before the device buffer is rewritten (by `copy`, or by a graph that copies its inputs
        in). Same stream: stream order suffices."""
        if self._done is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if self._stream is not None and stream != self._stream:
            stream.wait_event(self._done)
        self._stream = stream

    def done(self) -> None:
        """After the replay and the read of its output: the device buffer may be rewritten."""
        if self._done is not None:
            self._done.record()

    def stats(self) -> dict[str, int]:
        return {
            "fills": self.fills,
            "copies": self.copies,
            "waits": self.waits,
            "allocations": self.allocations,
            "bytes": self.nbytes,
        }


class StagedBucket:
    """A bucket's packed forward `fn(batch) -> hidden [T, H]` over `StagedInputs`' device views,
    with the gather of the wanted rows (`hidden[rows]` into a static [capacity, H] output); on
    CUDA captured as one CUDA graph (`capture`), elsewhere called as is (CPU tests: same buffers,
    same copies, no graph). `copy_in_graph` (default: `COPY_IN_GRAPH` where captured): the
    graph copies the host buffer in itself (without a graph, the body on each call)."""

    def __init__(
        self,
        fn: Callable[[PackedBatch], torch.Tensor],
        bucket: Bucket,
        device: torch.device | str,
        pool=None,
        capture: bool | None = None,
        rows: int | None = None,
        copy_in_graph: bool | None = None,
    ) -> None:
        self.bucket = bucket
        capture = torch.device(device).type == "cuda" if capture is None else capture
        # asked for explicitly it holds without a graph too: the body copies on each call, the
        # graph's order of work without one (what the CPU tests run)
        by_graph = copy_in_graph if copy_in_graph is not None else capture and COPY_IN_GRAPH
        self.inputs = StagedInputs(bucket, device, rows, by_graph=by_graph)
        self.inputs.fill(None)  # all padding: valid inputs for the warm-up and the capture
        self.inputs.copy()
        self._fn = fn
        self.lock = threading.Lock()
        self.replays = 0
        self.graph = None
        if capture:
            self.graph = StaticGraph(lambda: self._body(), [], pool=pool)

    def _body(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.inputs.graph_prologue()
        hidden = self._fn(self.inputs.batch)
        return hidden, hidden.index_select(0, self.inputs.rows)

    def _replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.replays += 1
        if self.graph is None:
            return self._body()
        self.graph.graph.replay()
        return self.graph.output

    def rows(self, lay: HostLayout) -> torch.Tensor:
        """Hidden rows [k, H] of a batch's host layout at its last-token rows, padded into this
        bucket: one fill, one H2D copy, one replay, one copy of the k rows out of the static
        output (a tensor of the caller's, valid after the next call)."""
        with self.lock:
            k = self.inputs.fill(lay)
            self.inputs.before_replay()
            _, out = self._replay()
            self.inputs.after_replay()
            out = out[:k].clone()
            self.inputs.done()
            return out

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """`GraphedBucket`'s call: a device batch of this layout → hidden [T, H] (the graph's static
        output on CUDA: valid until the next call; hold `lock` to share)."""
        with self.lock:
            self.inputs.assign(batch)
            hidden, _ = self._replay()
            self.inputs.after_replay()
            self.inputs.done()
            return hidden
