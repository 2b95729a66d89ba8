"""`select`: one trie step of a beam search in one Triton kernel.

A trie step of `search.search` takes its beams' children from the trie's CSR arrays, gathers their
logits, turns them into log-probs (less the row's log-sum-exp over the vocabulary, HF's scores; or
normalised over the beam's children, `softmax="children"`), adds the beam's score, keeps the best W
of a prompt's Wc·C candidates, and turns them into parents, tokens, child nodes and the reordered
token history: about twenty small ATen kernels a step (the trie's `children` 4–10, the gathers and
masks ~6, `topk`, ~8 for the picks and the history), 80 launches of a W4 search's ~1,700 — each a
few µs of GPU time and a ~1.6 µs gap inside the whole-search graph (H200 profiles, BENCHMARKS.md).

Here one program owns one prompt (its Wc beams' candidates, Wc·C ≤ `MAX_CANDIDATES`): it loads
each beam's node, the node's child range, the children's tokens (or their columns among the level's
tokens, when the head ran on those alone) and logits, scores them, and picks the best W by W rounds
of a max-reduction over a sort key that holds the score and the candidate's index (the smallest
index wins a tie, so every pick is one candidate and picks are made in order). It writes the new
scores, child nodes (-1: a dead beam), the beams' global parents (for the KV reorder) and the
history with the parents' rows gathered and this step's tokens in their column. Over the
vocabulary, the row log-sum-exp stays its own kernel (`logsumexp.row_logsumexp`: a few beams'
151,936 columns read by hundreds of programs, not by one a prompt).

Numerics: over the vocabulary score + (float32(logit) − lse), as `search.Expander`, so the kept
scores are the same bits; over the children (z − max) − log Σ exp(z − max), as `log_softmax`, but
summed in another order with Triton's exp and log (float32 rounding apart). Among equal scores the
ATen path's `topk` may keep another of the tied candidates.

On by default since its W4 A/B (an H100, 2026-12-05, BENCHMARKS.md twenty-seventh session):
compiled whole-search graphs ran 89–97 fewer launches and 0.21–0.33 ms less GPU time a search,
3.5–8.7 % faster at batch 1 and 8 over each beam's children and at batch 8 over the vocabulary,
even (+0.6 %) at batch 1 over the vocabulary. `BOUNDGEN_TRIE_SELECT=0` turns it off; `enabled(...)`
for an A/B in one process. Searches without a trie keep the ATen path.
"""

from __future__ import annotations

import contextlib
import os

import torch

from boundgen.settings import switched

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

ENABLED = os.environ.get("BOUNDGEN_TRIE_SELECT", "1") == "1"
# A prompt's candidates (beams × children, each padded to a power of two) one program holds in
# registers: int64 keys, 16 warps at the largest (32 a thread). Wider steps take the ATen path.
MAX_CANDIDATES = 16384


def chosen(device: torch.device, beams: int, children: int) -> bool:
    """Whether a step scoring `beams` beams a prompt over `children` candidates each takes the
    kernel."""
    if not (ENABLED and AVAILABLE and device.type == "cuda"):
        return False
    return _padded(beams) * _padded(children) <= MAX_CANDIDATES


