"""Bounded beam search: exactly `steps` decode steps at width `width`, optionally restricted to the
item-ID sequences of a trie (DESIGN §4). The selection runs on the device with static shapes and no
host synchronisation, so a whole search can be captured as one CUDA graph (`compile/decode.py`).

Semantics match HF `generate(num_beams=W, max_new_tokens=S, min_new_tokens=S, length_penalty=0,
early_stopping=False)`: scores are cumulative full-vocabulary log-probs; banned tokens (EOS) are
never a continuation (every result has exactly S tokens). With a trie, each step keeps only each
beam's trie children; when fewer continuations than beams exist, the surplus beams die (score −inf)
and are dropped from results.

A trie made with `softmax="children"` scores each step over the beam's trie children instead of
the full vocabulary (log-probs renormalised over the allowed tokens; `boundgen.Trie`). Such a
step needs no full-vocabulary logits: the LM head runs on the step's level tokens only
(`Trie.level_tokens`, e.g. 256 semantic codes instead of 151,936 columns), from the hidden state
(`session.hidden`), and each beam's candidates are gathered from those columns.

On CUDA with `trie_select` on (the default; `BOUNDGEN_TRIE_SELECT=0` turns it off), a trie
step's selection — children, their scores, the best W, parents, history — is one Triton kernel
instead of ~20 ATen kernels (`trie_select.py`); over the vocabulary the kept scores are the same
bits, over a beam's children the normaliser is summed in another order (float32 rounding apart).

`search(session, ...)` drives a decode session (`compile/decode.py`): the prompts are prefilled
once and shared by their beams; each step feeds one token per beam and reorders the beams' own KV
by gathering it.
"""

from __future__ import annotations

from typing import Any

import torch

from boundgen import trie_select
from boundgen.logsumexp import row_logsumexp

NEG_INF = float("-inf")
# Without a trie the top W of a prompt's W·V candidates are found in two stages: the top W of each
# beam's vocabulary cut into chunks of this size, then the top W of the survivors. One top-k over
# 151,936 columns cost 109 µs a call on the H200 (issue 15); chunked rows run on many more blocks.
TOPK_CHUNK = 4096
# With a `softmax="children"` trie a step's LM head runs on its level's distinct tokens (their head
# rows gathered, then one GEMM) up to this many; a level with more runs the full head (the gathered
# copy of the rows would cost more than the full GEMM's weight read it saves, past about V/3).
LEVEL_HEAD_MAX = 16384


class Expander:
    """Candidate continuations of every beam: scores [B, Wc·C], their tokens and trie child ids.

    `trie` is any object with `children(depth, node, ws=...) -> (tokens, child, valid)` and
    `workspace(rows)` (`boundgen.Trie`); its buffers are preallocated per row count. A trie whose
    `softmax` is "children" also needs `candidates` (+ level columns), `level_tokens(depth)` and
    `level_sizes`.
    """

    def __init__(self, trie: Any, banned: torch.Tensor, workspaces: dict | None = None) -> None:
        self.trie = trie
        self.banned = banned
        self._ws: dict[int, object] = {} if workspaces is None else workspaces

    def _workspace(self, rows: int):
        if rows not in self._ws:
            self._ws[rows] = self.trie.workspace(rows)
        return self._ws[rows]

    def children(
        self, depth: int, rows: torch.Tensor, scores: torch.Tensor, node: torch.Tensor, head
    ):
        """Candidates scored over each beam's trie children alone (`softmax="children"`): the LM
        head on the level's tokens, not the vocabulary. rows [B·Wc, H] hidden states."""
        tokens, child, valid, cols = self.trie.candidates(
            depth, node, ws=self._workspace(node.shape[0])
        )
        z, level = children_logits(self.trie, depth, rows, head)
        z = z.gather(1, cols if level else tokens).float()
        z.masked_fill_(~valid, NEG_INF)
        # one kernel (a logsumexp is seven); a dead beam's row (no valid child) is NaN: masked
        lp = torch.log_softmax(z, 1).masked_fill_(~valid, NEG_INF)
        b = scores.shape[0]
        cand = (scores.view(-1, 1) + lp).view(b, -1)
        return cand, tokens.reshape(b, -1), child.reshape(b, -1), tokens.shape[1]

    def __call__(self, depth: int, logits: torch.Tensor, scores: torch.Tensor, node: torch.Tensor):
        """Candidates scored over the full vocabulary. logits [B·Wc, V] in any float dtype (the
        model's: read as float32 in place, no float32 copy of the logits), scores [B, Wc]."""
        b, wc = scores.shape
        v = logits.shape[1]
        if self.trie is None:
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32).view(b, wc, v)
            if self.banned.numel():
                logp.index_fill_(2, self.banned, NEG_INF)
            cand = (scores.unsqueeze(-1) + logp).view(b, wc * v)
            return cand, None, None, v
        tokens, child, valid = self.trie.children(depth, node, ws=self._workspace(node.shape[0]))
        # the children's log-probs alone: no log-prob of every column written and read back
        lse = row_logsumexp(logits).unsqueeze(1)
        lp = logits.gather(1, tokens).float().sub_(lse).masked_fill_(~valid, NEG_INF)
        cand = (scores.view(-1, 1) + lp).view(b, -1)
        return cand, tokens.reshape(b, -1), child.reshape(b, -1), tokens.shape[1]


