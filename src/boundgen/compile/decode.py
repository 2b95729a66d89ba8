"""Beam-search decoding: a plain session per request, and `SearchGraphs`, the whole search as one
CUDA graph per bucket.

A decode step (B·W rows, one token each) is pure launch overhead on a GPU: the eager model is ~75
kernels a layer, and the selection, KV reorder and history gather between steps add more. A
`SearchGraphs` bucket (padded prompt tokens T, prompts B, width W, steps S, trie) keeps the prompt
KV, the beams' KV, the step inputs and the results in persistent buffers, and captures one call of
`search.search` over them — prefill, S decode steps, selection and reorders — as a single graph. A
request copies its padded prompts in and replays it.

With `compile_layers` the prefill and the decode step run per layer through one `torch.compile`d
function each (regional compilation: the layer module is an argument, so one compiled graph serves
all layers, and the decode step takes its index as a tensor, so one graph serves all steps):
RMSNorm, RoPE, SiLU·mul, residuals and the KV writes fuse.

Rules that keep replays correct (see compile/graphs.py): inputs are copied into the bucket's
static buffers; `BeamKV.reorder` swaps its double buffers while the graph is captured, so every
replay reads and writes the same buffers in the same order; a trie's tensors keep their storage
(the bucket is keyed by the trie object, which holds them).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from boundgen import grid_dependency
from boundgen.attention import beam_decode, own_slots
from boundgen.attention.cascade import grouped_rows_attention, grouped_rows_partial, merge_partial
from boundgen.compile import programmatic, residual, staging
from boundgen.compile.buckets import Bucket, BucketSet, default_buckets
from boundgen.compile.events import BEAM_GRAPH, COMPILES
from boundgen.compile.staging import StagedInputs
from boundgen.kv import BeamKV, DecodeKV, PromptKV
from boundgen.search import banned_tensor, search
from boundgen.text.packing import Footprint, SequenceGroup, pack, pack_arrays

log = logging.getLogger("boundgen.compile")


class DecodeSession:
    """One beam search's decode state: `prompt_lengths` [B] and `last_hidden` [B, H] from the
    prefill; `hidden(i, tokens, positions)` → final hidden states [N, H] of decode step i (N = B·W
    rows, one token each) and `step(...)` → their logits [N, V] (`head`); `reorder(parent)` makes
    beam n continue beam parent[n]; `close()` when done."""

    def __init__(
        self,
        state: DecodeKV,
        prompt_lengths: torch.Tensor,
        last_hidden: torch.Tensor,
        hidden: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.state, self.prompt_lengths, self.last_hidden = state, prompt_lengths, last_hidden
        self.hidden, self.head = hidden, head
        self._on_close = on_close

    def step(self, i: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(i, tokens, positions))

    def reorder(self, parent: torch.Tensor) -> None:
        self.state.beams.reorder(parent)

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


def plain_session(model, device, prompts: list[list[int]], width: int, steps: int) -> DecodeSession:
    """A session whose KV is allocated for this request alone (any shape, no graphs)."""
    cfg = model.config
    batch = pack([SequenceGroup([], prompts)], share_prefix=False).to(device)
    dtype = model.embed_tokens.weight.dtype
    n = len(prompts) * width
    prompt_kv = PromptKV(
        cfg.num_layers, batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    hidden = model(batch.input_ids, batch.positions, batch.attn, prompt_kv)
    beams = BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    cu_beams = torch.arange(0, n + 1, width, dtype=torch.int32, device=device)
    state = DecodeKV(
        prompt_kv, batch.attn.cu_seqlens, batch.attn.max_seqlen, beams, cu_beams, width, cfg.gqa
    )

    def step_hidden(i: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        state.step = i
        return model(tokens, positions, None, state)

    last = hidden.index_select(0, batch.last_index)
    return DecodeSession(state, batch.seq_len, last, step_hidden, model.logits)


# ---- one layer of the prefill and of a decode step, as functions of their tensors ---------------


# A layer function takes its input x with x through the layer's input norm (`normed`) and returns
# its output with the norm that follows it (`next_norm`: the next layer's input norm, the model's
# final norm after the last layer). Compiled one layer at a time, a layer that returned x alone
# ended in a kernel of its own for its last residual add (its output must exist in memory) and
# the next layer's graph began with the norm; ending the layer with that norm lets Inductor put
# the add into the norm's kernel: one launch fewer a layer (Inductor's CPU code shows it; on the
# GPU, 24 a forward and 96 a W4 search expected, BENCHMARKS.md "Still to measure").


def first_layer_inputs(model, ids, positions):
    """ids, positions [T] → the first layer's x (the embedded tokens), x through its input
    norm, and cos, sin of the positions. Compiled with the layers: eagerly these were a dozen
    kernels a forward (the lookups, casts and the norm's steps); Inductor's CPU code fuses them
    into one."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(positions, x.dtype)
    return x, model.layers[0].input_layernorm(x), cos, sin


def prefill_layer(
    layer, x, normed, cos, sin, cu_seqlens, max_seqlen: int, pk, pv, backend, next_norm
):
    """A decoder layer over packed prompts (causal per segment), storing k/v into `pk`/`pv`
    [T, Hkv, D]. x, normed [T, hidden] → (its output, `next_norm` of it)."""
    q, k, v = layer.attention_input(x, cos, sin, normed=normed)
    pk.copy_(k)
    pv.copy_(v)
    o, _ = backend.varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True)
    out = layer.mlp_block(layer.attention_output(x, o.reshape(x.shape[0], -1)))
    return out, next_norm(out)