def enabled(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """The kernel on (or off) while the block runs: an A/B of searches captured in one process."""
    return switched(globals(), "ENABLED", on)


def _padded(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if AVAILABLE:

    @triton.jit
    def _select_kernel(
        logits_ptr,
        stride_logits,
        lse_ptr,
        scores_ptr,
        node_ptr,
        child_ptr,
        child_token,
        column_ptr,
        hist_in,
        hist_out,
        top_out,
        node_out,
        parent_out,
        wc,
        c,
        w,
        steps,
        step,
        WC: tl.constexpr,
        C: tl.constexpr,
        W: tl.constexpr,
        S: tl.constexpr,
        COLUMNS: tl.constexpr,
        CHILDREN: tl.constexpr,
    ):
        b = tl.program_id(0)
        beams = tl.arange(0, WC)
        slots = tl.arange(0, C)
        beam_ok = beams < wc
        row = b * wc + beams
        node = tl.load(node_ptr + row, mask=beam_ok, other=-1)
        alive = node >= 0
        start = tl.load(child_ptr + node, mask=alive, other=0)
        end = tl.load(child_ptr + node + 1, mask=alive, other=0)
        score = tl.load(scores_ptr + row, mask=beam_ok, other=0.0)

        slot = start[:, None] + slots[None, :]  # the children's node ids at depth + 1
        real = beam_ok[:, None] & (slots[None, :] < c)  # the unfused path's [Wc, C] candidates
        valid = real & (slot < end[:, None])  # a dead beam's range is empty
        if COLUMNS:  # logits over the level's tokens: each child's column there
            column = tl.load(column_ptr + slot, mask=valid, other=0)
        else:
            column = tl.load(child_token + slot, mask=valid, other=0)
        rows = row.to(tl.int64)[:, None] * stride_logits
        z = tl.load(logits_ptr + rows + column, mask=valid, other=0.0).to(tl.float32)
        if CHILDREN:  # log-probs over each beam's children, as `log_softmax`: (z − max) − log Σ
            top = tl.max(tl.where(valid, z, float("-inf")), 1)
            shifted = z - top[:, None]
            total = tl.sum(tl.where(valid, tl.exp(shifted), 0.0), 1)
            total = tl.where(total == 0.0, 1.0, total)  # a dead beam's (no log of 0: unused)
            logp = shifted - tl.log(total)[:, None]
        else:  # over the vocabulary: the logit less the row's log-sum-exp
            lse = tl.load(lse_ptr + row, mask=beam_ok, other=0.0)
            logp = z - lse[:, None]
        cand = tl.where(valid, score[:, None] + logp, float("-inf"))

        # the sort key: a float's bits ordered as signed ints (negatives' magnitude bits flipped),
        # over the index counted down, so one max-reduction finds the best and, among ties, the
        # first candidate
        bits = cand.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        index = beams[:, None] * c + slots[None, :]
        key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)
        none = -9223372036854775807 - 1
        key = tl.reshape(tl.where(real, key, none), [WC * C])

        picks = tl.arange(0, W)  # the w beams kept (W: w padded)
        parents = tl.zeros([W], dtype=tl.int64)
        tokens = tl.zeros([W], dtype=tl.int64)
        for i in range(w):
            best = tl.max(key, 0)
            found = best != none
            key = tl.where(key == best, none, key)
            idx = 0x7FFFFFFF - (best & 0x7FFFFFFF)
            high = (best >> 32).to(tl.int32)
            value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
            value = tl.where(found, value, float("-inf"))
            live = value != float("-inf")
            parent = tl.where(found, idx // c, 0)
            pnode = tl.load(node_ptr + b * wc + parent, mask=live, other=0)
            child = tl.load(child_ptr + pnode, mask=live, other=0) + idx % c
            tok = tl.load(child_token + child, mask=live, other=0).to(tl.int64)
            tl.store(top_out + b * w + i, value)
            tl.store(node_out + b * w + i, tl.where(live, child, -1))
            tl.store(parent_out + b * w + i, b * wc + parent)
            parents = tl.where(picks == i, parent, parents)
            tokens = tl.where(picks == i, tok, tokens)

        # the history: each kept beam's parent row (at step 0 its own: the beams are new), this
        # step's token in column `step`
        cols = tl.arange(0, S)
        keep = (picks < w)[:, None] & (cols[None, :] < steps)
        from_row = tl.where(step > 0, parents, picks)
        src = hist_in + (b * w + from_row)[:, None] * steps + cols[None, :]
        old = tl.load(src, mask=keep & (cols[None, :] != step), other=0)
        new = tl.where(cols[None, :] == step, tokens[:, None], old)
        tl.store(hist_out + (b * w + picks)[:, None] * steps + cols[None, :], new, mask=keep)


def select(
    logits: torch.Tensor,
    lse: torch.Tensor | None,
    scores: torch.Tensor,
    node: torch.Tensor,
    child_ptr: torch.Tensor,
    child_token: torch.Tensor,
    children: int,
    hist: torch.Tensor,
    step: int,
    columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One trie step for B prompts of Wc beams kept to W = hist.shape[1].

    logits [B·Wc, V] (any float dtype, columns contiguous); lse [B·Wc] float32, their rows'
    log-sum-exp (HF's scores over the vocabulary), or None: scores normalised over each beam's
    children (`softmax="children"`); scores [B, Wc] float32, node [B·Wc] int64 (-1: dead), the
    depth's CSR arrays (`Trie.level_csr`) and `children`, the most a node there has; hist
    [B, W, S] int64 (the tokens so far; Wc = 1 at step 0); `columns`: each child's column in
    `logits` when they are over the level's tokens (`Trie.level_columns`), else its token's.
    → (scores [B, W] best first, −inf for dead beams; node [B·W] (-1 dead); parent [B·W], the
    global row of each beam's parent for `BeamKV.reorder`; hist [B, W, S], a new tensor)."""
    b, wc = scores.shape
    w, steps = hist.shape[1], hist.shape[2]
    c = int(children)
    if logits.stride(1) != 1:
        raise ValueError("select takes logits rows of contiguous columns")
    if wc > w:
        raise ValueError(f"{wc} beams in, {w} kept: a step keeps at least as many as it scores")
    top = torch.empty(b, w, dtype=torch.float32, device=scores.device)
    node_out = torch.empty(b * w, dtype=torch.int64, device=scores.device)
    parent = torch.empty_like(node_out)
    hist_out = torch.empty_like(hist)
    wcp = _padded(wc)  # at step 0 one beam a prompt: its children alone, not W rows of them
    cp = _padded(max(c, 1))
    warps = 4 if wcp * cp <= 1024 else 8 if wcp * cp <= 4096 else 16
    _select_kernel[(b,)](
        logits,
        logits.stride(0),
        top if lse is None else lse,  # unread without lse
        scores.contiguous(),
        node,
        child_ptr,
        child_token,
        child_token if columns is None else columns,  # unread without columns
        hist.contiguous(),
        hist_out,
        top,
        node_out,
        parent,
        wc,
        c,
        w,
        steps,
        step,
        WC=wcp,
        C=cp,
        W=_padded(w),
        S=_padded(steps),
        COLUMNS=columns is not None,
        CHILDREN=lse is None,
        num_warps=warps,
    )
    return top, node_out, parent, hist_out