def children_logits(trie: Any, depth: int, rows: torch.Tensor, head) -> tuple[torch.Tensor, bool]:
    """The logits a children-scored step reads from hidden `rows`: over the level's tokens (and
    True) up to `LEVEL_HEAD_MAX` of them, else over the vocabulary (and False)."""
    if trie.level_sizes[depth] <= LEVEL_HEAD_MAX:
        return head(rows, trie.level_tokens(depth)), True
    return head(rows), False


def top_candidates(cand: torch.Tensor, k: int, per_beam: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` of each row of `cand` [B, Wc·C] (best first), as (values, column indices).

    Rows made of Wc blocks of `per_beam` columns (a beam's vocabulary) are reduced in two stages
    when the blocks are long: the top k of every `TOPK_CHUNK`-wide chunk, then the top k of those.
    Exact: the overall top k is among the chunks' top k."""
    b, cols = cand.shape
    if per_beam <= TOPK_CHUNK or k > TOPK_CHUNK:
        return torch.topk(cand, k, dim=1)
    pad = -cols % TOPK_CHUNK
    if pad:  # whole chunks; the padding can never be chosen over a real column
        cand = torch.nn.functional.pad(cand, (0, pad), value=NEG_INF)
    n_chunks = (cols + pad) // TOPK_CHUNK
    vals, idx = torch.topk(cand.view(b, n_chunks, TOPK_CHUNK), k, dim=2)  # [B, n_chunks, k]
    base = torch.arange(n_chunks, device=cand.device).mul_(TOPK_CHUNK).view(1, -1, 1)
    top, pos = torch.topk(vals.view(b, -1), k, dim=1)
    return top, (idx + base).view(b, -1).gather(1, pos)


def banned_tensor(banned: Any, vocab: int, device) -> torch.Tensor:
    """The banned token ids inside the vocabulary, as an int64 tensor on `device` (made before a
    CUDA-graph capture: a host-to-device copy cannot be captured)."""
    ids = sorted({int(t) for t in banned if 0 <= int(t) < vocab})
    return torch.tensor(ids, dtype=torch.long, device=device)


def search(
    session: Any,
    head: Any,
    width: int,
    steps: int,
    trie: Any = None,
    banned: torch.Tensor | list[int] | tuple[int, ...] = (),
    workspaces: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (tokens [B, W, S] int64, scores [B, W] float32), beams sorted best first, dead beams at
    −inf. `session`: `last_hidden` [B, H], `prompt_lengths` [B], `step(i, tokens, positions)` →
    logits [B·W, V] (with a `softmax="children"` trie: `hidden(i, tokens, positions)` → final
    hidden states [B·W, H] instead), `reorder(parent)`; `head(rows, columns=None)` → logits
    (any float dtype: the model's, `DecoderModel.logits`) of the full vocabulary or of
    `columns`; `banned`: token ids never continued (a tensor from `banned_tensor` inside a
    CUDA-graph capture); `workspaces`: the trie's buffers per row count, kept across searches
    (a graph's buffers)."""
    last = session.last_hidden
    dev = last.device
    b, w = last.shape[0], width
    n = b * w
    children = trie is not None and getattr(trie, "softmax", "vocab") == "children"
    logits = None if children else head(last)
    if not isinstance(banned, torch.Tensor):  # unused with a trie
        banned = banned_tensor(banned, logits.shape[-1] if logits is not None else 0, dev)
    expand = Expander(trie, banned, workspaces)
    hist = torch.zeros(b, w, steps, dtype=torch.long, device=dev)
    scores = torch.zeros(b, 1, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)  # trie root; unused without a trie
    base_pos = torch.repeat_interleave(session.prompt_lengths, w)
    for step in range(steps):
        if step > 0:
            tokens, positions = hist[:, :, step - 1].reshape(n), base_pos + (step - 1)
        one_kernel = trie is not None and _one_kernel(trie, step, w, dev)
        if children:
            rows = session.hidden(step - 1, tokens, positions) if step > 0 else last
            if one_kernel:  # the head as `Expander.children` runs it, the rest in one kernel
                z, level = children_logits(trie, step, rows, head)
                columns = trie.level_columns(step) if level else None
                picked = _kernel_step(trie, step, z, None, scores, node, hist, columns)
            else:
                picked = _pick(*expand.children(step, rows, scores, node, head), hist, step)
        else:
            if step > 0:
                logits = session.step(step - 1, tokens, positions)
            if one_kernel:
                lse = row_logsumexp(logits)
                picked = _kernel_step(trie, step, logits, lse, scores, node, hist)
            else:
                picked = _pick(*expand(step, logits, scores, node), hist, step)
        scores, next_node, global_parent, hist = picked
        if next_node is not None:
            node = next_node
        if 0 < step < steps - 1:  # after the last step no decode step reads the beams' KV
            session.reorder(global_parent)
    return hist, scores


def _one_kernel(trie: Any, step: int, width: int, device: torch.device) -> bool:
    """Whether this trie step's selection runs as one kernel (`trie_select`)."""
    beams = width if step > 0 else 1  # step 0 scores each prompt's one row
    return hasattr(trie, "level_csr") and trie_select.chosen(device, beams, trie.max_children[step])


def _kernel_step(trie, step, logits, lse, scores, node, hist, columns=None):
    """A trie step's selection in one kernel (`trie_select.select`), its outputs as `_pick`'s."""
    ptr, child_token = trie.level_csr(step)
    c = trie.max_children[step]
    return trie_select.select(logits, lse, scores, node, ptr, child_token, c, hist, step, columns)


def _pick(cand, cand_tokens, cand_child, c: int, hist: torch.Tensor, step: int):
    """The best W of each prompt's candidates `cand` [B, Wc·C] (each beam's `c` columns) →
    (scores [B, W], child nodes [B·W] (-1: dead; None without a trie), global parents [B·W]
    (None at step 0), hist [B, W, S] with the parents' rows and this step's tokens)."""
    b, w, steps = hist.shape
    n = b * w
    k = min(w, cand.shape[1])
    top, idx = top_candidates(cand, k, c)
    if k < w:  # fewer continuations than beams: pad with dead beams
        top = torch.cat([top, top.new_full((b, w - k), NEG_INF)], 1)
        idx = torch.cat([idx, idx.new_zeros((b, w - k))], 1)
    parent = (idx // c) if step > 0 else torch.zeros_like(idx)
    node = None
    if cand_tokens is None:
        token = idx % c
    else:
        token = cand_tokens.gather(1, idx)
        node = cand_child.gather(1, idx).masked_fill_(top == NEG_INF, -1).view(n)
    global_parent = None  # step 0: the beams are new, nothing to reorder
    if step > 0:
        first = torch.arange(0, n, w, device=hist.device).unsqueeze(1)  # each prompt's beam 0
        global_parent = (first + parent).view(n)
        hist = hist.view(n, steps).index_select(0, global_parent).view(b, w, steps)
    hist[:, :, step] = token.masked_fill(top == NEG_INF, 0)
    return top, node, global_parent, hist
