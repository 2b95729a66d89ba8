"""The attention's qkv projection (+ bias) and the q/k rotation for few rows as one
weight-streaming Triton GEMM whose epilogue rotates q's and k's heads: q, k and v come out as the
plain path's rotated views, with no rotation kernel after the GEMM.

At W3's 64 rows cuBLAS runs qkv (K 896 × N 1,152, 2 MB) latency-bound, 4.7 µs a layer on an H100
(0.44 TB/s), and Inductor's rotation kernel follows it (1.4 µs and one more launch a layer: 34 µs
and 24 launches of W3's 201; BENCHMARKS.md, thirty-ninth session). Streaming qkv through
`models/stream.py`'s K-split kernel lost (thirty-eighth session): Inductor wrote q, k and v from
the summed partials in three kernels a layer. Here nothing is summed after the kernel: RoPE pairs
column d of a head with column d + D/2 (HF's rotate-half), so a program keeps the two halves'
columns of its tile — `BLOCK_H` pairs of one head — in two float32 accumulators over all of K
(`models/stream_gated.py`'s shape), adds the bias, rounds to x's dtype as the plain GEMM's output
is, and rotates in float32 by the rows' cos and sin, rounded once, as Inductor's compiled rotation
does. v's heads are stored as computed. The columns are few (576 pairs for Qwen2.5-0.5B: 36
programs of 16), so the rows are cut into tiles of at most `MAX_BLOCK_M` — every row tile reads
the same weight tile, from L2 after the first — to spread the weight's read over the SMs.

At a beam decode step the same kernel writes k and v into the cache's slot (`rotated_into_slot`):
no stack-and-copy kernel after it. On by default since the forty-first session, when the GPU
suite passed with it on (`ROTATED`; `BOUNDGEN_STREAM_QKV=0` turns it off; W4 at one prompt 4.96 →
4.85 ms on an H100, W3 a wash: BENCHMARKS.md, fortieth session); it takes the calls of at most
`stream.MAX_ROWS` rows whose q and k rotate as one run of heads
(`Attention.rotates_together`: no q/k norm, q not grouped). Compiled packages record the switch
(`compile.cache.platform_info`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from boundgen import grid_dependency, triton_launch
from boundgen.models import stream
from boundgen.settings import switched

AVAILABLE = stream.AVAILABLE  # Triton and torch's triton_op, as `stream` found them
if AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.grid_dependency import await_inputs
    from boundgen.models.stream import two_products

ROTATED = os.environ.get("BOUNDGEN_STREAM_QKV", "1") == "1"
# Tile: pairs of columns a program (BLOCK_H of a head's first half and the same of its second;
# at most D/2, dividing it), rows a program at most, K a step, warps, stages. Swept on an H100
# (`bench_weight_stream.py --shapes rotated`, thirty-ninth session, 36 tiles): 16 pairs, 32 rows,
# 64 of K, 4 stages — 4.70 / 4.50 / 6.29 µs at 16 / 64 / 128 rows against cuBLAS + Inductor's
# rotation's 5.22 / 5.74 / 6.54 (the first guess, 16 rows a program: 4.93 / 6.70 / 8.61; every
# row tile reads the weight tile again, from L2, and 16-row tiles made that the cost).
BLOCK_H, MAX_BLOCK_M, BLOCK_K, NUM_WARPS, NUM_STAGES = 16, 32, 64, 4, 4


def enabled(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: qkv + the q/k rotation take the kernel (`ROTATED`) or not; read when a layer
    traces, compiles or is captured (an A/B's switch)."""
    return switched(globals(), "ROTATED", on)