def decode_layer(
    layer,
    x,
    normed,
    cos,
    sin,
    pk,
    pv,
    bkv,
    step,
    cu_beams,
    cu_prompt,
    max_beams,
    max_prompt,
    cu_rows,
    max_rows,
    group: int,
    backend,
    next_norm,
    fused: bool = False,
    own_kernel: bool = False,
):
    """A decoder layer for one token per beam. The beam's k/v go into slot `step` (an int64 tensor
    [1]) of `bkv` [N, S, 2, Hkv, D] (k and v side by side, `BeamKV`: one write); queries attend
    to their prompt's KV (`pk`/`pv` [T, Hkv, D], segments `cu_prompt`, shared by the prompt's
    beams `cu_beams`; their `group` query heads of a KV head as rows `cu_rows`, `max_rows`:
    `cascade.grouped_rows_attention`) and to their own slots ≤ step, merged by log-sum-exp; with
    `fused` (on CUDA) in one kernel (`attention/beam_decode.py`); else with `own_kernel` (on CUDA)
    flash and one kernel for the own slots and the merge (`attention/own_slots.py`). x, normed
    [N, hidden] → (its output, `next_norm` of it)."""
    n = x.shape[0]
    fused = fused and x.is_cuda
    # the prompt attention reads q grouped by KV head: rotated into that order, not copied there
    q = layer.decode_input(x, cos, sin, bkv, step, group > 1 and not fused, normed)
    bk, bv = bkv[:, :, 0], bkv[:, :, 1]
    if fused:  # one kernel for the prompt part, own slots and merge
        # the kernel's tile, read here: dynamo guards on it (another tile, another compile)
        block, warps = beam_decode.BLOCK_M, beam_decode.NUM_WARPS
        o = torch.ops.boundgen.beam_decode(
            q, pk, pv, bk, bv, step, cu_beams, cu_prompt, max_beams, block, warps
        )
    elif group > 1 and own_kernel and own_slots.chosen(x.device):  # flash, one kernel for the rest
        shared, shared_lse = grouped_rows_partial(
            q, pk, pv, cu_rows, cu_prompt, max_rows, max_prompt, group, backend
        )
        o = torch.ops.boundgen.own_slots_merge(q, bk, bv, step, shared, shared_lse)
    else:
        shared, shared_lse = grouped_rows_attention(
            q, pk, pv, cu_rows, cu_prompt, max_rows, max_prompt, group, backend
        )
        own, own_lse = _own_slots_attention(q, bk, bv, step)
        o = merge_partial(shared, shared_lse, own, own_lse)
    out = layer.mlp_block(layer.attention_output(x, o.reshape(n, -1)))
    return out, next_norm(out)


