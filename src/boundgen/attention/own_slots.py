"""`own_slots_merge`: a decode step's own-slot attention and its merge with the prompt part, one
Triton kernel.

With compiled decode layers a step's attention is flash over the prompt (the query heads of a KV
head as rows, `cascade.grouped_rows_attention`) plus the beams' attention over their own few
slots ≤ step, merged by log-sum-exp. Inductor makes that second part four kernels a layer-step
(the scores, their log-sum-exp, the weighted values, the merge that also puts flash's grouped
output back in head order), 72 times a W4 search: the weighted values 2.5 µs and the merge 1.9 µs
a call, the other two under 1.6 µs each, with gaps of ~0.9 µs between kernels (H200, W4 b1, the
fifteenth session's `beam-code` profile, `benchmarks/results/h200-2026-12-04-s15-call1`). Here one
program owns one beam's query heads of one KV head: it starts an online softmax from flash's
output and log-sum-exp (as a partial result whose normaliser is exp(lse)), adds the own slots
0..step, and stores the heads in head order — one launch.

Numerics: scores, softmax and the merge in float32, one rounding to the output dtype at the end
(the Inductor path rounds the own-slot output once more before the merge).

It is a `torch.library.triton_op`, so the compiled decode layers trace into it; the step is read
from its int64 tensor, so one CUDA graph serves every step. Taken by compiled layers on CUDA whose
decode attention is flash (`BOUNDGEN_BEAM_ATTENTION=flash`; by default since the twenty-eighth
session the whole decode attention is one kernel, `beam_decode.py`): a W4 search (H200,
whole-search graph, `beam-heads`, seventeenth session) made 1,697 launches instead of 1,841 (two
fewer a layer-step, not the three the output code suggested), its GPU busy time 5.11 → 4.93 ms
(b1) and 9.18 → 8.64 ms (b16), and ran 6.70 → 6.18 ms (b1) and 10.73 → 10.05 ms (b16);
`BOUNDGEN_BEAM_OWN_KERNEL=0` keeps Inductor's kernels.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.triton_launch import one_stride_set, traceable, unit_last_stride

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# Compiled decode layers on CUDA take this kernel for their own slots and the merge ("1", the
# default: faster on the H200), or Inductor's kernels ("0", for an A/B).
ENABLED = os.environ.get("BOUNDGEN_BEAM_OWN_KERNEL", "1") == "1"

NUM_WARPS = 1  # a program's work is G × D = 7 × 64 values: one warp


def chosen(device: torch.device) -> bool:
    """Whether a compiled decode layer on `device` takes the kernel (`ENABLED`, CUDA, Triton);
    eager layers never do (`decode_layer`'s `own_kernel`: `ModelSteps.compiled`)."""
    return ENABLED and AVAILABLE and device.type == "cuda"


if AVAILABLE:

    @triton.jit
    def _own_slots_merge_kernel(
        Q,
        BK,
        BV,
        SO,
        SLSE,
        STEP,
        Out,
        stride_qn,
        stride_qg,
        stride_qh,
        stride_bn,
        stride_bs,
        stride_bh,
        stride_sn,
        stride_sg,
        stride_sh,
        stride_ln,
        stride_lg,
        stride_lh,
        stride_on,
        stride_oh,
        qk_scale,
        SLOTS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        # Inductor hands a Python float over typed fp64 (attention/segments.py); the interpreter
        # as a Python float
        if not INTERPRET:
            qk_scale = tl.cast(qk_scale, tl.float32)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        mask = g_ok[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(
            Q + n * stride_qn + g[:, None] * stride_qg + kvh * stride_qh + d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        # the prompt part as a partial softmax: normaliser exp(lse), output already divided by it
        m_i = tl.load(SLSE + n * stride_ln + g * stride_lg + kvh * stride_lh, mask=g_ok, other=0.0)
        m_i = m_i.to(tl.float32)
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.load(
            SO + n * stride_sn + g[:, None] * stride_sg + kvh * stride_sh + d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        # the beam's own slots 0..step (this step's included), one key for all G query heads
        step = tl.load(STEP)
        for slot in tl.static_range(SLOTS):
            offs = n * stride_bn + slot * stride_bs + kvh * stride_bh + d
            k = tl.load(BK + offs, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            v = tl.load(BV + offs, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            sc = tl.sum(q * k[None, :], axis=1) * qk_scale
            sc = tl.where(slot <= step, sc, float("-inf"))
            m_new = tl.maximum(m_i, sc)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v[None, :]
            m_i = m_new
        out = acc / l_i[:, None]
        head = kvh * GROUP + g  # query head j·G + g reads KV head j (HF's repeat_kv)
        tl.store(
            Out + n * stride_on + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask,
        )

    @triton_op("boundgen::own_slots_merge", mutates_args=())
    def own_slots_merge(
        q: torch.Tensor,
        bk: torch.Tensor,
        bv: torch.Tensor,
        step: torch.Tensor,
        shared: torch.Tensor,
        shared_lse: torch.Tensor,
    ) -> torch.Tensor:
        """q [N, G, Hkv, D] (query head j·G + g at [:, g, j], `cascade.by_kv_head`); bk, bv
        [N, S, Hkv, D], slots 0..step[0] written; the prompt part's output `shared` [N, G, Hkv, D]
        (q's dtype) and log-sum-exp `shared_lse` [N, G, Hkv] float32 → [N, G·Hkv, D] in head
        order: each beam's attention over its prompt and its own slots ≤ step."""
        n, group, hkv, d = q.shape
        slots = bk.shape[1]
        q, bk, bv, shared = unit_last_stride(q, bk, bv, shared)
        bk, bv = one_stride_set(bk, bv)
        out = torch.empty((n, group * hkv, d), dtype=q.dtype, device=q.device)
        if n == 0:
            return out
        traceable(_own_slots_merge_kernel)[(n, hkv)](
            q,
            bk,
            bv,
            shared,
            shared_lse,
            step,
            out,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            bk.stride(0),
            bk.stride(1),
            bk.stride(2),
            shared.stride(0),
            shared.stride(1),
            shared.stride(2),
            shared_lse.stride(0),
            shared_lse.stride(1),
            shared_lse.stride(2),
            out.stride(0),
            out.stride(1),
            1.0 / math.sqrt(d),
            SLOTS=slots,
            GROUP=group,
            HEAD_DIM=d,
            BLOCK_G=max(2, triton.next_power_of_2(group)),
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            INTERPRET=not q.is_cuda,
            num_warps=NUM_WARPS,
        )
        return out
