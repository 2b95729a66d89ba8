"""The MLP's first half for prefill-sized row counts in one kernel: RMSNorm, the gate_up GEMM and
SiLU·mul (Triton), so the [M, 2I] gate_up output never goes to memory.

In a W1 call on the H200 (BENCHMARKS.md, 2026-12-03) the gate_up GEMM takes 24.8 ms and the
SiLU·mul that reads its output back 6.8 ms of 64 ms of kernels; the post-attention RMSNorm another
share of 4.5 ms. Here each program computes a [BLOCK_M, BLOCK_N] tile of the gate and the same tile
of the up projection from one read of the normed activation rows (two accumulators), and writes
SiLU(gate)·up: half the output bytes and no second pass. Whether it beats cuBLAS + Inductor's
fused elementwise kernels at these shapes is for the H200 to say (`benchmarks/bench_gated_mm.py`):
until it does it is off (`MIN_ROWS` 0). `BOUNDGEN_GATED_MM_MIN_ROWS=1024` turns it on for calls of
at least that many rows (an A/B); compiled packages record the value
(`compile.cache.platform_info`), so a change rebuilds them.

Numerics: the products summed in float32, then eager's roundings in eager's order (RMSNorm's
`x.float() * rsqrt(...)` cast to the activation dtype before the weight, gate_up's output rounded
before SiLU, SiLU before the product), so the kernel differs from the eager layer by the GEMM's
summation order only. Programs go over the output tiles in groups of `GROUP_M` row blocks, so a
group's weight tiles are read from L2 rather than memory.

The op is a `torch.library.triton_op`: torch.compile and torch.export + AOTInductor trace into the
kernel. Without CUDA it runs in Triton's CPU interpreter under `skinny.forced()` (the tests).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from boundgen.models import skinny

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.triton_launch import traceable

    AVAILABLE = skinny.AVAILABLE
    if AVAILABLE:
        from boundgen.models.skinny import row_rstd
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# The fewest rows a call takes the fused kernel for; 0 (the default): never (see the docstring).
MIN_ROWS = int(os.environ.get("BOUNDGEN_GATED_MM_MIN_ROWS", "0"))

# Tiles per (K, I) (hidden, intermediate): (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
# num_stages); sizes not listed take `DEFAULT_TILE`. `bench_gated_mm.py --sweep` times every tile
# of `SWEEP` on the GPU; the fastest belong here.
DEFAULT_TILE = (128, 64, 64, 8, 8, 3)
TILES: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {}
SWEEP = [
    (bm, bn, bk, 8, warps, stages)
    for bm, bn in ((64, 64), (128, 64), (128, 128), (64, 128))
    for bk in (32, 64)
    for warps in (4, 8)
    for stages in (3, 4)
]


def applies(x: torch.Tensor, mlp: nn.Module) -> bool:
    """Whether the fused kernel takes `x` through `mlp`'s gate_up projection: at least
    `MIN_ROWS` rows (when on) and a plain gate_up `nn.Linear` without bias (`skinny.fusable`)."""
    lin = mlp.gate_up_proj
    return (
        MIN_ROWS > 0
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and lin.bias is None
        and skinny.fusable(x, lin)
    )


if AVAILABLE:

    @triton.jit
    def _norm_gated_mm_kernel(
        x_ptr,
        norm_ptr,
        w_ptr,
        out_ptr,
        M,
        stride_x,
        stride_out,
        eps,
        K: tl.constexpr,
        N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # the output tile of this program: row blocks taken GROUP_M at a time, every column block
        # of a group before the next group, so the group's weight tiles stay in L2
        pid = tl.program_id(0)
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        in_group = GROUP_M * blocks_n
        first_m = (pid // in_group) * GROUP_M
        group_m = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        dtype = x_ptr.dtype.element_ty
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        # Inductor launches a user kernel with a Python float typed fp64 (attention/segments.py)
        if not INTERPRET:  # (the interpreter hands scalars over as Python floats)
            eps = tl.cast(eps, tl.float32)
        rstd = row_rstd(x_ptr, rows, row_mask, stride_x, eps, K, BLOCK_K)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            # RMSNorm as eager rounds it: normalised in float32, cast, then times the weight
            g = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * rstd[:, None]).to(dtype)
            a = (g[None, :] * a.to(tl.float32)).to(dtype)
            # weight rows [cols] (gate) and [N + cols] (up), read as [BLOCK_K, BLOCK_N] tiles
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_gate = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w_ptr + (N + cols)[None, :] * K + ks[:, None], mask=w_mask, other=0.0)
            if INTERPRET:  # the CPU interpreter's bf16 dot is wrong: its inputs as float32
                a = a.to(tl.float32)
                w_gate = w_gate.to(tl.float32)
                w_up = w_up.to(tl.float32)
            acc_gate = tl.dot(a, w_gate, acc_gate)
            acc_up = tl.dot(a, w_up, acc_up)
        gate = acc_gate.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        out_mask = row_mask[:, None] & col_mask[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=out_mask)

    def launch_norm_gated_mm(
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        tile: tuple[int, int, int, int, int, int] | None = None,
    ) -> torch.Tensor:
        """`norm_gated_mm` with an explicit tile (what `bench_gated_mm.py` sweeps); None: from
        `TILES`."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        weight = weight.contiguous()
        # K and N from the weight, whose sizes are static; only M, the rows, may be symbolic
        m, k, n = x.shape[0], weight.shape[1], weight.shape[0] // 2
        torch._check(x.shape[1] == k)
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block_m, block_n, block_k, group_m, warps, stages = tile or TILES.get((k, n), DEFAULT_TILE)
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        traceable(_norm_gated_mm_kernel)[grid](
            x,
            norm,
            weight,
            out,
            m,
            x.stride(0),
            out.stride(0),
            eps,
            K=k,
            N=n,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            INTERPRET=not x.is_cuda,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    @triton_op("boundgen::norm_gated_mm", mutates_args=())
    def norm_gated_mm(
        x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor:
        """SiLU(g)·u with [g | u] = RMSNorm(x; norm, eps) @ weight.T: x [M, K], weight [2I, K] →
        [M, I], tiles from `TILES`."""
        return launch_norm_gated_mm(x, norm, eps, weight)
