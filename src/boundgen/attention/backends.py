"""Attention backends behind one interface, found through a small registry.

A backend computes variable-length attention over packed segments and returns the output together
with the log-sum-exp of the scores, so partial results can be merged (cascade, decode).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Variable-length attention.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] (Hq a multiple of Hkv); cu_q, cu_k: int32 [B+1] segment
    boundaries.
    `causal` aligns bottom-right: query i of a segment with Lq queries and Lk keys sees keys 0..i +
    Lk - Lq. Returns out [Tq, Hq, D] in q's dtype and lse [Tq, Hq] float32 (−inf for no keys). Safe
    to call from any thread; holds no per-call state.
    """

    name: str

    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register(name: str):
    def wrap(factory: Callable[[], AttentionBackend]):
        _BACKENDS[name] = factory
        return factory

    return wrap


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


# What `auto` picks on CUDA in fp16/bf16. "segments": the Triton `segments` kernel for every
# prefill (one call sized to the tokens instead of flash's causal call + cross call + merge + cat
# for shared-prefix batches; tiles that follow the segments for plain ones); decode stays on
# flash. "segments-cascade": the kernel for shared-prefix batches only; "varlen": flash only.
# Measured on the H200 (BENCHMARKS.md, 2026-12-02): one layer call 20.8 against flash's 112.8 µs
# (W2) and 34.1 against 68.2 µs (W1); W5 over HTTP at one connection 122.5 against 109.4 req/s,
# no loss at saturation; it passes inside torch.compile, export + AOTInductor and compiled buckets.
AUTO_CUDA = "segments"
_FLASH = ("varlen", "segments", "segments-cascade")  # backends whose varlen() is flash attention


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """`name` is a registered backend or "auto": on CUDA in fp16/bf16 (flash attention has no
    float32 kernel) `AUTO_CUDA` (plain `varlen` when Triton is missing), reference elsewhere."""
    device = torch.device(device)
    if name == "auto":
        half = dtype in (None, torch.float16, torch.bfloat16)
        name = "reference"
        if device.type == "cuda" and half:
            name = AUTO_CUDA if AUTO_CUDA == "varlen" or triton_available() else "varlen"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend '{name}'; available: {', '.join(available_backends())}"
        )
    if name in _FLASH and device.type != "cuda":
        raise ValueError(
            f"the '{name}' attention backend needs a CUDA device; use 'reference' on CPU"
        )
    if name in _FLASH and dtype == torch.float32:
        raise ValueError(
            f"the '{name}' attention backend runs in float16/bfloat16 only; use 'reference' "
            "for float32"
        )
    if name in _FLASH[1:] and not triton_available():
        raise ValueError(f"the '{name}' attention backend needs triton (pip install triton)")
    return _BACKENDS[name]()


