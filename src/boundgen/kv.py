"""Request-scoped KV state for bounded beam search (DESIGN §3–4).

The prompt KV is captured once at prefill and shared by every beam of that prompt. Each beam's
generated KV lives in a buffer preallocated for (layers, beams, steps); beams are reordered by
gathering that small buffer (double-buffered, so the step loop allocates no KV), never the prompt
KV.
"""

from __future__ import annotations

import torch

from boundgen.attention import cascade
from boundgen.attention.backends import AttentionBackend
from boundgen.attention.cascade import grouped_rows_attention, merge_partial, own_keys_attention


class PromptKV:
    """K/V of every packed prompt token, per layer: k, v [L, T, Hkv, D] (post-RoPE, post-norm)."""

    def __init__(self, num_layers, num_tokens, kv_heads, head_dim, dtype, device) -> None:
        shape = (num_layers, num_tokens, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].copy_(k)
        self.v[layer].copy_(v)


class BeamKV:
    """Generated-token K/V of every live beam, side by side: kv [L, N, S, 2, Hkv, D] (`k`, `v`
    [L, N, S, Hkv, D]: its two halves, views), allocated once per request. Side by side, a decode
    step stores a beam's k and v with one write (in a compiled layer one kernel, where separate
    buffers took two) and a reorder gathers both with one `index_select`."""

    def __init__(self, num_layers, num_beams, steps, kv_heads, head_dim, dtype, device) -> None:
        shape = (num_layers, num_beams, max(steps, 1), 2, kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._spare = torch.empty_like(self.kv)

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, :, :, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, :, 1]

    def reorder(self, parent: torch.Tensor) -> None:
        """Beam n continues beam parent[n]: gather into the spare buffer and swap."""
        torch.index_select(self.kv, 1, parent, out=self._spare)
        self.kv, self._spare = self._spare, self.kv


class DecodeKV:
    """Everything a decode step's attention needs. Beams of prompt b are rows
    cu_beams[b]:cu_beams[b+1]; `group` query heads share a KV head (Hq / Hkv), and the prompt
    attention takes them as rows of their KV head: `cu_rows`, `max_rows`
    (`cascade.grouped_rows_attention`)."""

    def __init__(
        self,
        prompt: PromptKV,
        cu_prompt: torch.Tensor,
        max_prompt: int,
        beams: BeamKV,
        cu_beams: torch.Tensor,
        max_beams: int,
        group: int = 1,
    ) -> None:
        self.prompt, self.cu_prompt, self.max_prompt = prompt, cu_prompt, max_prompt
        self.beams, self.cu_beams, self.max_beams = beams, cu_beams, max_beams
        self.group = group if cascade.GQA_ROWS else 1
        # made once here, not per layer: inside a captured search it would be a kernel a layer
        self.cu_rows = cu_beams * self.group if self.group > 1 else cu_beams
        self.max_rows = max_beams * self.group
        self.step = 0  # slot of the token fed in this decode step


def decode_attention(
    q, k, v, layer: int, state: DecodeKV, backend: AttentionBackend
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] for one new token per beam → [N, Hq, D]."""
    s = state.step
    state.beams.kv[layer, :, s] = torch.stack((k, v), 1)
    shared, shared_lse = grouped_rows_attention(
        q,
        state.prompt.k[layer],
        state.prompt.v[layer],
        state.cu_rows,
        state.cu_prompt,
        state.max_rows,
        state.max_prompt,
        state.group,
        backend,
    )
    own, own_lse = own_keys_attention(
        q, state.beams.k[layer, :, : s + 1], state.beams.v[layer, :, : s + 1]
    )
    return merge_partial(shared, shared_lse, own, own_lse)
