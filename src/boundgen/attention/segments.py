"""`segments`: one Triton kernel for packed prefill attention, its grid sized to the tokens.

Flash attention's varlen grid is `ceil(max_seqlen / 128) × segments × heads` programs, and the
cascade layout (`attention.metadata`) adds a second call (suffixes → their prefix), an LSE merge and
a concatenation. With one query prefix of 256 tokens and 100 candidates of 16 tokens (W2) that is
4 × 104 × 14 programs, most of them computing a 128-row tile for 16 real rows. This kernel's grid
is `ceil(T / BLOCK_T) × kv heads`:

- A program owns BLOCK_T consecutive packed tokens and the GQA query heads of one KV head, packed
  as the BLOCK_M = BLOCK_T · (Hq / Hkv) rows of its tile (row r: token r // gqa, head r % gqa), so
  each K/V tile is loaded once for all the query heads that share it.
- Each row finds its causal segment in `cu_seqlens` (a binary search) and, when its token lies in
  the shared-suffix span, its group in `cu_group_q` and the group's prefix in `cu_prefix`.
- Two key loops feed one online softmax: the union of the rows' prefix ranges (non-causal, only
  suffix rows see them), then the union of the rows' own segments (causal: key ≤ token, key ≥ the
  segment's start). A tile spanning several short segments walks their union with per-row masks.
  No second call, no merge, no cat.

`packed_prefill` is a `torch.library.triton_op`, so `torch.compile` traces into the kernel and
`torch.export` / AOTInductor compile it into a bucket's package. It returns only the output (a
prefill never needs the LSE). Importing this module needs `triton`; `backends` imports it lazily.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from boundgen import grid_dependency
from boundgen.grid_dependency import await_inputs
from boundgen.triton_launch import traceable, unit_last_stride


def _has_block_pointers() -> bool:
    """Triton 3.9 removed block pointers (its `make_block_ptr` only raises, saying so)."""
    return "have been removed" not in (getattr(tl.make_block_ptr, "__doc__", None) or "")


# Block pointers where Triton has them (the H200 measurements ran with them, triton 3.6: fewer
# registers than a tensor of pointers); masked pointer loads otherwise.
BLOCK_POINTERS = tl.constexpr(_has_block_pointers())


@triton.jit
def _tile(
    base, T, stride_t, start, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Rows [start, start + BLOCK_N) of a [T, HEAD_DIM] slice, zero past T or HEAD_DIM."""
    rows = start + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _search(cu, x, n, ITERS: tl.constexpr):
    """Per row: the largest i in [0, n) with cu[i] <= x (cu sorted, cu[0] <= x < cu[n])."""
    lo = tl.zeros_like(x)
    hi = lo + n
    for _ in range(ITERS):
        mid = (lo + hi) // 2
        go = tl.load(cu + mid) <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; float32 inputs multiplied exactly (not as tf32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _block(
    acc,
    m_i,
    l_i,
    q,
    Kh,
    Vh,
    T,
    stride_kt,
    stride_vt,
    start,
    row_lo,
    row_hi,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    MASK: tl.constexpr,
):
    """One BLOCK_N-key step of the online softmax (keys from `start`; Kh, Vh: this KV head's
    [T, HEAD_DIM] slices). With MASK, keys outside a row's range are masked out of its scores;
    the block itself is only bounded by T (block pointers where Triton has them: no per-element
    pointer tensors, fewer registers)."""
    if BLOCK_POINTERS:
        kb = tl.make_block_ptr(
            Kh, (T, HEAD_DIM), (stride_kt, 1), (start, 0), (BLOCK_N, BLOCK_D), order=(1, 0)
        )
        k = tl.load(kb, boundary_check=(0, 1), padding_option="zero")
    else:
        k = _tile(Kh, T, stride_kt, start, HEAD_DIM, BLOCK_N, BLOCK_D)
    if INTERPRET:
        k = k.to(tl.float32)
    s = dot(q, tl.trans(k), IEEE) * qk_scale
    if MASK:
        keys = start + tl.arange(0, BLOCK_N)
        visible = (keys[None, :] >= row_lo[:, None]) & (keys[None, :] < row_hi[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BLOCK_POINTERS:
        vb = tl.make_block_ptr(
            Vh, (T, HEAD_DIM), (stride_vt, 1), (start, 0), (BLOCK_N, BLOCK_D), order=(1, 0)
        )
        vt = tl.load(vb, boundary_check=(0, 1), padding_option="zero")
    else:
        vt = _tile(Vh, T, stride_vt, start, HEAD_DIM, BLOCK_N, BLOCK_D)
    p = p.to(vt.dtype)  # as flash attention: probabilities in the input dtype for the PV product
    if INTERPRET:
        p, vt = p.to(tl.float32), vt.to(tl.float32)
    acc = acc * alpha[:, None] + dot(p, vt, IEEE)
    m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sweep(
    acc,
    m_i,
    l_i,
    q,
    Kh,
    Vh,
    T,
    stride_kt,
    stride_vt,
    k_lo,
    k_hi,
    row_lo,
    row_hi,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    MASK: tl.constexpr,
):
    """`_block` over keys [k_lo, k_hi), BLOCK_N at a time."""
    if INTERPRET:
        # NOTE: Triton's CPU interpreter cannot take a block-reduced bound as a range() bound
        # (numpy >= 2 refuses int() of its 1-element arrays); a while loop compares instead. Its
        # tl.dot also multiplies bfloat16 (stored as uint16) as integers, so `_block` upcasts.
        start = k_lo
        while start < k_hi:
            acc, m_i, l_i = _block(
                acc,
                m_i,
                l_i,
                q,
                Kh,
                Vh,
                T,
                stride_kt,
                stride_vt,
                start,
                row_lo,
                row_hi,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                IEEE,
                INTERPRET,
                MASK,
            )
            start += BLOCK_N
    else:
        for start in range(k_lo, k_hi, BLOCK_N):
            acc, m_i, l_i = _block(
                acc,
                m_i,
                l_i,
                q,
                Kh,
                Vh,
                T,
                stride_kt,
                stride_vt,
                start,
                row_lo,
                row_hi,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                IEEE,
                INTERPRET,
                MASK,
            )
    return acc, m_i, l_i


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    Kh,
    Vh,
    T,
    stride_kt,
    stride_vt,
    row_ok,
    row_lo,
    row_hi,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online softmax of the tile over the union of its rows' key ranges: row i sees keys
    [row_lo[i], row_hi[i]) (rows outside `row_ok` are never stored and do not count). Whole blocks
    of keys that every row sees run without a mask (most of a long causal segment, a group's
    prefix); the blocks before and after them are masked per row. Scores are in log2 units
    (qk_scale includes log2(e))."""
    k_lo = tl.min(tl.where(row_ok, row_lo, T))
    k_hi = tl.max(tl.where(row_ok, row_hi, 0))
    all_lo = tl.max(tl.where(row_ok, row_lo, 0))  # keys [all_lo, all_hi) are seen by every row
    all_hi = tl.min(tl.where(row_ok, row_hi, T))
    n_full = tl.maximum(all_hi - all_lo, 0) // BLOCK_N
    mid_lo = tl.where(n_full > 0, all_lo, k_lo)
    mid_hi = mid_lo + n_full * BLOCK_N
    acc, m_i, l_i = _sweep(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        T,
        stride_kt,
        stride_vt,
        k_lo,
        mid_lo,
        row_lo,
        row_hi,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        IEEE,
        INTERPRET,
        True,
    )
    acc, m_i, l_i = _sweep(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        T,
        stride_kt,
        stride_vt,
        mid_lo,
        mid_hi,
        row_lo,
        row_hi,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        IEEE,
        INTERPRET,
        False,
    )
    acc, m_i, l_i = _sweep(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        T,
        stride_kt,
        stride_vt,
        mid_hi,
        k_hi,
        row_lo,
        row_hi,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        IEEE,
        INTERPRET,
        True,
    )
    return acc, m_i, l_i


# NOTE: the sizes that change from batch to batch are not specialised on (an eager forward of a new
# shape must not compile the kernel again); SEG_ITERS/GROUP_ITERS take a few values (`_iters`).
@grid_dependency.awaits
@triton.jit(do_not_specialize=["T", "num_segments", "num_groups", "num_prefix", "num_shared"])
def _packed_prefill_kernel(
    Q,
    K,
    V,
    Out,
    CU,
    CU_PREFIX,
    CU_GROUP_Q,
    T,
    num_segments,
    num_groups,
    num_prefix,
    num_shared,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    SEG_ITERS: tl.constexpr,
    GROUP_ITERS: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # Inductor launches a user kernel with a Python float typed fp64 (Triton's own launcher: fp32);
    # fp64 would reach the accumulators (H200, torch 2.11: "acc ... re-assigned to fp64"). A cast,
    # not `.to`: torch 2.11's analysis of which tensors the kernel writes passes the scale as a
    # constexpr float, which has no `.to` (the analysis failed, and Inductor then assumed the kernel
    # writes all its inputs).
    if not INTERPRET:  # (the interpreter hands scalars over as Python floats)
        qk_scale = tl.cast(qk_scale, tl.float32)
    r = tl.arange(0, BLOCK_M)
    tok = pid * BLOCK_T + r // GQA
    head = kvh * GQA + r % GQA
    row_ok = (r < BLOCK_T * GQA) & (tok < T)
    tok = tl.minimum(tok, T - 1)  # rows past the end compute token T-1's values, never stored
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok64 = tok.to(tl.int64)
    q = tl.load(
        Q + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERPRET:
        q = q.to(tl.float32)
    Kh = K + kvh.to(tl.int64) * stride_kh
    Vh = V + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row without keys stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if HAS_PREFIX:
        # suffix rows of group g also see prefix g, non-causally
        shared = row_ok & (tok >= num_prefix) & (tok < num_prefix + num_shared)
        u = tl.minimum(tl.maximum(tok - num_prefix, 0), num_shared - 1)
        g = _search(CU_GROUP_Q, u, num_groups, GROUP_ITERS)
        p_lo = tl.where(shared, tl.load(CU_PREFIX + g), T)  # other rows: an empty range
        p_hi = tl.where(shared, tl.load(CU_PREFIX + g + 1), 0)
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q,
            Kh,
            Vh,
            T,
            stride_kt,
            stride_vt,
            row_ok,
            p_lo,
            p_hi,
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            IEEE,
            INTERPRET,
        )

    # every row sees its own causal segment: keys [segment start, token]
    seg = _search(CU, tok, num_segments, SEG_ITERS)
    s_lo = tl.where(row_ok, tl.load(CU + seg), T)
    s_hi = tl.where(row_ok, tok + 1, 0)
    acc, m_i, l_i = _attend(
        acc,
        m_i,
        l_i,
        q,
        Kh,
        Vh,
        T,
        stride_kt,
        stride_vt,
        row_ok,
        s_lo,
        s_hi,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        IEEE,
        INTERPRET,
    )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# (head_dim ≤ 64, head_dim ≤ 128): BLOCK_M rows (tokens × GQA heads), BLOCK_N keys, warps, stages.
# head_dim 64 from `bench_attention.py --sweep` on the H200 (2026-12-02, 14/2 heads, µs of one call
# replayed from a graph): BLOCK_N 32 against 64, W2 in its bucket 16.8 (64 keys not among the six
# fastest, > 18.9), W1 30.4 against 34.2 (a 16-token candidate's own segment is one 32-key block,
# not half of a 64-key one); BLOCK_M 128 and 256 were slower. head_dim 128 not swept. Measured
# and dropped (H100, 2026-12-06, BENCHMARKS.md thirty-sixth session): the prefix walked in steps
# of its own size (64 keys: W2 in its bucket not among the six fastest, > 17.7 against 16.4 µs),
# and a row's segment and group found by counting the entries at or below its token instead of
# `_search` (one load instead of a chain of dependent ones: W3's GPU busy +12 µs, W2's runner
# +0.06 ms; the searches' latency is not what bounds the kernel). Git history has both.
CONFIGS = {64: (64, 32, 4, 2), 128: (64, 64, 4, 2)}


def config_for(head_dim: int) -> tuple[int, int, int, int]:
    return CONFIGS[64] if head_dim <= 64 else CONFIGS[128]


def _iters(n: int) -> int:
    """Halvings that take a search over [0, n) down to one candidate, rounded up to a multiple of
    4 (extra halvings change nothing; a few values, a few compiled variants)."""
    need = math.ceil(math.log2(max(n, 1))) + 1
    return 4 * math.ceil(need / 4)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_prefix: torch.Tensor,
    cu_group_q: torch.Tensor,
    num_prefix: int,
    num_shared: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """The kernel with an explicit tile configuration (what `packed_prefill` and the benchmark
    call)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    gqa = hq // hkv
    block_m = max(block_m, triton.next_power_of_2(gqa))
    block_t = block_m // gqa
    out = torch.empty_like(q)
    num_segments = cu_seqlens.shape[0] - 1
    num_groups = cu_group_q.shape[0] - 1
    grid = (triton.cdiv(t, block_t), hkv)
    traceable(_packed_prefill_kernel)[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        cu_prefix,
        cu_group_q,
        t,
        num_segments,
        num_groups,
        num_prefix,
        num_shared,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        SEG_ITERS=_iters(num_segments),
        GROUP_ITERS=_iters(num_groups),
        GQA=gqa,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_T=block_t,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_PREFIX=num_shared > 0,
        IEEE=q.dtype == torch.float32,
        INTERPRET=q.device.type != "cuda",  # Triton's CPU interpreter (TRITON_INTERPRET=1)
        PDL=grid_dependency.waits(q),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton_op("boundgen::packed_prefill", mutates_args=())
def packed_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_prefix: torch.Tensor,
    cu_group_q: torch.Tensor,
    num_prefix: int,
    num_shared: int,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (last dim contiguous) → [T, Hq, D]: causal per segment of
    `cu_seqlens`; tokens [num_prefix, num_prefix + num_shared) also see, non-causally, the prefix
    of their group (`cu_group_q` over that span, `cu_prefix` over [0, num_prefix)). Without shared
    prefixes pass num_shared = 0 (the two group tensors are then not read)."""
    q, k, v = unit_last_stride(q, k, v)
    return launch(
        q, k, v, cu_seqlens, cu_prefix, cu_group_q, num_prefix, num_shared, *config_for(q.shape[2])
    )
