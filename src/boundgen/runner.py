"""`ModelRunner`: the model on its device; it alone turns sequence groups into rows, for every
backend (nano-vllm's `model_runner`).

    rows(groups, pooling)      split to the token budget → pack, padded into a compiled bucket
                               when one fits → a captured bucket's last-token rows: one staged
                               buffer, one copy, one replay (`compile.staging`); else stage through
                               pooled pinned/device buffers → forward → each output sequence's row
                               (its last token, or the mean of its tokens), or all its token rows
    head(rows, columns)        the LM head (or score head) on those rows, or some columns of it
    beam_search(prompts, ...)  bounded beam search: a whole-search CUDA graph per bucket, or a plain
                               per-request session

Compiled backends (`compile.backends`) plug in as `CompiledForwards`; without them the plain
model runs. Pieces are packed lazily, so the host packs piece n+1 while the device runs piece n.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from boundgen import cuda_waits, grid_dependency
from boundgen.compile.backends import CompiledForwards, CompileOptions, select_forwards
from boundgen.compile.buckets import Bucket, BucketSet
from boundgen.compile.chunking import Piece, chunk
from boundgen.compile.decode import plain_session
from boundgen.compile.staging import StagedBucket
from boundgen.config import ModelConfig
from boundgen.models.decoder import DecoderModel
from boundgen.runtime.memory import Lease, MemoryPools
from boundgen.search import search
from boundgen.text.packing import (
    HostLayout,
    PackedBatch,
    SequenceGroup,
    batch_of,
    pack_arrays,
)

# Tokens per forward piece on CPU: at most ~0.15 s of the demo model on 2 cores, so a cancelled or
# late request leaves the model that soon; it costs no throughput there (BENCHMARKS.md, issue 19).
CPU_PIECE_TOKENS = 2048
# label sets whose head weight rows `label_logits` keeps on the device (a few per deployment: each
# task's label ids; 64 sets of 8 labels are 0.9 MB at Qwen2.5-0.5B's width in bf16)
_MAX_LABEL_SETS = 64
# Where `rows` spends the host's time, per part (`stats()["host_seconds"]`, /metrics): `pack`
# chunks, packs and pads the next piece (a staged bucket's piece: chunks and packs it); `stage`
# copies a piece's inputs towards the device through pooled buffers; `launch` queues its forward (a
# staged bucket: the fill of its input buffer, the copy and the replay) and the gather of its rows.
# On CUDA the device work is only queued, so these are host times, including any wait inside them;
# the same parts' CPU time on the calling thread (`host_cpu_seconds`) tells the waits apart (for the
# GIL, an allocator, a full queue).
HOST_PARTS = ("pack", "stage", "launch")
# a piece of a forward as `pieces` yields it: (a staged bucket, the piece's host layout written
# into it) or (None, the packed batch, padded where a bucket fits)
_Piece = tuple[StagedBucket, HostLayout] | tuple[None, PackedBatch]


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        device: torch.device | str,
        forwards: CompiledForwards | None = None,
        max_batch_tokens: int = 32768,
        share_prefix: bool = True,
        pools: MemoryPools | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.forwards = forwards
        self.max_batch_tokens = max_batch_tokens
        self.share_prefix = share_prefix
        self.pools = pools or MemoryPools(self.device)
        self.backend_name = forwards.name if forwards else "eager"
        self.buckets = BucketSet(forwards.buckets) if forwards else None
        self._by_layout = {_bucket_key(b): f for b, f in (forwards.fns if forwards else {}).items()}
        # staging leases of batches whose device work may still read them (CUDA), oldest first
        self._pending: deque[tuple[torch.cuda.Event, Lease]] = deque()
        self._lock = threading.Lock()
        self._tries: dict[int, tuple] = {}  # id(trie) → (trie, its copy on this device)
        # label ids → the head's weight rows of them, on this device (`label_logits`)
        self._label_weights: dict[tuple[int, ...], torch.Tensor] = {}
        self._host_ns = dict.fromkeys(HOST_PARTS, 0)
        self._host_cpu_ns = dict.fromkeys(HOST_PARTS, 0)
        self._pieces = 0

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---- groups → rows ---------------------------------------------------------------------------

    @torch.inference_mode()
    def rows(
        self,
        groups: list[SequenceGroup],
        pooling: str | list[str] = "last",
        wanted: Callable[[int, int], bool] | None = None,
    ) -> torch.Tensor:
        """[N, H] hidden state per output sequence (one per suffix), in input order. `pooling`:
        "last" (the sequence's last token), "mean" (over all its tokens) or "tokens" (every token's
        row: a sequence of L tokens gives L rows in its place), for all or per sequence.
        `wanted(first, end)`, asked before each piece of output sequences [first, end): False skips
        the piece (its rows stay zero), so work nobody waits for any more stops within one piece.
        On CPU a piece is at most `CPU_PIECE_TOKENS` (~0.15 s of a small model)."""
        n = sum(len(g.suffixes) for g in groups)
        modes = [pooling] * n if isinstance(pooling, str) else list(pooling)
        budget = self.max_batch_tokens
        if self.device.type == "cpu":
            budget = min(budget, CPU_PIECE_TOKENS)
        outs, row = [], 0
        clock = _clocks
        with self._staging() as lease:
            for staged, packed in self._timed(self.pieces(groups, modes, budget)):
                k = len(packed.last) if staged is not None else packed.num_rows
                piece_modes = modes[row : row + k]
                row += k
                token_rows = (
                    token_row_index(packed, piece_modes) if "tokens" in piece_modes else None
                )
                if wanted is not None and not wanted(row - k, row):
                    rows_out = k if token_rows is None else len(token_rows)
                    hidden_size = self.config.hidden_size
                    outs.append(
                        torch.zeros(rows_out, hidden_size, dtype=self.dtype, device=self.device)
                    )
                    continue
                if staged is not None:  # one fill, one copy, one replay (compile/staging.py)
                    t0 = clock()
                    outs.append(staged.rows(packed))
                    self._spent("launch", t0, clock())
                    continue
                t0 = clock()
                packed = stage_packed(packed, lease, self.device)
                t1 = clock()
                self._spent("stage", t0, t1)
                hidden = self.forward(packed)
                out = hidden.index_select(0, packed.last_index)
                if "mean" in piece_modes:
                    idx = [i for i, m in enumerate(piece_modes) if m == "mean"]
                    idx_dev = lease.stage(torch.tensor(idx, dtype=torch.int64), bucket=False)
                    starts = packed.seq_start.index_select(0, idx_dev)
                    lengths = packed.seq_len.index_select(0, idx_dev)
                    out[idx_dev] = mean_rows(hidden, starts, lengths)
                if token_rows is not None:
                    out = torch.cat([hidden, out]).index_select(0, lease.stage(token_rows, False))
                outs.append(out)
                self._spent("launch", t1, clock())
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _timed(self, pieces: Iterator[_Piece]) -> Iterator[_Piece]:
        """`pieces`, the host time of making each counted as `pack`."""
        while True:
            t0 = _clocks()
            piece = next(pieces, None)
            self._spent("pack", t0, _clocks(), pieces=int(piece is not None))
            if piece is None:
                return
            yield piece

    def _spent(
        self, part: str, start: tuple[int, int], end: tuple[int, int], pieces: int = 0
    ) -> None:
        """Count the wall and thread CPU time between two `_clocks()` readings to `part`."""
        wall = end[0] - start[0]
        # A thread cannot run longer than the wall clock, but the two clocks are read one after
        # the other and may tick at rates apart by NTP's slew (up to 500 ppm): a span spent all on
        # the CPU can read some ns more CPU than wall (CI saw 41.653 against 41.633 us).
        cpu = min(end[1] - start[1], wall)
        with self._lock:  # a runner serves several nodes' threads
            self._host_ns[part] += wall
            self._host_cpu_ns[part] += cpu
            self._pieces += pieces

    def _staged(self, piece: Piece, modes: list[str]) -> StagedBucket | None:
        """The staged graph of a piece's bucket, when every row it wants is a last-token row and
        their number fits its gather (else None: the general path)."""
        if not self._by_layout or modes.count("last") != len(modes):  # a C loop: W2's 100 rows
            return None
        bucket = piece.bucket or self.buckets.smallest(piece.footprint)
        fn = self._by_layout.get(_bucket_key(bucket)) if bucket is not None else None
        if not isinstance(fn, StagedBucket) or len(modes) > fn.inputs.capacity:
            return None
        return fn

    @contextlib.contextmanager
    def _staging(self) -> Iterator[Lease]:
        """Pooled pinned/device buffers for one call; they go back to the pools once the device work
        that reads them is done (an event on CUDA, at once on CPU)."""
        cuda = self.device.type == "cuda"
        if cuda:
            with self._lock:
                while self._pending and self._pending[0][0].query():
                    self._pending.popleft()[1].release_all()
        lease = Lease(self.pools)
        try:
            yield lease
        finally:
            if cuda and lease.taken:  # a staged graph's call takes nothing: no event to record
                ev = cuda_waits.event()
                ev.record()
                with self._lock:
                    self._pending.append((ev, lease))
            else:
                lease.release_all()

    def pieces(
        self, groups: list[SequenceGroup], modes: list[str], budget: int | None = None
    ) -> Iterator[_Piece]:
        """Host-side batches of `groups` (rows in order), each within the token budget and, with
        compiled buckets, cut at sequence boundaries to fill the buckets (`compile.chunking`).
        Each comes as (staged bucket, its host layout) when a staged graph takes the piece as is
        (`_staged`: written padded straight into that bucket's input buffer), else as (None, the
        packed batch) padded into the smallest bucket that fits (a batch no bucket takes comes as
        is, counted as a miss, and runs eagerly; eager buckets, graphs of the plain model, only pad
        what fits: an uncompiled forward runs any size). Packed lazily: piece n+1 is packed while
        n runs. `budget`: tokens per piece (default `max_batch_tokens`)."""
        share = self.shares_prefix(groups, modes)
        cut = self.buckets if self.forwards and self.forwards.cut_large_chunks else None
        row = 0
        for piece in chunk(groups, budget or self.max_batch_tokens, cut, share):
            k = sum(len(g.suffixes) for g in piece.groups)
            staged = self._staged(piece, modes[row : row + k])
            row += k
            lay = pack_arrays(piece.groups, share_prefix=share)
            if staged is not None:
                self.buckets.count(staged.bucket, len(lay.input_ids))
                yield staged, lay
                continue
            packed = batch_of(lay, piece.groups)
            yield None, packed if self.buckets is None else self.buckets.pad(packed, lay)[1]

    def shares_prefix(self, groups: list[SequenceGroup], modes: list[str]) -> bool:
        """Whether `groups` are packed with their prefixes shared (cascade): unless this runner
        never shares, or a row that wants all its tokens (mean, per-token pooling) has a prefix."""
        return self.share_prefix and not _whole_rows_with_prefix(groups, modes)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states of every token of a packed device batch: [T, H]. A batch in a
        bucket's exact layout (from `pieces`) runs that bucket; another batch that fits a bucket
        is padded first; one that fits none runs the plain model."""
        fn = self._by_layout.get(_layout_key(batch))
        if fn is not None:
            return fn(batch)
        bucket = self.buckets.choose(batch.to("cpu")) if self.buckets is not None else None
        if bucket is None:
            return self.model(batch.input_ids, batch.positions, batch.attn)
        padded = self.buckets.pad(batch.to("cpu"))[1].to(self.device, non_blocking=True)
        return _unpad(self.forwards.fns[bucket](padded), batch, padded)

    @torch.inference_mode()
    def head(self, rows: torch.Tensor, columns: list[int] | None = None) -> torch.Tensor:
        """float32 logits [N, C] of the LM head (or score head); `columns` picks vocabulary ids
        (`label_logits`)."""
        if columns is None:
            return self.model.head(rows)
        return self.label_logits(rows, columns).float()

    @torch.inference_mode()
    def label_logits(self, rows: torch.Tensor, columns: list[int]) -> torch.Tensor:
        """Logits [N, C] in the model's dtype of vocabulary ids `columns`. The head's weight rows
        of a label set are kept on the device (label ids repeat across requests): a later request
        with the same ids makes one GEMM call and copies nothing. On a server each torch call of a
        request's nodes gives the GIL up and waits to take it back, beside a busy event loop up to
        the switch interval: the fewer, the better (`benchmarks/count_gil_trips.py`)."""
        weight = self._label_weights.get(tuple(columns))
        if weight is not None:
            return F.linear(rows, weight)
        with self._staging() as lease:
            cols = lease.stage(torch.tensor(columns, dtype=torch.int64), bucket=False)
            weight = self.model.label_weight(cols)
        self._keep_label_weight(columns, weight)
        return F.linear(rows, weight)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host through one non-blocking copy into pinned memory (torch's caching host
        allocator: a block is reused once its copy has run; `to` pins the copy of a non-blocking
        device-to-host `to` itself, one torch call), readable once the caller's stream work is
        synchronized: in a pipeline, return it from a device node, whose event the executor
        synchronizes before any CPU node reads it (that event sync is then the only one; `.cpu()`
        would add a stream sync of its own). A CPU tensor is returned as is."""
        if t.device.type == "cpu":
            return t
        return t.to("cpu", non_blocking=True)

    def _keep_label_weight(self, columns: list[int], weight: torch.Tensor) -> None:
        """Keep a label set's weight rows on the device. At most `_MAX_LABEL_SETS` sets, never
        evicted (a kept tensor may be read on any stream; freeing it would need stream
        bookkeeping). Its making is waited for once, here, so that any stream may read it at
        once."""
        if len(self._label_weights) >= _MAX_LABEL_SETS:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        with self._lock:
            if len(self._label_weights) < _MAX_LABEL_SETS:
                self._label_weights.setdefault(tuple(columns), weight)

    @torch.inference_mode()
    def beam_search(
        self,
        prompts: list[list[int]],
        width: int,
        steps: int,
        trie: Any = None,
        banned: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounded beam search (`search.search`) over `prompts`: (tokens [B, W, S], scores [B, W]).
        A whole-search CUDA graph when the backend has them and a bucket fits and is free, else a
        plain session per request (`trie`: a `boundgen.Trie`, moved to this device once)."""
        trie = self._on_device(trie)
        graphs = self.forwards.search if self.forwards else None
        if graphs is not None:
            out = graphs.run(prompts, width, steps, trie, tuple(banned))
            if out is not None:
                return out
        # the plain session's kernels as a search's (`grid_dependency.for_searches`)
        with grid_dependency.for_searches():
            session = plain_session(self.model, self.device, prompts, width, steps)
            return search(session, self.model.logits, width, steps, trie, banned)

    @property
    def search_streams(self) -> int:
        """How many beam searches may run at once on this runner's device (one whole-search
        graph replica per CUDA stream, `compile.search_streams`); 1 without graphs."""
        graphs = self.forwards.search if self.forwards else None
        return graphs.streams if graphs is not None else 1

    def largest_search(
        self, width: int, steps: int, trie: Any = None, banned: tuple[int, ...] = ()
    ) -> int | None:
        """The most prompts one whole-search graph made for this width, steps and trie takes once
        the runner is sealed (`SearchGraphs.largest_made`); None: no limit known."""
        graphs = self.forwards.search if self.forwards else None
        if graphs is None:
            return None
        return graphs.largest_made(width, steps, self._on_device(trie), tuple(banned))

    def _on_device(self, trie: Any) -> Any:
        """The trie on this runner's device, copied once per trie (a graph keeps reading it)."""
        if trie is None or _same_device(trie.device, self.device):
            return trie
        with self._lock:
            moved = self._tries.get(id(trie))
            if moved is None or moved[0] is not trie:
                moved = self._tries[id(trie)] = (trie, trie.to(self.device))
            return moved[1]

    def seal(self) -> None:
        """Compile and capture nothing more (after a warm-up): beam searches run in the
        whole-search graphs made so far or on the plain path (`SearchGraphs.seal`)."""
        graphs = self.forwards.search if self.forwards else None
        if graphs is not None:
            graphs.seal()

    def stats(self) -> dict:
        out = {"backend": self.backend_name}
        if self.buckets is not None:
            out["buckets"] = [b.name for b in self.buckets]
            out.update(self.buckets.stats.as_dict())
        staged = [f.inputs.stats() for f in self._by_layout.values() if isinstance(f, StagedBucket)]
        if staged:
            out["staged"] = {k: sum(s[k] for s in staged) for k in staged[0]}
        with self._lock:
            out["pieces"] = self._pieces
            out["host_seconds"] = {part: ns / 1e9 for part, ns in self._host_ns.items()}
            out["host_cpu_seconds"] = {part: ns / 1e9 for part, ns in self._host_cpu_ns.items()}
        graphs = self.forwards.search if self.forwards else None
        if graphs is not None:
            out["beam_graphs"] = {
                "made": len(graphs.slots),
                "searches": graphs.searches,
                "misses": graphs.misses,
            }
        return out