def applies(x: torch.Tensor, qkv: nn.Module, head_dim: int) -> bool:
    """Whether the kernel takes `x` through the qkv projection `qkv` and the rotation: on
    (`ROTATED`), a plain `nn.Linear` (not FP8's; with or without a bias), heads whose halves hold
    whole tiles of `BLOCK_H` pairs (`tl.dot` takes at least 16), at most `stream.MAX_ROWS` rows,
    bf16/fp16 on CUDA or the interpreter under `stream.forced()`. The caller checks that q and k
    rotate together."""
    if not (ROTATED and AVAILABLE) or x.dim() != 2 or x.shape[0] > stream.MAX_ROWS:
        return False
    if type(qkv) is not nn.Linear or (head_dim // 2) % BLOCK_H:
        return False
    return triton_launch.takes(x, [qkv.weight])


if AVAILABLE:

    @grid_dependency.awaits
    @triton.jit
    def _qkv_kernel(
        X,
        W,
        Bias,
        Cos,
        Sin,
        Out,
        KV,
        Step,
        M,
        stride_xm,
        stride_rope,
        stride_out,
        stride_kv_row,
        stride_kv_slot,
        stride_kv_kind,
        K: tl.constexpr,
        N: tl.constexpr,
        HEAD_D: tl.constexpr,
        ROT_COLS: tl.constexpr,
        Q_COLS: tl.constexpr,
        KV_COLS: tl.constexpr,
        SLOT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Out[rows, lo] and Out[rows, lo + D/2] for this program's `BLOCK_H` pairs of one head
        (lo = head·D + d): X @ W[lo].T and X @ W[lo + D/2].T (+ bias), rounded to Out's dtype,
        then rotated by cos/sin [T, D/2] of the rows where the head is one of q's or k's
        (columns before ROT_COLS). With SLOT, Out holds q's columns only and k's and v's heads go
        into slot Step[0] of KV [rows, slots, 2, Hkv, D] (a beam step's cache: no copy after)."""
        await_inputs(PDL)
        pid_h = tl.program_id(0)
        pid_m = tl.program_id(1)
        pairs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # pair index: head · D/2 + d
        d = pairs % (HEAD_D // 2)
        lo = (pairs // (HEAD_D // 2)) * HEAD_D + d
        hi = lo + HEAD_D // 2
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = lo < N
        row_ok = rows < M
        acc_lo, acc_hi = two_products(
            X, W, rows, row_ok, lo, col_ok, stride_xm, K, HEAD_D // 2, BLOCK_H, BLOCK_M, BLOCK_K,
            PRECISION, INTERPRET,
        )  # fmt: skip
        if HAS_BIAS:
            acc_lo += tl.load(Bias + lo, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            acc_hi += tl.load(Bias + hi, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        dtype = Out.dtype.element_ty
        # the plain GEMM's output, rounded; rotated in float32 from it and rounded once
        x1 = acc_lo.to(dtype).to(tl.float32)
        x2 = acc_hi.to(dtype).to(tl.float32)
        if pid_h * BLOCK_H * 2 < ROT_COLS:  # (a tile is one head: q's or k's, or v's)
            at = rows.to(tl.int64)[None, :] * stride_rope + d[:, None]
            cos = tl.load(Cos + at, mask=row_ok[None, :], other=0.0).to(tl.float32)
            sin = tl.load(Sin + at, mask=row_ok[None, :], other=0.0).to(tl.float32)
            x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        mask = col_ok[:, None] & row_ok[None, :]
        if SLOT and pid_h * BLOCK_H * 2 >= Q_COLS:  # a k or v head: into the cache's slot
            c = lo - Q_COLS  # kind · Hkv · D + head · D + d: [2, Hkv, D]'s flat index
            kind = c // KV_COLS
            at = (c - kind * KV_COLS) + kind * stride_kv_kind
            slot = tl.load(Step)
            out = KV + rows.to(tl.int64)[None, :] * stride_kv_row + slot * stride_kv_slot
            tl.store(out + at[:, None], x1.to(dtype), mask=mask)
            tl.store(out + at[:, None] + HEAD_D // 2, x2.to(dtype), mask=mask)
        else:
            out = Out + rows.to(tl.int64)[None, :] * stride_out
            tl.store(out + lo[:, None], x1.to(dtype), mask=mask)
            tl.store(out + hi[:, None], x2.to(dtype), mask=mask)

    def launch(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated_columns: int,
        tile: tuple | None = None,
        kv: torch.Tensor | None = None,
        step: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel (what the ops and `bench_weight_stream.py` call): `rotated` of x @ weight.T
        (+ bias) [M, N] in x's dtype; `tile` (BLOCK_H, most rows a program, BLOCK_K, warps,
        stages), the module's when not given. With `kv` [M, S, 2, Hkv, D] and `step` (int64
        [1]): q's columns [M, N − 2·Hkv·D] out, k and v written into `kv`'s slot `step`."""
        block_h, max_block_m, block_k, warps, stages = tile or (
            BLOCK_H, MAX_BLOCK_M, BLOCK_K, NUM_WARPS, NUM_STAGES
        )  # fmt: skip
        x, weight, block_m = stream.operands(x, weight)
        block_m = min(block_m, max_block_m)
        n, k = weight.shape
        half = cos.shape[-1]
        torch._check(n % (2 * half) == 0 and half % block_h == 0)
        cos, sin = cos.reshape(-1, half), sin.reshape(-1, half)
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        slot = kv is not None
        kv_cols = kv.shape[3] * kv.shape[4] if slot else 0  # Hkv · D
        if slot:  # the slot's [2, Hkv, D] is read as one flat run of k's then v's columns
            torch._check(kv.stride(4) == 1 and kv.stride(3) == kv.shape[4])
            torch._check(n == rotated_columns + kv_cols and kv.shape[2] == 2)
        q_cols = n - 2 * kv_cols
        out = torch.empty((x.shape[0], q_cols if slot else n), dtype=x.dtype, device=x.device)
        grid = (n // 2 // block_h, triton.cdiv(x.shape[0], block_m))
        triton_launch.traceable(_qkv_kernel)[grid](
            x,
            weight,
            bias if bias is not None else weight,
            cos,
            sin,
            out,
            kv if slot else out,
            step if slot else out,
            x.shape[0],
            x.stride(0),
            cos.stride(0),
            out.stride(0),
            kv.stride(0) if slot else 0,
            kv.stride(1) if slot else 0,
            kv.stride(2) if slot else 0,
            K=k,
            N=n,
            HEAD_D=2 * half,
            ROT_COLS=rotated_columns,
            Q_COLS=q_cols,
            KV_COLS=max(kv_cols, 1),
            SLOT=slot,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            BLOCK_K=block_k,
            PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda,
            PDL=grid_dependency.waits(x),
            num_warps=warps,
            num_stages=stages,
        )
        return out

    @triton_op("boundgen::stream_qkv", mutates_args=())
    def _stream_qkv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated_columns: int,
    ) -> torch.Tensor:
        return launch(x, weight, bias, cos, sin, rotated_columns)

    @triton_op("boundgen::stream_qkv_slot", mutates_args=("kv",))
    def _stream_qkv_slot(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated_columns: int,
        kv: torch.Tensor,
        step: torch.Tensor,
    ) -> torch.Tensor:
        return launch(x, weight, bias, cos, sin, rotated_columns, kv=kv, step=step)


def rotated(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_columns: int,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) with the heads of its first `rotated_columns` columns
    rotated by cos, sin ([M, 1, D/2] or [M, D/2]; HF's rotate-half) → [M, N] in x's dtype: the
    qkv projection's output with q and k rotated (`Attention.heads(..., rotate=False)` takes
    it)."""
    return torch.ops.boundgen.stream_qkv(x, weight, bias, cos, sin, rotated_columns)


def rotated_into_slot(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_columns: int,
    kv: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """`rotated` for a beam decode step: q's rotated columns [M, Hq·D] out, k (rotated) and v
    written by the same kernel into slot `step` (int64 [1]) of `kv` [M, S, 2, Hkv, D] (the step's
    cache layer, `BeamKV`): no stack-and-copy kernel after it."""
    return torch.ops.boundgen.stream_qkv_slot(x, weight, bias, cos, sin, rotated_columns, kv, step)


def reference(x, weight, bias, cos, sin, rotated_columns: int) -> torch.Tensor:
    """What `rotated` computes: the projection in float32 rounded to x's dtype, its first
    `rotated_columns` columns' heads rotated in float32 and rounded once (the tests' oracle)."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype).float()
    half = cos.shape[-1]
    t = x.shape[0]
    heads = y[:, :rotated_columns].view(t, -1, 2, half)
    c, s = cos.reshape(t, 1, half).float(), sin.reshape(t, 1, half).float()
    x1, x2 = heads[:, :, 0], heads[:, :, 1]
    rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=2).view(t, rotated_columns)
    return torch.cat((rot, y[:, rotated_columns:]), dim=1).to(x.dtype)