def _own_slots_attention(q, k, v, step) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D] (or grouped by KV head, [N, G, Hkv, D]); k, v [N, S, Hkv, D] of which slots
    > step are not written yet (masked). → out [N, Hq, D], lse [N, Hq] float32. Products and
    sums, not matmuls: S is a handful of slots, and Inductor fuses these into the kernels around
    them (an einsum became two fp32 GEMM launches per layer and step on the H200)."""
    s, hkv = k.shape[1], k.shape[2]
    if q.dim() == 4:  # [N, G, Hkv, D] → [N, 1, Hkv, G, D], a view
        n, _, _, d = q.shape
        hq = q.shape[1] * hkv
        qf = q.float().transpose(1, 2).unsqueeze(1)
    else:
        n, hq, d = q.shape
        qf = q.float().view(n, 1, hkv, hq // hkv, d)
    scores = (qf * k.float().unsqueeze(3)).sum(-1) * (1.0 / math.sqrt(d))  # [N, S, Hkv, rep]
    later = (torch.arange(s, device=q.device) > step).view(1, s, 1, 1)
    scores = scores.masked_fill(later, float("-inf"))
    lse = torch.logsumexp(scores, dim=1)  # [N, Hkv, rep]
    p = torch.exp(scores - lse.unsqueeze(1))
    out = (p.unsqueeze(-1) * v.float().unsqueeze(3)).sum(1)  # [N, Hkv, rep, D]
    return out.reshape(n, hq, d).to(q.dtype), lse.reshape(n, hq)


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (tokens, rows, segments) dynamic for the compiled layers: one compiled graph
    serves every bucket (padded prompt tokens T, rows B·W), so a new bucket costs a CUDA-graph
    capture, not a compile. `maybe_`: a dim of size 1 may stay specialised."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class ModelSteps:
    """The prefill and the decode step of `model` over explicit buffers, per layer (compiled once
    for all layers and all buckets when `compile_layers`)."""

    def __init__(self, model, backend, compile_layers: bool) -> None:
        self.model, self.backend = model, backend
        self._first, self._prefill, self._decode = first_layer_inputs, prefill_layer, decode_layer
        self.compiled = compile_layers
        # each layer with the norm its function ends with (see `prefill_layer`)
        nexts = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
        self._layers = list(zip(model.layers, nexts))
        self.fused_attention = beam_decode.chosen(getattr(backend, "name", ""))
        if compile_layers:
            import torch._inductor.config as inductor

            # NOTE: round fused intermediates to the model dtype as eager does (RoPE, RMSNorm in
            # bf16), so a compiled search picks the beams the eager one picks up to kernel order
            if hasattr(inductor, "emulate_precision_casts"):
                inductor.emulate_precision_casts = True
            # NOTE: rows are marked dynamic per call (`_rows_dynamic`); the ints (max segment
            # lengths) specialise once, then turn dynamic at their second value (dynamo's
            # automatic dynamic shapes): two compiles per function for every bucket there is
            options = residual.inductor_options() or None  # None: Inductor's own config
            self._first = torch.compile(first_layer_inputs, fullgraph=True, options=options)
            self._prefill = torch.compile(prefill_layer, fullgraph=True, options=options)
            self._decode = torch.compile(decode_layer, fullgraph=True, options=options)

    def _inputs(self, ids, positions):
        """A forward's first layer's inputs (`first_layer_inputs`, compiled with the layers)."""
        if self.compiled:
            _rows_dynamic(ids, positions)
        return self._first(self.model, ids, positions)

    def prefill(self, ids, positions, cu_seqlens, max_seqlen: int, prompt: PromptKV):
        """Final-normed hidden states [T, H] of the packed prompts, their KV stored."""
        x, normed, cos, sin = self._inputs(ids, positions)
        for i, (layer, next_norm) in enumerate(self._layers):
            pk, pv = prompt.k[i], prompt.v[i]
            if self.compiled:
                _rows_dynamic(x, normed, cos, sin, pk, pv, cu_seqlens)
            x, normed = self._prefill(
                layer,
                x,
                normed,
                cos,
                sin,
                cu_seqlens,
                max_seqlen,
                pk,
                pv,
                self.backend,
                next_norm,
            )
        return normed

    def decode(self, tokens, positions, state: DecodeKV, step: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of one decode step."""
        return self.model.head(self.decode_hidden(tokens, positions, state, step))

    def decode_hidden(self, tokens, positions, state: DecodeKV, step: torch.Tensor):
        """Final-normed hidden states [N, H] of one decode step."""
        b = state.beams
        x, normed, cos, sin = self._inputs(tokens, positions)
        for i, (layer, next_norm) in enumerate(self._layers):
            pk, pv, bkv = state.prompt.k[i], state.prompt.v[i], b.kv[i]
            if self.compiled:
                _rows_dynamic(
                    x, normed, cos, sin, pk, pv, bkv, state.cu_beams, state.cu_prompt, state.cu_rows
                )
            x, normed = self._decode(
                layer,
                x,
                normed,
                cos,
                sin,
                pk,
                pv,
                bkv,
                step,
                state.cu_beams,
                state.cu_prompt,
                state.max_beams,
                state.max_prompt,
                state.cu_rows,
                state.max_rows,
                state.group,
                self.backend,
                next_norm,
                self.fused_attention,
                # the own-slot kernel in compiled layers only: eager ones keep the plain search's
                # arithmetic (their graph search recommends exactly what it does; the kernel
                # rounds once where the plain search rounds twice)
                self.compiled,
            )
        return normed


