"""A decoder layer's linear layers for few rows, each fused with the ops around it (Triton).

At a beam-search decode step (B·W = 16–64 rows) or a short prompt (W3: 64 tokens) a layer is
~15 kernels of a few microseconds each: RMSNorm, the qkv GEMM, the o_proj GEMM and its residual
add, RMSNorm again, gate_up, SiLU·mul, down and its residual add. The GEMMs only stream their
weights (M rows ≪ the weights' K × N); everything else is launch latency and ~1.6 µs gaps between
kernels inside a CUDA graph (BENCHMARKS.md, 2026-12-01: a W4 search is 1,825 kernels, 2.9 ms of
its 8.4 ms idle between them). Here each linear layer takes its neighbours into one kernel:

    norm_linear      y = RMSNorm(x) @ W.T (+ bias)                (input norm + qkv)
    norm_gated       y = SiLU(g) · u, [g | u] = RMSNorm(x) @ W.T  (post-attention norm + gate_up
                                                                   + SiLU·mul)
    linear_residual  y = r + x @ W.T                              (o_proj, down + residual)

Each program streams a [BLOCK_N, K] slice of W once for all M rows (swap-AB: the weight tile is
the dot's left operand, so the rows may be as few as 16), so the weights are read once per call.

Numerics: the reduction in float32, then eager's roundings to the activation dtype in eager's
order (RMSNorm's `x.float() * rsqrt(...)` cast to the dtype before the weight; gate_up's output
rounded before SiLU, SiLU before the product; the GEMM output before the residual add), so the
fused layer differs from the eager one by the GEMMs' summation order only.

The ops are `torch.library.triton_op`s: torch.compile and torch.export + AOTInductor trace into
the kernels, and the same code runs eagerly. Without CUDA they run in Triton's CPU interpreter
(`TRITON_INTERPRET=1`, set before triton is imported), which only the tests use (`forced()`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.triton_launch import traceable

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# The most rows a call takes the fused kernels for; 0 (the default): never. Measured on the H200
# (BENCHMARKS.md, 2026-12-02 sixth session) with the default tile, the kernels stream the MLP's
# weights at ~0.9 TB/s against ~1.6 for cuBLAS + Inductor's fused elementwise kernels, and a
# compiled W4 search took 9.05 ms with them against 6.79 without (eager layers gain: W3 through
# `eager+graphs` 2.79 against 3.06 ms): they stay off until their tiles (`TILES`, swept by
# `benchmarks/bench_skinny.py --sweep`) beat Inductor's. `BOUNDGEN_SKINNY_MAX_ROWS=64` turns them
# on (an A/B); compiled packages record the value (`compile.cache.platform_info`), so a change
# rebuilds them.
MAX_ROWS = int(os.environ.get("BOUNDGEN_SKINNY_MAX_ROWS", "0"))

# Tiles per (K, N, gated): (BLOCK_N, BLOCK_K, num_warps, num_stages); sizes not listed take
# `DEFAULT_TILE`. `bench_skinny.py --sweep` times every tile on the GPU; the fastest belong here.
DEFAULT_TILE = (64, 128, 4, 3)
# Rows a program takes (the MMA's narrow side): rows beyond M are masked, and more than BLOCK_M
# rows take several programs per column block.
BLOCK_M = 64
TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {}

_FORCED = False


@contextlib.contextmanager
def forced():
    """Inside: the fused kernels also for CPU tensors (Triton's interpreter; the tests' switch)."""
    global _FORCED
    before, _FORCED = _FORCED, True
    try:
        yield
    finally:
        _FORCED = before


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def applies(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether the fused kernels take `x` through `linears`: plain `nn.Linear`s (not FP8's), at
    most `MAX_ROWS` rows, on CUDA in bf16/fp16 (or anywhere under `forced()` with the
    interpreter)."""
    if not AVAILABLE or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    if any(type(lin) is not nn.Linear for lin in linears):
        return False
    if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears):
        return False  # no backward formulas: training (the demo trainer) keeps the plain ops
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16)
    return _FORCED and _interpreting()


