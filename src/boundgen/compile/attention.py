"""`masked`: an export-friendly attention backend for compiled buckets on any device.

The `reference` backend loops over segments with `.tolist()`, which `torch.export` cannot trace.
This backend computes the same thing with tensor ops only: every query attends to every key of the
batch under a mask built from `cu_q`/`cu_k` (same segment, and bottom-right causal when asked), in
float32, with the same conventions as `reference` (queries without keys get out = 0, lse = −inf). It
is O(Tq·Tk) in memory, so it is meant for CPU buckets and small GPU buckets; large CUDA buckets use
`varlen` (a custom op that exports as is).
"""

from __future__ import annotations

import math

import torch


def _segments(
    cu: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows 0..n-1 of a packed span: (segment id, offset in segment, segment length, valid)."""
    rows = torch.arange(n, device=cu.device, dtype=cu.dtype)
    # NOTE: zero-length segments repeat a boundary; right=True picks the last segment starting at a
    # row, which is the non-empty one. Rows at or past cu[-1] belong to no segment (valid = False).
    seg = torch.searchsorted(cu, rows, right=True) - 1
    nseg = cu.shape[0] - 1
    seg = seg.clamp(0, nseg - 1)
    start = cu.index_select(0, seg)
    length = cu.index_select(0, seg + 1) - start
    valid = (rows >= cu[0]) & (rows < cu[-1])
    return seg, rows - start, length, valid


class MaskedBackend:
    """Dense masked attention; exact against `reference` in float32 (summation order aside)."""

    name = "masked"

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        tq, hq, d = q.shape
        tk, hkv = k.shape[0], k.shape[1]
        seg_q, off_q, len_q, ok_q = _segments(cu_q, tq)
        seg_k, off_k, _, ok_k = _segments(cu_k, tk)
        mask = (seg_q[:, None] == seg_k[None, :]) & ok_q[:, None] & ok_k[None, :]
        if causal:
            # key j of the segment is visible to query i when j <= i + Lk - Lq (bottom-right
            # aligned)
            lk_q = cu_k.index_select(0, seg_q + 1) - cu_k.index_select(0, seg_q)
            mask = mask & (off_k[None, :] <= (off_q + lk_q - len_q)[:, None])
        rep = hq // hkv
        qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
        kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, Tk, D]
        vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [Hq, Tq, Tk]
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.matmul(probs, vf)  # [Hq, Tq, D]
        return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1).contiguous()


class FlashBackend:
    """CUDA flash attention through the aten op itself (`aten._flash_attention_forward`).

    Same kernel and conventions as the `varlen` backend (`varlen_attn` is a Python custom op around
    this op), but an aten op has an AOTInductor C shim, so the exported graph calls it from C++
    directly.
    """

    name = "flash"

    def __init__(self) -> None:
        self._heads_first: bool | None = None
        self._window = True

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        kw = {"scale": None}
        if self._window:
            kw.update(window_size_left=-1, window_size_right=0 if causal else -1)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, **kw
        )

    def prepare(self, device) -> None:
        """Probe (eagerly, before tracing) the op's keyword support and its LSE layout on this
        torch."""
        if self._heads_first is not None:
            return
        q = torch.randn(3, 2, 64, device=device, dtype=torch.bfloat16)
        cu = torch.tensor([0, 3], device=device, dtype=torch.int32)
        try:
            res = self._call(q, q, q, cu, cu, 3, 3, True)
        except (TypeError, RuntimeError):
            self._window = False  # older signature: is_causal alone is bottom-right causal
            res = self._call(q, q, q, cu, cu, 3, 3, True)
        if res[1].dim() != 2:
            raise RuntimeError(
                f"unexpected flash LSE shape {tuple(res[1].shape)} on torch {torch.__version__}"
            )
        self._heads_first = tuple(res[1].shape) == (2, 3)

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        if self._heads_first is None:
            self.prepare(q.device)
        out, lse = self._call(q, k, v, cu_q, cu_k, max_q, max_k, causal)[:2]
        if self._heads_first:
            lse = lse.transpose(0, 1)
        return out, lse.float()