# ---- the whole search, captured per bucket ------------------------------------------------------


def batch_sizes(text: str) -> tuple[int, ...]:
    """The prompts-per-search ladder from "1,2,4,..." (ascending, from 1): a merged search is
    padded up to the next size, so each size is a graph a warm-up makes."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] != 1 or any(b <= a for a, b in itertools.pairwise(sizes)):
        raise ValueError(
            f"BOUNDGEN_BEAM_BATCH_SIZES={text!r}: expected ascending whole numbers from 1, "
            "e.g. 1,2,4,8,16,32,64"
        )
    return sizes


# Prompts per search: a search's count is padded up to the next of these. Powers of two waste up
# to half a search's prompt work (17 merged requests run as 32); a finer ladder
# ("1,2,3,4,6,8,12,16,24,32,48,64": at most a third) makes more graphs at warm-up. Which serves
# `/v1/beam` better is the GPU's A/B (BENCHMARKS.md "Still to measure").
BATCH_SIZES = batch_sizes(os.environ.get("BOUNDGEN_BEAM_BATCH_SIZES", "1,2,4,8,16,32,64"))


@dataclass
class _Slot:
    """One bucket's persistent buffers, its graph (once captured) and its lock."""

    inputs: StagedInputs  # the padded prompts' layout: one pinned host buffer, one device buffer
    max_seqlen: int
    state: DecodeKV
    initial: tuple  # the beam KV's buffers in their initial order
    steps: torch.Tensor  # int64 [S]: step i's slot index, sliced [i:i+1] per step
    banned: torch.Tensor  # int64 token ids no beam continues with
    workspaces: dict = field(default_factory=dict)  # the trie's buffers per row count
    trie: Any = None  # kept alive: the graph reads its tensors
    tokens: torch.Tensor | None = None  # results [B, W, S]
    scores: torch.Tensor | None = None  # [B, W]
    graph: Any = None  # the captured search (torch.cuda.CUDAGraph)
    lock: threading.Lock = field(default_factory=threading.Lock)
    label: str = ""  # the bucket and batch size, for logs
    used: bool = False  # run once (its layers compiled for it, its graph captured)


