"""Prefill and decode attention built from backend calls merged by their log-sum-exps (DESIGN §3).

Merging two partial attentions over disjoint key sets a and b:
    m = max(la, lb);  o = (e^(la-m)·oa + e^(lb-m)·ob) / (e^(la-m) + e^(lb-m))
"""

from __future__ import annotations

import math

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