def _segment_attention(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched dense attention. q: [n, Lq, Hq, D]; k, v: [n, Lk, Hkv, D] → ([n, Lq, Hq, D], [n,
    Lq, Hq])."""
    _n, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    if q.device.type == "cpu" and (not causal or lq == lk):
        # PyTorch's fused CPU flash kernel returns the LSE too: ~10x the naive path, fp32
        # accumulation. (Its causal mask is top-left aligned, identical to ours when Lq == Lk.)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2),
            k.repeat_interleave(rep, dim=2).transpose(1, 2),
            v.repeat_interleave(rep, dim=2).transpose(1, 2),
            0.0,
            causal,
        )[:2]
        return out.transpose(1, 2), lse.transpose(1, 2).float()
    qf = q.float().transpose(1, 2)  # [n, Hq, Lq, D]
    kf = k.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [n, Hq, Lq, Lk]
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (lk - lq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, Hq, Lq]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(probs, vf)  # [n, Hq, Lq, D]
    return out.transpose(1, 2).to(q.dtype), lse.transpose(1, 2)


@register("reference")
class ReferenceBackend:
    """Correct on any device; the oracle for the fast backends. Segments of equal shape are
    batched."""

    name = "reference"

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        bq, bk = cu_q.tolist(), cu_k.tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for s in range(len(bq) - 1):
            lq, lk = bq[s + 1] - bq[s], bk[s + 1] - bk[s]
            if lq > 0 and lk > 0:
                groups.setdefault((lq, lk), []).append(s)
        if len(groups) == 1:
            (lq, lk), segs = next(iter(groups.items()))
            n = len(segs)
            if n == len(bq) - 1 and q.shape[0] == n * lq and k.shape[0] == n * lk:
                # Equal segments tiling q and k (a padded training batch, same-length prompts):
                # views, no gather/scatter.
                o, seg_lse = _segment_attention(
                    q.reshape(n, lq, *q.shape[1:]),
                    k.reshape(n, lk, *k.shape[1:]),
                    v.reshape(n, lk, *v.shape[1:]),
                    causal,
                )
                return o.reshape(q.shape), seg_lse.reshape(q.shape[0], q.shape[1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for (lq, lk), segs in groups.items():
            qs = torch.stack([q[bq[s] : bq[s] + lq] for s in segs])
            ks = torch.stack([k[bk[s] : bk[s] + lk] for s in segs])
            vs = torch.stack([v[bk[s] : bk[s] + lk] for s in segs])
            o, seg_lse = _segment_attention(qs, ks, vs, causal)
            rows = torch.cat([torch.arange(bq[s], bq[s] + lq, device=q.device) for s in segs])
            out[rows] = o.reshape(-1, *o.shape[2:])
            lse[rows] = seg_lse.reshape(-1, seg_lse.shape[-1])
        return out, lse


@register("varlen")
class VarlenBackend:
    """CUDA flash attention over packed segments (`torch.nn.attention.varlen.varlen_attn`)."""

    name = "varlen"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        self._attn = varlen_attn
        self._aux = AuxRequest(lse=True)
        # NOTE: torch 2.11 accepts GQA k/v directly; later versions want enable_gqa=True.
        self._gqa_kwargs = (
            {"enable_gqa": True}
            if "enable_gqa" in inspect.signature(varlen_attn).parameters
            else {}
        )
        self._lse_heads_first: bool | None = None

    def _lse_layout(self, device) -> bool:
        """True when this torch returns lse as [heads, tokens] (2.11) rather than [tokens,
        heads]."""
        if self._lse_heads_first is None:
            q = torch.randn(3, 2, 64, device=device, dtype=torch.bfloat16)
            cu = torch.tensor([0, 3], device=device, dtype=torch.int32)
            _, lse = self._attn(q, q, q, cu, cu, 3, 3, return_aux=self._aux, **self._gqa_kwargs)
            self._lse_heads_first = tuple(lse.shape) == (2, 3)
        return self._lse_heads_first

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        heads_first = self._lse_layout(q.device)
        out, lse = self._attn(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            return_aux=self._aux,
            window_size=(-1, 0) if causal else (-1, -1),
            **self._gqa_kwargs,
        )
        if heads_first:
            lse = lse.transpose(0, 1)
        return out, lse.float()


class SegmentsBackend:
    """Flash attention (`inner`) for every `varlen` call (decode, beam prompts), and the packed
    prefill through the Triton kernel of `attention.segments` (one call, its grid sized to the
    tokens) for the batches `when` names: "always", or "cascade" (batches with shared-prefix
    groups; plain batches keep flash's causal call)."""

    def __init__(self, inner: AttentionBackend, when: str = "cascade") -> None:
        if when not in ("always", "cascade"):
            raise ValueError(f"SegmentsBackend: when must be 'always' or 'cascade', not {when!r}")
        from boundgen.attention.segments import packed_prefill  # needs triton: imported here

        self.inner, self.when, self._packed_prefill = inner, when, packed_prefill
        base = "" if inner.name == "varlen" else f"{inner.name}+"
        self.name = base + ("segments" if when == "always" else "segments-cascade")

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        return self.inner.varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal)

    def prefill(self, q, k, v, attn):
        if self.when == "cascade" and not attn.has_shared_prefix:
            return None
        if attn.has_shared_prefix:
            cu_prefix, cu_group_q = attn.cu_prefix, attn.cu_group_q
            p, s = attn.num_prefix_tokens, attn.num_shared_tokens
        else:  # not read by the kernel
            cu_prefix = cu_group_q = attn.cu_seqlens
            p, s = 0, 0
        return self._packed_prefill(q, k, v, attn.cu_seqlens, cu_prefix, cu_group_q, p, s)


register("segments")(lambda: SegmentsBackend(VarlenBackend(), "always"))
register("segments-cascade")(lambda: SegmentsBackend(VarlenBackend(), "cascade"))