if AVAILABLE:

    @triton.jit
    def _row_rstd(x_ptr, rows, row_mask, stride_x, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """1 / RMS of each row (float32), as RMSNorm computes it."""
        ss = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_mask[:, None] & (ks[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            ss += tl.sum(a * a, axis=1)
        return 1.0 / tl.sqrt(ss / K + eps)

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        bias_ptr,
        norm_ptr,
        res_ptr,
        M,
        stride_x,
        stride_out,
        stride_res,
        eps,
        K: tl.constexpr,
        N: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        GATED: tl.constexpr,
        RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # acc is [BLOCK_N, BLOCK_M] (out transposed): the weight tile is the dot's M side
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        dtype = x_ptr.dtype.element_ty
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if NORM:
            # Inductor launches a user kernel with a Python float typed fp64 (attention/segments.py)
            if not INTERPRET:  # (the interpreter hands scalars over as Python floats)
                eps = tl.cast(eps, tl.float32)
            rstd = _row_rstd(x_ptr, rows, row_mask, stride_x, eps, K, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if NORM:
                # RMSNorm as eager rounds it: normalised in float32, cast, then times the weight
                g = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                a = (a.to(tl.float32) * rstd[:, None]).to(dtype)
                a = (g[None, :] * a.to(tl.float32)).to(dtype)
            w_mask = col_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            if INTERPRET:  # the CPU interpreter's bf16 dot is wrong: its inputs as float32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(w, tl.trans(a), acc)
            if GATED:
                w_up = tl.load(
                    w_ptr + (N + cols)[:, None] * K + ks[None, :], mask=w_mask, other=0.0
                )
                if INTERPRET:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(w_up, tl.trans(a), acc_up)
        if BIAS:
            b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            acc = acc + b[:, None]
        y = acc.to(dtype)
        if GATED:
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        out_mask = col_mask[:, None] & row_mask[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + rows[None, :] * stride_res + cols[:, None], mask=out_mask)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], y, mask=out_mask)

    def _launch(x, weight, *, bias=None, norm=None, eps=0.0, residual=None, gated=False):
        # the kernel takes rows by their stride and everything else packed
        x = x if x.stride(-1) == 1 else x.contiguous()
        weight = weight.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        # K and N from the weight, whose sizes are static: the compiled beam layers trace the
        # activations with symbolic sizes (dynamo marks a changed dim dynamic), and the kernel
        # specialises on K and N; only M, the rows, may be symbolic
        m = x.shape[0]
        k = weight.shape[1]
        n = weight.shape[0] // 2 if gated else weight.shape[0]
        torch._check(x.shape[1] == k)
        if residual is not None:
            torch._check(residual.shape[0] == m and residual.shape[1] == n)
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block_n, block_k, warps, stages = TILES.get((k, n, gated), DEFAULT_TILE)
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        block_m = BLOCK_M  # fixed, not by M: a branch on M would guard compiled callers
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        traceable(_skinny_kernel)[grid](
            x,
            weight,
            out,
            bias if bias is not None else weight,
            norm if norm is not None else weight,
            residual if residual is not None else out,
            m,
            x.stride(0),
            out.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            K=k,
            N=n,
            NORM=norm is not None,
            BIAS=bias is not None,
            GATED=gated,
            RESIDUAL=residual is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            INTERPRET=not x.is_cuda,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    @triton_op("boundgen::norm_linear", mutates_args=())
    def norm_linear(
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm(x; norm, eps) @ weight.T (+ bias): x [M, K] → [M, N]."""
        return _launch(x, weight, bias=bias, norm=norm, eps=eps)

    @triton_op("boundgen::norm_gated", mutates_args=())
    def norm_gated(
        x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor:
        """SiLU(g)·u with [g | u] = RMSNorm(x; norm, eps) @ weight.T: x [M, K], weight [2I, K] →
        [M, I]."""
        return _launch(x, weight, norm=norm, eps=eps, gated=True)

    @triton_op("boundgen::linear_residual", mutates_args=())
    def linear_residual(
        x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """residual + x @ weight.T: x [M, K], residual [M, N] → [M, N]."""
        return _launch(x, weight, residual=residual)


def reference_norm_linear(x, norm, eps, weight, bias=None):
    """What `norm_linear` computes, as the eager layer does (RMSNorm, then the linear layer)."""
    xf = x.float()
    h = norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return torch.nn.functional.linear(h, weight, bias)


def reference_norm_gated(x, norm, eps, weight):
    gate, up = reference_norm_linear(x, norm, eps, weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_linear_residual(x, weight, residual):
    return residual + torch.nn.functional.linear(x, weight)
