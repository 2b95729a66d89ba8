"""The residual linear layers (o_proj, down) for few rows as one weight-streaming Triton GEMM whose
K is split into float32 partial sums, summed by the pointwise kernel that follows (the residual
add).

At a beam decode step (16–64 rows) or a short prompt (W3: 64 tokens) a GEMM only streams its
weights. cuBLAS runs `down` (K 4,864 × N 896) as a split-K GEMM and a `splitKreduce` kernel, and
o_proj (896 × 896) latency-bound: on an H100, replayed over 8 layers' weights, `down` 8.4 µs at 16
rows and 9.2 at 64, o_proj 3.7 (BENCHMARKS.md, thirty-sixth session, `bench_weight_stream.py`).
This kernel takes the weight tile [BLOCK_N, BLOCK_K] as the MMA's left operand (swap AB: the rows
may be as few as 16) and splits K over `split_k(K)` programs a column tile, each writing its own
partial [M, N]: 6.1 / 7.0 µs for `down` and 2.4 / 3.2 for o_proj at 16 / 64 rows in that
benchmark. No second kernel sums the partials and no counters are kept (the last program of a
tile summing them, as an earlier few-row kernel did, cost a counter buffer a forward and lost W4
by ~2 ms, BENCHMARKS.md twenty-ninth session): `linear_residual` returns
the residual plus each partial in torch, pointwise adds that Inductor computes inside the
kernel that already adds the residual and takes the next RMSNorm. At most 8 splits: each is one
more [M, N] float32 read there.

Numerics: float32 products and sums (the partials, their sum, the residual added in float32),
rounded once to the residual's dtype; the plain layer rounds the GEMM's output first, then the sum.

`MAX_ROWS` (`BOUNDGEN_STREAM_MAX_ROWS`, default 128; 0: never) decides which calls take it, read
when a layer traces, compiles or is captured; compiled packages record it
(`compile.cache.platform_info`). The op is a `torch.library.triton_op`: torch.compile and
torch.export + AOTInductor trace into the kernel. Without CUDA it runs in Triton's CPU interpreter
(`TRITON_INTERPRET=1`), which only the tests use (`forced()`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from boundgen import grid_dependency, triton_launch
from boundgen.settings import switched

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.grid_dependency import await_inputs
    from boundgen.triton_launch import traceable

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# The most rows a call takes the kernel for (0: never). 128: W3's prompt, a one-prompt beam
# search's decode steps (16–64 rows) and eight prompts' (128 rows). On an H100 (thirty-seventh
# session, interleaved) 64 rows took W3's runner 1.229 → 1.165 ms and its GPU busy 874 → 827 µs,
# W4 at one prompt 5.72 → 5.54 ms (trie, full head) and 5.87 → 5.48 (trie, children's head); 128
# against 64 took W4 at eight prompts 7.18 → 7.00 and 7.12 → 6.87 ms (thirty-seventh), 7.03 →
# 6.88 and 6.87 → 6.62 (thirty-eighth), and the GPU suite passed at 128 on the H200.
MAX_ROWS = int(os.environ.get("BOUNDGEN_STREAM_MAX_ROWS", "128"))
# Tile: columns a program, K a step, warps, stages (the fastest pointer-load tiles of
# `bench_weight_stream.py` on the H100 for both projections at 16 and 64 rows)
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3

# Inside: the kernel also for CPU tensors (Triton's interpreter; the tests' switch)
forced = triton_launch.interpreted


def rows_up_to(rows: int) -> contextlib.AbstractContextManager[None]:
    """Inside: the kernel takes calls of at most `rows` rows (`MAX_ROWS`; 0: none); read when a
    layer traces, compiles or is captured (an A/B's switch)."""
    return switched(globals(), "MAX_ROWS", rows)


def applies(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether the kernel takes `x` through `linear`: a plain `nn.Linear` (not FP8's) without a
    bias, at most `MAX_ROWS` rows, on CUDA in bf16/fp16 (or anywhere under `forced()` with the
    interpreter)."""
    if not AVAILABLE or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    if type(linear) is not nn.Linear or linear.bias is not None:
        return False
    return triton_launch.takes(x, [linear.weight])


def split_k(k: int) -> int:
    """Programs a column tile's K is split over: ~256 of K each (o_proj 896 → 4; `down` 4,864 →
    8, 16 ran no faster at 64 rows), at most 8 (each partial is read again by the residual's
    kernel)."""
    return max(1, min(8, round(k / 256)))


if AVAILABLE:

    @triton.jit
    def two_products(
        X,
        W,
        rows,
        row_ok,
        a,
        col_ok,
        stride_xm,
        K: tl.constexpr,
        B_OFFSET: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """X[rows] @ W[a].T and X[rows] @ W[a + B_OFFSET].T over all of K, two float32
        [BLOCK_N, BLOCK_M] accumulators (swap AB; `a`: BLOCK_N weight rows, masked by `col_ok`):
        the two halves a program of the epilogue kernels keeps, gate's and up's columns
        (`stream_gated`: B_OFFSET = I) or a head's first and second halves (`stream_qkv`: D/2);
        x's tile is loaded once for both, the second half's pointers are the first's plus a
        constant."""
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w_mask = col_ok[:, None] & k_ok[None, :]
            at = W + a.to(tl.int64)[:, None] * K + ks[None, :]
            w_a = tl.load(at, mask=w_mask, other=0.0)
            w_b = tl.load(at + B_OFFSET * K, mask=w_mask, other=0.0)
            x = tl.load(
                X + rows.to(tl.int64)[None, :] * stride_xm + ks[:, None],
                mask=row_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                w_a, w_b, x = w_a.to(tl.float32), w_b.to(tl.float32), x.to(tl.float32)
            acc_a += tl.dot(w_a, x, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            acc_b += tl.dot(w_b, x, input_precision=PRECISION)
        return acc_a, acc_b

    @grid_dependency.awaits
    @triton.jit
    def _stream_kernel(
        X,
        W,
        Parts,
        M,
        stride_xm,
        K: tl.constexpr,
        N: tl.constexpr,
        K_PER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Parts[s, rows, cols] = X[rows, Ks] @ W[cols, Ks].T over this program's column tile,
        row tile and K slice Ks (s = program_id(1))."""
        await_inputs(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < N
        row_ok = rows < M
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        k0 = pid_k * K_PER
        for k in range(k0, k0 + K_PER, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(
                W + cols.to(tl.int64)[:, None] * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            x = tl.load(
                X + rows.to(tl.int64)[None, :] * stride_xm + ks[:, None],
                mask=row_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc += tl.dot(w, x, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        out = Parts + (pid_k * M + rows.to(tl.int64))[None, :] * N + cols[:, None]
        tl.store(out, acc, mask=col_ok[:, None] & row_ok[None, :])

    def launch(
        x: torch.Tensor,
        weight: torch.Tensor,
        split: int,
        block_n: int = BLOCK_N,
        block_k: int = BLOCK_K,
        warps: int = NUM_WARPS,
        stages: int = NUM_STAGES,
    ) -> torch.Tensor:
        """The kernel with an explicit tile (what the op and `bench_weight_stream.py` call):
        partials [splits, M, N], K cut into `split` whole BLOCK_K steps (fewer where K is short)."""
        x, weight, block_m = operands(x, weight)
        m = x.shape[0]
        n, k = weight.shape
        per = k_per(k, split, block_k)
        split = cdiv(k, per)
        parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
        tile = (block_m, block_n, block_k, warps, stages)
        run(_stream_kernel, grid, x, weight, parts, tile, K=k, N=n, K_PER=per)
        return parts

    def operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x and the weight [N, K] as the streamed kernels read them (last dims contiguous), and
        the rows a program takes. K from the weight (static); the rows may be symbolic (the
        compiled beam layers)."""
        (x,) = triton_launch.unit_last_stride(x)
        weight = weight.contiguous()
        torch._check(x.shape[1] == weight.shape[1])
        return x, weight, block_m_for(x.shape[0])

    def run(kernel, grid, x, weight, out, tile: tuple, **shape) -> None:
        """`kernel`[grid] as the streamed kernels take their arguments: X, W, Out, M, stride_xm,
        the shape's constexprs, then the tile's (`tile`: BLOCK_M, BLOCK_N, BLOCK_K, warps,
        stages), `tl.dot`'s precision, whether Triton's interpreter runs it and whether the
        kernel waits for its inputs (`grid_dependency`)."""
        block_m, block_n, block_k, warps, stages = tile
        traceable(kernel)[grid](
            x,
            weight,
            out,
            x.shape[0],
            x.stride(0),
            **shape,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda,
            PDL=grid_dependency.waits(x),
            num_warps=warps,
            num_stages=stages,
        )

    @triton_op("boundgen::stream_partials", mutates_args=())
    def _stream_partials(x: torch.Tensor, weight: torch.Tensor, split: int) -> torch.Tensor:
        return launch(x, weight, split)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_m_for(m) -> int:
    """Rows a program takes (the MMA's narrow side, at least 16): the fewest of 16, 32 and 64 that
    hold `m`, so 16 beam rows do not pay a 64-row product; 64 when `m` is symbolic (the compiled
    beam layers' rows), since a branch on it would guard the compiled caller."""
    if not isinstance(m, int):
        return 64
    return 16 if m <= 16 else 32 if m <= 32 else 64


def k_per(k: int, split: int, block_k: int = BLOCK_K) -> int:
    """K a program takes: K over `split`, rounded up to whole BLOCK_K steps."""
    return cdiv(cdiv(k, split), block_k) * block_k


def partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T as float32 partial sums over `split_k(K)` slices of K:
    [splits, M, N]."""
    return torch.ops.boundgen.stream_partials(x, weight, split_k(weight.shape[1]))


def _sum_onto(start: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """start + each partial in turn (float32), one add a partial: their count is static (K's
    split), and adds of slices are pointwise, so they go into the kernel that reads the sum.
    Inductor made a reduction kernel of its own for one of a layer's two `sum(0)`s (W3 on an
    H100, BENCHMARKS.md thirty-sixth session)."""
    out = start
    for s in range(parts.shape[0]):
        out = out + parts[s]
    return out


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T: x [M, K], residual [M, N] → [M, N] in the residual's dtype, the
    partials summed by the kernel that reads the result (the residual add + the next RMSNorm)."""
    return _sum_onto(residual.float(), partials(x, weight)).to(residual.dtype)


def reference_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What `partials` computes, slice by slice in float32 (the tests' oracle)."""
    k = weight.shape[1]
    per = k_per(k, split_k(k))
    return torch.stack(
        [x[:, s : s + per].float() @ weight[:, s : s + per].float().T for s in range(0, k, per)]
    )