class SearchGraphs:
    """Whole-search buckets: `run(prompts, width, steps, trie, banned)` → (tokens [B, W, S], scores
    [B, W]), or None when no bucket takes the search (the caller then runs the plain path).
    `use_graphs=False` runs the same buffers without graphs.

    Until `seal()` a search of a new shape makes its bucket (compiling the layers for a new shape
    where needed, capturing the graph): what a warm-up does. Once sealed (a server after its
    warm-up) nothing is made on the request path: a search runs in the smallest bucket made for
    its (width, steps, trie) that takes it, is cut into several searches when no one bucket takes
    all its prompts, or else falls to the plain path (`misses`, and a WARNING once per width,
    steps and trie)."""

    def __init__(
        self,
        model,
        device: torch.device,
        backend,
        prompt_buckets: list[Bucket] | None = None,
        compile_layers: bool = False,
        use_graphs: bool | None = None,
        max_slots: int = 64,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        plain = [b for b in (prompt_buckets or default_buckets(4096, 64)) if not b.cascade]
        self.buckets = BucketSet(plain)
        self.steps = ModelSteps(model, backend, compile_layers)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # the search's graph copies its prompts in as its first node (`staging.COPY_IN_GRAPH`,
        # read here; without graphs each search does, the same order of work)
        self._copy_in_graph = staging.COPY_IN_GRAPH
        self.max_slots = max_slots
        self.slots: dict[tuple, _Slot] = {}
        self.compile_layers = compile_layers
        self.sealed = False
        self.searches = 0  # searches run in a bucket (a cut search counts each piece)
        self.misses = 0  # searches no bucket took (plain path)
        self._missed: set[tuple] = set()  # (width, steps, trie) already warned about
        self._lock = threading.Lock()
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # NOTE: captured on a stream of its own, not torch's one default capture stream: two
        # instances captured there, replayed at once on two streams, never finished (H200,
        # 2026-12-04; fine one after the other). torch keeps cuBLAS's workspace per stream and a
        # graph bakes in the one of its capture stream, so they shared one (inferred: this
        # change alone made them finish)
        self._capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None

    # how many searches may run at once: one (its graphs share one pool and each bucket's buffers;
    # `compile.search_streams.SearchStreams` keeps a replica per stream)
    streams = 1

    def seal(self) -> None:
        """Make no bucket from now on (see the class docstring)."""
        self.sealed = True

    def run(
        self,
        prompts: list[list[int]],
        width: int,
        steps: int,
        trie: Any = None,
        banned: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        banned = tuple(banned)
        # a search's rule on both paths: its layers traced and graph captured unsealed, and,
        # sealed without graphs, its kernels launched live, take programmatic launch only where
        # the searches do
        with grid_dependency.for_searches():
            if not self.sealed:
                return self._run_new(prompts, width, steps, trie, banned)
            out = self._run_sealed(prompts, width, steps, trie, banned)
        if out is None:
            self._miss(len(prompts), max(len(p) for p in prompts), width, steps, trie)
        return out

    def largest_made(self, width: int, steps: int, trie: Any, banned: tuple = ()) -> int | None:
        """The most prompts one made graph of this width, steps, trie and banned set takes, once
        sealed (None: not sealed, or none made): what a caller merging searches should cap a
        search at, since a bigger one is cut into searches run one after the other."""
        if not self.sealed:
            return None
        tail = self._key_tail(width, steps, trie, tuple(banned))
        with self._lock:
            return max((k[1] for k in self.slots if k[2:] == tail), default=None)

    def _key_tail(self, width: int, steps: int, trie: Any, banned: tuple) -> tuple:
        return (width, steps, id(trie) if trie is not None else None, banned)

    @staticmethod
    def _padded(prompts: list[list[int]], b_pad: int) -> tuple[SequenceGroup, Footprint]:
        """The prompts and `b_pad` - B one-token dummies (their results dropped) as one group of
        plain sequences, and its packed footprint."""
        group = SequenceGroup([], list(prompts) + [[0]] * (b_pad - len(prompts)))
        return group, Footprint.of(group, share_prefix=False)

    def _run_new(self, prompts, width, steps, trie, banned):
        """Before sealing: the bucket this search pads to, made on first use."""
        b = len(prompts)
        b_pad = next((s for s in BATCH_SIZES if s >= b), None)
        if b_pad is None:
            return None
        group, fp = self._padded(prompts, b_pad)
        bucket = self.buckets.smallest(fp)
        if bucket is None:
            self.buckets.stats.misses += 1
            return None
        self.buckets.count(bucket, fp.tokens)
        key = (bucket, b_pad, *self._key_tail(width, steps, trie, banned))
        slot = self._slot(key, bucket, b_pad, width, steps, banned)
        if slot is None or not slot.lock.acquire(blocking=False):
            return None
        try:
            return self._replay(slot, group, b, width, steps, trie)
        finally:
            slot.lock.release()

    def _run_sealed(self, prompts, width, steps, trie, banned):
        """The smallest made bucket that takes all `prompts`, else the search cut in two halves
        (each its own search, results concatenated), else None."""
        tail = self._key_tail(width, steps, trie, banned)
        b = len(prompts)
        with self._lock:
            made = sorted(
                (k for k in self.slots if k[2:] == tail and k[1] >= b),
                key=lambda k: (k[0].tokens, k[1]),
            )
        for key in made:
            bucket, b_pad = key[0], key[1]
            group, fp = self._padded(prompts, b_pad)
            if not bucket.fits(fp):
                continue
            slot = self.slots[key]
            with slot.lock:  # sealed: waiting for the bucket beats the plain path by far
                return self._replay(slot, group, b, width, steps, trie)
        if b == 1:
            return None
        half = (b + 1) // 2
        first = self._run_sealed(prompts[:half], width, steps, trie, banned)
        rest = self._run_sealed(prompts[half:], width, steps, trie, banned) if first else None
        if first is None or rest is None:
            return None
        return torch.cat([first[0], rest[0]]), torch.cat([first[1], rest[1]])

    def _miss(self, b: int, longest: int, width: int, steps: int, trie: Any) -> None:
        self.misses += 1
        # once per (width, steps, trie): keyed by prompt counts and lengths too, the set would
        # grow with the traffic
        shape = (width, steps, id(trie) if trie is not None else None)
        if shape not in self._missed:
            self._missed.add(shape)
            log.warning(
                "beam search of %d prompt(s) (longest %d tokens), width %d, %d steps%s: no "
                "whole-search graph made at warm-up takes it; it runs on the plain path (slow). "
                "Add it to the warm-up profile (a beam entry with this width and steps, "
                "prompt_tokens >= %d)",
                b,
                longest,
                width,
                steps,
                " with a trie" if trie is not None else "",
                longest,
            )

    def _replay(self, slot: _Slot, group: SequenceGroup, b: int, width: int, steps: int, trie):
        """Stage the padded prompts into `slot` (locked by the caller), run or replay it.

        The prompts' layout is written padded into the slot's pinned host buffer through numpy
        views and goes in as one H2D copy (`StagedInputs`, as a small scoring request's; no
        packed batch, no padded copy of it, no tensor a field). Until the thirty-ninth session
        they went in as five copies from pageable memory, each waiting for the work queued
        before it: one copy from a pinned buffer made once per slot had served `/v1/beam` no
        better on the H200 (1,095.8 against 1,095.0 req/s at 64 connections on one machine,
        998.7 against 1,005.3 on another, 2026-12-04), while pinning each search's prompts on
        the fly served less (twelfth session); the host time before a search's replay is what
        this cuts (BENCHMARKS.md, thirty-ninth session)."""
        slot.trie = trie
        slot.inputs.fill(pack_arrays([group], share_prefix=False))
        slot.inputs.before_replay()  # (or the search copies them in: `_search`)
        if slot.graph is None:
            self._prepare(slot, width, steps, trie)
        else:
            slot.graph.replay()
        slot.inputs.after_replay()
        self.searches += 1
        out = slot.tokens[:b].clone(), slot.scores[:b].clone()
        slot.inputs.done()
        return out

    def _slot(
        self, key: tuple, bucket: Bucket, b: int, w: int, steps: int, banned: tuple
    ) -> _Slot | None:
        with self._lock:
            slot = self.slots.get(key)
            if slot is not None or len(self.slots) >= self.max_slots:
                return slot
            cfg, dev = self.model.config, self.device
            dtype = self.model.embed_tokens.weight.dtype
            n = b * w
            inputs = StagedInputs(bucket, dev, b, lengths=True, by_graph=self._copy_in_graph)
            inputs.fill(None)  # all padding: a valid layout until the first search's
            inputs.copy()
            prompt = PromptKV(
                cfg.num_layers, bucket.tokens, cfg.num_kv_heads, cfg.head_dim, dtype, dev
            )
            beams = BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
            cu_beams = torch.arange(0, n + 1, w, dtype=torch.int32, device=dev)
            cu_seqlens = inputs.views["cu_seqlens"]
            # NOTE: the prompts are the first b segments of the padded layout (pad segments after)
            state = DecodeKV(
                prompt, cu_seqlens[: b + 1], bucket.max_seqlen, beams, cu_beams, w, cfg.gqa
            )
            slot = _Slot(
                inputs=inputs,
                max_seqlen=bucket.max_seqlen,
                state=state,
                initial=(beams.kv, beams._spare),
                steps=torch.arange(max(steps, 1), dtype=torch.int64, device=dev),
                banned=banned_tensor(banned, cfg.vocab_size, dev),
                label=f"{bucket.name} B={b}",
            )
            self.slots[key] = slot
            return slot

    def _search(self, slot: _Slot, width: int, steps: int, trie: Any) -> None:
        """One search over the slot's buffers (what the graph captures)."""
        slot.inputs.graph_prologue()
        beams = slot.state.beams
        beams.kv, beams._spare = slot.initial
        v = slot.inputs.views
        hidden = self.steps.prefill(
            v["input_ids"], v["positions"], v["cu_seqlens"], slot.max_seqlen, slot.state.prompt
        )

        def step_hidden(i: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.steps.decode_hidden(tokens, positions, slot.state, slot.steps[i : i + 1])

        session = DecodeSession(
            slot.state,
            v["lengths"],
            hidden.index_select(0, v["rows"]),
            step_hidden,
            self.model.logits,
        )
        tokens, scores = search(
            session, self.model.logits, width, steps, trie, slot.banned, slot.workspaces
        )
        if slot.tokens is None:
            slot.tokens, slot.scores = tokens, scores
        else:
            slot.tokens.copy_(tokens)
            slot.scores.copy_(scores)

    def _prepare(self, slot: _Slot, width: int, steps: int, trie: Any) -> None:
        """First use of a bucket: run it (results for this request), then capture it for the
        next."""
        if not slot.used:  # without graphs every search comes here: count the first
            slot.used = True
            COMPILES.record(BEAM_GRAPH, f"{slot.label} W={width} S={steps}")
        if not self.use_graphs:
            self._search(slot, width, steps, trie)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (and compile) outside the capture
            for _ in range(2):
                self._search(slot, width, steps, trie)
        torch.cuda.current_stream().wait_stream(side)
        # NOTE: one graph for the whole search. A graph's launch costs the host ~20 us even at
        # 4,000 kernels and the GPU starts at once, so a chain of graphs (one per decode step)
        # hid nothing: W4 6.89 against 6.82 ms (H200, BENCHMARKS.md 2026-12-02 eighth session)
        with programmatic.capture(pool=self._pool, stream=self._capture_stream) as graph:
            self._search(slot, width, steps, trie)
        graph.replay()  # this request's results (the capture itself computes nothing)
        slot.graph = graph
