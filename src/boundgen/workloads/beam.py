"""Bounded beam search: exactly `steps` decode steps at width `beam_width`, optionally restricted to the
item-ID sequences of a `Trie` (DESIGN §4).

Semantics match HF `generate(num_beams=W, max_new_tokens=S, min_new_tokens=S, length_penalty=0,
early_stopping=False)`: scores are cumulative full-vocabulary log-probs; EOS is never a continuation
(every result has exactly S tokens). With a trie, each step keeps only each beam's trie children;
when fewer continuations than beams exist, the surplus beams die (score −inf) and are dropped from
results.

The prompt KV is computed once per prompt and shared by its beams; generated KV lives in a `BeamKV`
preallocated for (layers, B·W, S) and beams are reordered by gathering only that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boundgen.kv import BeamKV, DecodeKV, PromptKV
from boundgen.text.packing import SequenceGroup, pack
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.inputs import Limits, check_items, fit_length, to_ids
from boundgen.workloads.trie import Trie

NEG_INF = float("-inf")


@dataclass
class BeamRequest:
    prompts: list
    beam_width: int
    steps: int
    top_k: int | None = None
    trie: Trie | None = None
    truncate: bool = False


@dataclass(frozen=True)
class BeamBounds:
    max_width: int
    max_steps: int


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


class _Expander:
    """Candidate continuations of every beam: scores [B, Wc·C], tokens, and trie child ids."""

    def __init__(self, trie: Trie | None, banned: list[int], vocab: int, device) -> None:
        self.trie = trie
        self.banned = torch.tensor(
            sorted(set(t for t in banned if 0 <= t < vocab)), dtype=torch.long, device=device
        )

        # Preallocated trie buffers: one set for the first step (one row per prompt), one for the
        # rest.
        self._ws: dict[int, object] = {}

    def __call__(self, depth: int, logp: torch.Tensor, scores: torch.Tensor, node: torch.Tensor):
        b, wc, v = logp.shape
        if self.trie is None:
            if self.banned.numel():
                logp.index_fill_(2, self.banned, NEG_INF)
            cand = (scores.unsqueeze(-1) + logp).view(b, wc * v)
            return cand, None, None, v
        rows = node.shape[0]
        if rows not in self._ws:
            self._ws[rows] = self.trie.workspace(rows)
        tokens, child, valid = self.trie.children(depth, node, ws=self._ws[rows])
        lp = logp.view(b * wc, v).gather(1, tokens).masked_fill_(~valid, NEG_INF)
        cand = (scores.view(-1, 1) + lp).view(b, -1)
        return cand, tokens.reshape(b, -1), child.reshape(b, -1), tokens.shape[1]


@torch.inference_mode()
def run_beam(
    runner,
    prompts: list[list[int]],
    width: int,
    steps: int,
    trie: Trie | None = None,
    banned_tokens: list[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (tokens [B, W, S] int64, scores [B, W] float32), beams sorted best first, dead beams at −inf."""
    model, dev = runner.model, runner.device
    cfg = model.config
    if trie is not None and trie.device != dev:
        trie = trie.to(dev)
    graphs = getattr(
        runner, "decode_graphs", None
    )  # compiled "+graphs" runners replay decode steps
    session = graphs.open(prompts, width, steps) if graphs is not None else None
    try:
        return _run_beam(model, dev, cfg, prompts, width, steps, trie, banned_tokens, session)
    finally:
        if session is not None:
            session.close()


def _run_beam(model, dev, cfg, prompts, width, steps, trie, banned_tokens, session):
    """The search itself; `session` (CUDA graphs) holds persistent KV and replays decode steps."""
    b, w = len(prompts), width
    n = b * w
    if session is not None:  # persistent per-bucket KV, decode steps replayed from CUDA graphs
        batch, state = session.batch, session.state
        logp = torch.log_softmax(model.head(session.last_hidden), dim=-1)
    else:
        batch = pack([SequenceGroup([], prompts)], share_prefix=False).to(dev)
        dtype = model.embed_tokens.weight.dtype
        prompt_kv = PromptKV(
            cfg.num_layers, batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, dev
        )
        hidden = model(batch.input_ids, batch.positions, batch.attn, prompt_kv)
        logp = torch.log_softmax(model.head(hidden.index_select(0, batch.last_index)), dim=-1)
        state = DecodeKV(
            prompt_kv,
            batch.attn.cu_seqlens,
            batch.attn.max_seqlen,
            BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev),
            torch.arange(0, n + 1, w, dtype=torch.int32, device=dev),
            w,
        )
    expand = _Expander(trie, banned_tokens, logp.shape[-1], dev)
    hist = torch.zeros(b, w, steps, dtype=torch.long, device=dev)
    scores = torch.zeros(b, 1, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)  # trie root; unused without a trie
    base_pos = torch.repeat_interleave(batch.seq_len, w)
    row_base = torch.arange(b, device=dev).unsqueeze(1)
    for step in range(steps):
        if step > 0:
            tokens, positions = hist[:, :, step - 1].reshape(n), base_pos + (step - 1)
            if session is not None:
                logits = session.step(step - 1, tokens, positions)
            else:
                state.step = step - 1
                logits = model.head(model(tokens, positions, None, state))
            logp = torch.log_softmax(logits, dim=-1).view(b, w, -1)
        else:
            logp = logp.unsqueeze(1)
        wc = logp.shape[1]
        cand, cand_tokens, cand_child, c = expand(step, logp, scores, node)
        k = min(w, cand.shape[1])
        top, idx = torch.topk(cand, k, dim=1)
        if k < w:  # fewer continuations than beams: pad with dead beams
            top = torch.cat([top, top.new_full((b, w - k), NEG_INF)], 1)
            idx = torch.cat([idx, idx.new_zeros((b, w - k))], 1)
        parent = (idx // c) if wc > 1 else torch.zeros_like(idx)
        if cand_tokens is None:
            token = idx % c
        else:
            token = cand_tokens.gather(1, idx)
            node = cand_child.gather(1, idx).masked_fill_(top == NEG_INF, -1).view(n)
        if step > 0:
            global_parent = (row_base * w + parent).view(n)
            state.beams.reorder(global_parent)
            hist = hist.view(n, steps).index_select(0, global_parent).view(b, w, steps)
        hist[:, :, step] = token.masked_fill(top == NEG_INF, 0)
        scores = top
    return hist, scores


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
