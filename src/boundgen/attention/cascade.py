"""Prefill and decode attention built from backend calls merged by their log-sum-exps (DESIGN §3).

Merging two partial attentions over disjoint key sets a and b:
    m = max(la, lb);  o = (e^(la-m)·oa + e^(lb-m)·ob) / (e^(la-m) + e^(lb-m))
"""

from __future__ import annotations

import math
import os

import torch

from boundgen.attention.backends import AttentionBackend
from boundgen.attention.metadata import AttnInputs


def merge_partial(oa, lsea, ob, lseb) -> torch.Tensor:
    """oa, ob: [T, H, D]; lsea, lseb: [T, H] float32 → merged output in oa's dtype."""
    m = torch.maximum(lsea, lseb)
    wa = torch.exp(lsea - m)
    wb = torch.exp(lseb - m)
    out = (oa.float() * wa.unsqueeze(-1) + ob.float() * wb.unsqueeze(-1)) / (wa + wb).unsqueeze(-1)
    return out.to(oa.dtype)


# A decode step's queries over their prompt's KV with the query heads that share a KV head as rows
# of the segment (`grouped_rows_attention`); "0" feeds flash the beams alone — an A/B's switch.
GQA_ROWS = os.environ.get("BOUNDGEN_BEAM_GQA_ROWS", "1") != "0"


def by_kv_head(q: torch.Tensor, group: int) -> torch.Tensor:
    """q [T, Hq, D] as [T, G, Hkv, D] (a view; G = `group` = Hq / Hkv): query head h reads KV head
    h // G (HF's repeat_kv), so head j·G + g sits at [:, g, j]."""
    t, hq, d = q.shape
    return q.view(t, hq // group, group, d).transpose(1, 2)


def grouped_rows_attention(q, k, v, cu_rows, cu_k, max_rows: int, max_k: int, group: int, backend):
    """Non-causal varlen attention of q [N, Hq, D] over k, v [T, Hkv, D] (segments `cu_k`), the
    `group` = Hq / Hkv query heads that read one KV head taken as `group` rows of that head:
    segment b's rows are `cu_rows` = its query rows' offsets × `group`, `max_rows` the longest.
    q may come grouped already, [N, G, Hkv, D] (`by_kv_head`, as `Attention.heads(grouped=True)`
    writes it: then no copy of it is made here). → out [N, Hq, D], lse [N, Hq] float32. `group`
    1: the queries as they are.

    Why: a beam-search decode step has W query rows per prompt (W4: 16), a few prompt keys (128)
    and GQA heads 14 / 2. Flash attention's grid is (row blocks of 128, segments, query heads):
    per prompt 14 programs, each with 16 real rows of its 128 and each loading the prompt's K/V
    again. As rows of their KV head (16 × 7 = 112) the same work is 2 programs per prompt, each
    K/V tile loaded once for 7 heads — fewer, fuller programs (a b32 search: 448 → 64)."""
    if q.dim() == 3 and group == 1:
        return backend.varlen(q, k, v, cu_rows, cu_k, max_rows, max_k, False)
    out, lse = grouped_rows_partial(q, k, v, cu_rows, cu_k, max_rows, max_k, group, backend)
    n, _, hkv, d = out.shape
    hq = group * hkv
    return out.transpose(1, 2).reshape(n, hq, d), lse.transpose(1, 2).reshape(n, hq)


def grouped_rows_partial(q, k, v, cu_rows, cu_k, max_rows: int, max_k: int, group: int, backend):
    """`grouped_rows_attention` before its outputs go back to head order: → out [N, G, Hkv, D],
    lse [N, G, Hkv] float32 (query head j·G + g at [:, g, j]; views of the backend's outputs), for
    a consumer that reads them grouped (`own_slots.own_slots_merge`). `group` 1: G = 1 and the
    heads are q's."""
    if q.dim() == 3:  # row (n, g) of KV head j is query head j·group + g of row n
        q = by_kv_head(q, group)
    n, _, hkv, d = q.shape
    rows = q.reshape(n * group, hkv, d)
    out, lse = backend.varlen(rows, k, v, cu_rows, cu_k, max_rows, max_k, False)
    return out.view(n, group, hkv, d), lse.view(n, group, hkv)


def prefill_attention(q, k, v, attn: AttnInputs, backend: AttentionBackend) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] → [T, Hq, D]. Causal per segment, plus shared-prefix
    groups. A backend with a `prefill` method (`segments`) may take the whole batch in one call."""
    prefill = getattr(backend, "prefill", None)
    if prefill is not None:
        out = prefill(q, k, v, attn)
        if out is not None:
            return out
    out, lse = backend.varlen(
        q, k, v, attn.cu_seqlens, attn.cu_seqlens, attn.max_seqlen, attn.max_seqlen, True
    )
    if not attn.has_shared_prefix:
        return out
    p, s = attn.num_prefix_tokens, attn.num_prefix_tokens + attn.num_shared_tokens
    cross, cross_lse = backend.varlen(
        q[p:s],
        k[:p],
        v[:p],
        attn.cu_group_q,
        attn.cu_prefix,
        attn.max_group_q,
        attn.max_prefix,
        False,
    )
    merged = merge_partial(out[p:s], lse[p:s], cross, cross_lse)
    return torch.cat([out[:p], merged, out[s:]], dim=0)


def own_keys_attention(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends to its own few keys. q: [N, Hq, D]; k, v: [N, L, Hkv, D] →
    ([N,Hq,D], [N,Hq])."""
    _n, hq, d = q.shape
    rep = hq // k.shape[2]
    kf = k.float().repeat_interleave(rep, dim=2)  # [N, L, Hq, D]
    vf = v.float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("nhd,nlhd->nhl", q.float(), kf) * (1.0 / math.sqrt(d))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhl,nlhd->nhd", torch.exp(scores - lse.unsqueeze(-1)), vf)
    return out.to(q.dtype), lse
