"""Bounded beam search: exactly `steps` decode steps at width `beam_width`, optionally restricted to
the item-ID sequences of a `Trie` (DESIGN §4).

Semantics match HF `generate(num_beams=W, max_new_tokens=S, min_new_tokens=S, length_penalty=0,
early_stopping=False)`: scores are cumulative full-vocabulary log-probs; EOS is never a continuation
(every result has exactly S tokens). With a trie, each step keeps only each beam's trie children;
when fewer continuations than beams exist, the surplus beams die (score −inf) and are dropped from
results.

The prompt KV is computed once per prompt and shared by its beams (`ModelRunner.decode`); generated
KV is preallocated for (layers, B·W, S) and beams are reordered by gathering only that buffer.
"""

from __future__ import annotations

import torch

from boundgen.runner import ModelRunner
from boundgen.workloads.trie import Trie

NEG_INF = float("-inf")


class _Expander:
    """Candidate continuations of every beam: scores [B, Wc·C], tokens, and trie child ids."""

    def __init__(self, trie: Trie | None, banned: list[int], vocab: int, device) -> None:
        self.trie = trie
        banned = sorted({t for t in banned if 0 <= t < vocab})
        self.banned = torch.tensor(banned, dtype=torch.long, device=device)
        # Preallocated trie buffers, per row count (one row per prompt first, then one per beam).
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
    runner: ModelRunner,
    prompts: list[list[int]],
    width: int,
    steps: int,
    trie: Trie | None = None,
    banned_tokens: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (tokens [B, W, S] int64, scores [B, W] float32), beams sorted best first, dead beams at
    −inf."""
    dev = runner.device
    if trie is not None and trie.device != dev:
        trie = trie.to(dev)
    b, w = len(prompts), width
    n = b * w
    session = runner.decode(prompts, width, steps)
    try:
        logp = torch.log_softmax(runner.head(session.last_hidden), dim=-1)
        expand = _Expander(trie, list(banned_tokens), logp.shape[-1], dev)
        hist = torch.zeros(b, w, steps, dtype=torch.long, device=dev)
        scores = torch.zeros(b, 1, device=dev)
        node = torch.zeros(b, dtype=torch.long, device=dev)  # trie root; unused without a trie
        base_pos = torch.repeat_interleave(session.prompt_lengths, w)
        row_base = torch.arange(b, device=dev).unsqueeze(1)
        for step in range(steps):
            if step > 0:
                tokens, positions = hist[:, :, step - 1].reshape(n), base_pos + (step - 1)
                logits = session.step(step - 1, tokens, positions)
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
                session.reorder(global_parent)
                hist = hist.view(n, steps).index_select(0, global_parent).view(b, w, steps)
            hist[:, :, step] = token.masked_fill(top == NEG_INF, 0)
            scores = top
        return hist, scores
    finally:
        session.close()


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