def make_runner(
    model: DecoderModel,
    device: torch.device | str,
    max_batch_tokens: int = 32768,
    share_prefix: bool = True,
    backend: str = "auto",
    options: CompileOptions | None = None,
) -> ModelRunner:
    """The runner for `backend` (see `compile.backends.select_forwards`; `"auto"` picks the best
    that works here and logs why)."""
    cuda_waits.apply(device)  # sleeping waits under BOUNDGEN_CUDA_WAIT=block (`cuda_waits`)
    forwards = select_forwards(model, device, max_batch_tokens, backend, options)
    return ModelRunner(model, device, forwards, max_batch_tokens, share_prefix)


def mean_rows(hidden: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Mean of hidden rows [start, start+length) per sequence ([n, H]), as one segment sum."""
    n = start.shape[0]
    seq_id = torch.repeat_interleave(torch.arange(n, device=hidden.device), length)
    base = torch.repeat_interleave(start - (torch.cumsum(length, 0) - length), length)
    rows = base + torch.arange(seq_id.shape[0], device=hidden.device)
    sums = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_id, hidden.index_select(0, rows).float())
    return (sums / length[:, None].float()).to(hidden.dtype)


def _clocks() -> tuple[int, int]:
    """(wall, this thread's CPU) in ns: `_spent` takes two readings."""
    return time.perf_counter_ns(), time.thread_time_ns()


# ---- staging a PackedBatch through pooled pinned / device buffers -------------------------------

_ALIGN_BYTES = 16


def stage_packed(batch: PackedBatch, lease: Lease, device: torch.device) -> PackedBatch:
    """Move a CPU `PackedBatch` to `device` with two copies: every int64 tensor through one pooled
    pinned buffer into one pooled device buffer (bucketed size), the same for the int32 offsets."""
    if device.type == "cpu":
        return batch
    attn = batch.attn
    longs = [batch.input_ids, batch.positions, batch.last_index, batch.seq_start, batch.seq_len]
    ints = [t for t in (attn.cu_seqlens, attn.cu_prefix, attn.cu_group_q) if t is not None]
    l_dev = _stage_many(longs, torch.int64, lease)
    i_dev = iter(_stage_many(ints, torch.int32, lease))
    new_attn = dataclasses.replace(
        attn,
        cu_seqlens=next(i_dev),
        cu_prefix=next(i_dev) if attn.cu_prefix is not None else None,
        cu_group_q=next(i_dev) if attn.cu_group_q is not None else None,
    )
    return PackedBatch(*l_dev[:2], new_attn, *l_dev[2:], list(batch.rows_per_group))


def _stage_many(
    tensors: list[torch.Tensor], dtype: torch.dtype, lease: Lease
) -> list[torch.Tensor]:
    # NOTE: every view starts on a 16-byte boundary: compiled kernels (AOTInductor) assume aligned
    # inputs and otherwise copy the tensor on every call (and warn each time).
    step = max(1, _ALIGN_BYTES // dtype.itemsize)
    sizes = [t.numel() for t in tensors]
    starts, off = [], 0
    for n in sizes:
        starts.append(off)
        off += -(-n // step) * step
    rows = lease.pools.bucket(off)
    host = lease.host(rows, dtype)
    # NOTE: the host side in numpy, one torch call for the copy to the device: every torch call
    # releases the GIL, and under a loaded server's event loop getting it back can take a switch
    # interval (up to 5 ms) each; a batch's staging was a dozen torch calls (H200, W5: 7.5 ms of
    # host time a merged forward at saturation, BENCHMARKS.md 2026-12-02 sixth session)
    host_np = host.numpy()
    for t, start, n in zip(tensors, starts, sizes):
        host_np[start : start + n] = t.numpy().reshape(-1)
    dev = lease.device(rows, dtype)
    dev[:off].copy_(host[:off], non_blocking=True)
    return [
        v if t.dim() == 1 else v.view(t.shape)
        for t, v in ((t, dev[start : start + n]) for t, start, n in zip(tensors, starts, sizes))
    ]


# ---- bucket lookup -----------------------------------------------------------------------------


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def token_row_index(packed: PackedBatch, modes: list[str]) -> torch.Tensor:
    """int64 rows of cat([hidden [T, H], pooled [n, H]]) that make a piece's output: each "tokens"
    sequence's own token rows, every other sequence's pooled row (host side, before staging)."""
    total = packed.num_tokens
    starts, lengths = packed.seq_start.tolist(), packed.seq_len.tolist()
    return torch.cat(
        [
            torch.arange(start, start + n) if mode == "tokens" else torch.tensor([total + i])
            for i, (mode, start, n) in enumerate(zip(modes, starts, lengths))
        ]
    )


def _whole_rows_with_prefix(groups: list[SequenceGroup], modes: list[str]) -> bool:
    """Whether a row that wants mean or per-token pooling belongs to a group with a prefix (its
    tokens must then stay one contiguous sequence: no cascade layout)."""
    if "mean" not in modes and "tokens" not in modes:
        return False
    row = 0
    for g in groups:
        n = len(g.suffixes)
        if g.prefix and ({"mean", "tokens"} & set(modes[row : row + n])):
            return True
        row += n
    return False


def _bucket_key(b: Bucket) -> tuple:
    return (b.tokens, b.segments, b.max_seqlen, b.groups, b.prefix_tokens, b.shared_tokens)


def _layout_key(batch: PackedBatch) -> tuple:
    """The same tuple as `_bucket_key` for a batch in a bucket's exact layout: the bucket's compiled
    function takes it as is."""
    a = batch.attn
    if a.has_shared_prefix:
        if (a.max_prefix, a.max_group_q) != (a.num_prefix_tokens, a.num_shared_tokens):
            return ()
        cascade = (a.cu_prefix.shape[0] - 1, a.num_prefix_tokens, a.num_shared_tokens)
    else:
        cascade = (0, 0, 0)
    return (batch.num_tokens, a.cu_seqlens.shape[0] - 1, a.max_seqlen, *cascade)


def _unpad(hidden: torch.Tensor, batch: PackedBatch, padded: PackedBatch) -> torch.Tensor:
    """Rows of `batch`'s own tokens out of the hidden states of its padded layout, in order."""
    a, pa = batch.attn, padded.attn
    p = a.num_prefix_tokens if a.has_shared_prefix else 0
    q = a.num_shared_tokens if a.has_shared_prefix else 0
    P = pa.num_prefix_tokens if pa.has_shared_prefix else 0
    Q = pa.num_shared_tokens if pa.has_shared_prefix else 0
    tail = batch.num_tokens - p - q
    return torch.cat([hidden[:p], hidden[P : P + q], hidden[P + Q : P + Q + tail]])
