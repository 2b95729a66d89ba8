"""Beam-search decode sessions: the prompts prefilled once, then one token per beam per step.

`PlainDecode` allocates a session's KV per request and runs the model as is. `DecodeGraphs` keeps
persistent decode buckets for CUDA graphs: a decode step (W·B rows, one token each) is pure launch
overhead on a GPU, and its shapes are fixed by (prompts B, width W, steps S, padded prompt tokens
T). Per such bucket the prompt KV, the beam KV, `cu_beams`/`cu_prompt` and the step inputs live in
**persistent** buffers, so a graph captured for step s in one request replays in every later one:

- the prompt batch is padded into a plain bucket (`BucketSet.pad`), prefilled eagerly into the
  persistent `PromptKV`; `cu_prompt` is the first B+1 boundaries (pad segments come after the real
  prompts);
- `BeamKV.reorder` swaps its double buffers at every step > 0, so the buffers step s reads are fixed
  by s; `open()` restores the initial buffer assignment, so every request sees the same sequence;
- `state.step` is a Python int baked into each graph: one graph per step index, captured on first
  use;
- one request at a time per bucket (`open` takes the bucket's lock without blocking; a busy or unfit
  request gets None and the runner opens a plain session).

`use_graphs=False` runs the same persistent-buffer path without graphs (CPU tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from boundgen.compile.buckets import Bucket, BucketSet, default_buckets
from boundgen.kv import BeamKV, DecodeKV, PromptKV
from boundgen.text.packing import SequenceGroup, pack


@dataclass
class _Slot:
    prompt: PromptKV
    beams: BeamKV
    state: DecodeKV
    cu_prompt: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    initial: tuple  # (k, v, k_spare, v_spare) at creation
    graphs: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DecodeSession:
    """One beam search's decode state: `prompt_lengths` [B] and `last_hidden` [B, H] from the
    prefill; `step(i, tokens, positions)` → logits [N, V] of decode step i (N = B·W rows, one token
    each; a static buffer when graphed: consume it before the next step); `reorder(parent)` makes
    beam n continue beam parent[n]; `close()` when done."""

    def __init__(
        self,
        state: DecodeKV,
        prompt_lengths: torch.Tensor,
        last_hidden: torch.Tensor,
        step: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.state, self.prompt_lengths, self.last_hidden = state, prompt_lengths, last_hidden
        self.step = step
        self._on_close = on_close

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
        prompt_kv, batch.attn.cu_seqlens, batch.attn.max_seqlen, beams, cu_beams, width
    )

    def step(i: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        state.step = i
        return model.head(model(tokens, positions, None, state))

    return DecodeSession(state, batch.seq_len, hidden.index_select(0, batch.last_index), step)


class DecodeGraphs:
    def __init__(
        self,
        model,
        device: torch.device,
        prompt_buckets: list[Bucket] | None = None,
        use_graphs: bool | None = None,
        max_slots: int = 16,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        plain = [b for b in (prompt_buckets or default_buckets(4096, 64)) if not b.cascade]
        self.buckets = BucketSet(plain)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.max_slots = max_slots
        self.slots: dict[tuple, _Slot] = {}
        self._lock = threading.Lock()
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _slot(self, key: tuple, bucket: Bucket, b: int, w: int, steps: int) -> _Slot | None:
        with self._lock:
            slot = self.slots.get(key)
            if slot is not None or len(self.slots) >= self.max_slots:
                return slot
            cfg, dev = self.model.config, self.device
            dtype = self.model.embed_tokens.weight.dtype
            n = b * w
            prompt = PromptKV(
                cfg.num_layers, bucket.tokens, cfg.num_kv_heads, cfg.head_dim, dtype, dev
            )
            beams = BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
            cu_prompt = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            cu_beams = torch.arange(0, n + 1, w, dtype=torch.int32, device=dev)
            state = DecodeKV(prompt, cu_prompt, bucket.max_seqlen, beams, cu_beams, w)
            slot = _Slot(
                prompt,
                beams,
                state,
                cu_prompt,
                torch.zeros(n, dtype=torch.long, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev),
                (beams.k, beams.v, beams._k_spare, beams._v_spare),
            )
            self.slots[key] = slot
            return slot

    def open(self, prompts: list[list[int]], width: int, steps: int) -> DecodeSession | None:
        """Prefill `prompts` into a decode bucket's persistent KV; None when no bucket fits or it
        is busy."""
        batch = pack([SequenceGroup([], prompts)], share_prefix=False)
        bucket, padded = self.buckets.pad(batch)
        if bucket is None:
            return None
        b = len(prompts)
        slot = self._slot((bucket, b, width, steps), bucket, b, width, steps)
        if slot is None or not slot.lock.acquire(blocking=False):
            return None
        try:
            beams = slot.beams
            beams.k, beams.v, beams._k_spare, beams._v_spare = slot.initial
            slot.state.step = 0
            dev = padded.to(self.device, non_blocking=True)
            slot.cu_prompt.copy_(dev.attn.cu_seqlens[: b + 1])
            hidden = self.model(dev.input_ids, dev.positions, dev.attn, slot.prompt)
            return DecodeSession(
                slot.state,
                dev.seq_len,
                hidden.index_select(0, dev.last_index),
                lambda i, tokens, positions: self._step(slot, i, tokens, positions),
                slot.lock.release,
            )
        except BaseException:
            slot.lock.release()
            raise

    def _step(self, slot: _Slot, step_index: int, tokens, positions) -> torch.Tensor:
        model, state = self.model, slot.state
        if not self.use_graphs:
            state.step = step_index
            return model.head(model(tokens, positions, None, state))
        graph = slot.graphs.get(step_index)
        if graph is None:
            from boundgen.compile.graphs import StaticGraph

            def fn(t, p, s=step_index):
                state.step = s
                return model.head(model(t, p, None, state))

            slot.tokens.copy_(tokens)
            slot.positions.copy_(positions)
            # NOTE: warm-up runs of the step rewrite the same KV slot with the same values
            # (idempotent)
            graph = StaticGraph(fn, [slot.tokens, slot.positions], pool=self._pool)
            slot.graphs[step_index] = graph
        return graph(tokens, positions)
