"""The MLP's gate_up projection and SiLU·mul for few rows as one weight-streaming Triton GEMM
whose epilogue computes SiLU(gate)·up: the down projection's input, without gate_up's output
ever written.

At 16–128 rows cuBLAS runs gate_up (K 896 × N 9,728) near its weights' bandwidth (9.0–9.3 µs on
an H100, ~1.9 TB/s), and a kernel of Inductor's then computes SiLU·mul (1.5 µs and one more
launch a layer: 36 µs and 24 launches of W3's 225; BENCHMARKS.md, thirty-eighth session). The
streamed kernel (`models/stream.py`'s tile, one K split) ran gate_up alone in 8.6–9.1 µs
(`bench_weight_stream.py`, thirty-sixth session). Here a program streams both halves' rows of its
column tile (gate's `cols`, up's `I + cols`) into two float32 accumulators over all of K (SiLU is
not linear: no K split), then writes SiLU(gate)·up once, rounded to x's dtype. Computing SiLU·mul
as `down` loads its input instead lost (each of its column tiles recomputed it: W3's GPU busy
827 → 1,066 µs).

Numerics: gate and up stay float32 into SiLU·mul (the plain path rounds gate_up's output to bf16
first), rounded once.

On by default since the thirty-ninth session (`GATED`; `BOUNDGEN_STREAM_GATED=0` turns it off): on
an H100 W3's GPU busy 823 → 791 µs and its runner 1.129 → 1.090 ms, W4's trie searches 5.55 → 5.46
(one prompt) and 7.03 → 6.88 ms (eight), the children's head 5.68 → 5.46 and 6.85 → 6.65. It takes
the calls `stream.applies` takes (at most `stream.MAX_ROWS` rows). Compiled packages record the
switch (`compile.cache.platform_info`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from boundgen import grid_dependency
from boundgen.models import stream
from boundgen.settings import switched

AVAILABLE = stream.AVAILABLE  # Triton and torch's triton_op, as `stream` found them
if AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.grid_dependency import await_inputs
    from boundgen.models.stream import two_products

GATED = os.environ.get("BOUNDGEN_STREAM_GATED", "1") == "1"
# Tiles (columns of each half a program, K a step, warps, stages), swept on an H100 at gate_up's
# shape (`bench_weight_stream.py --shapes gated`, thirty-ninth session). One row tile (≤ 64 rows):
# 64 × 128, 4 stages — 8.6 µs at 16 rows, 9.7 at 64 (cuBLAS + SiLU·mul 10.6 / 11.0; the first
# guess, 32 × 128 with 3 stages, 9.5 / 11.4). Two row tiles (65–128 rows, or rows unknown when
# traced): K 64 a step — 11.6 µs at 128 rows (cuBLAS + SiLU·mul 12.0), where 128 a step took 15.2:
# its 48 KB a stage, 4 stages, leave one program an SM, and 152 programs then run in two waves.
ONE_ROW_TILE = (64, 128, 4, 4)
ROW_TILES = (64, 64, 4, 4)


def tile_for(m) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for `m` rows (symbolic in the compiled beam layers,
    whose rows reach `stream.MAX_ROWS`)."""
    return ONE_ROW_TILE if isinstance(m, int) and m <= 64 else ROW_TILES


def enabled(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: gate_up + SiLU·mul take the kernel (`GATED`) or not; read when a layer traces,
    compiles or is captured (an A/B's switch)."""
    return switched(globals(), "GATED", on)


def applies(x: torch.Tensor, gate_up: nn.Module) -> bool:
    """Whether the kernel takes `x` through `gate_up` and SiLU·mul: on (`GATED`) and a call
    `stream.applies` takes (plain `nn.Linear` without a bias, at most `stream.MAX_ROWS` rows,
    bf16/fp16 on CUDA or the interpreter under `stream.forced()`)."""
    return GATED and stream.applies(x, gate_up)


if AVAILABLE:

    @grid_dependency.awaits
    @triton.jit
    def _gated_kernel(
        X,
        W,
        Out,
        M,
        stride_xm,
        K: tl.constexpr,
        I: tl.constexpr,  # noqa: E741 - the intermediate size, as in the docstring
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Out[rows, cols] = SiLU(X[rows] @ W[cols].T) · (X[rows] @ W[I + cols].T) over this
        program's column tile and row tile, W = gate_up's weight [2I, K] (gate's rows, then
        up's)."""
        await_inputs(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < I
        row_ok = rows < M
        gate, up = two_products(
            X, W, rows, row_ok, cols, col_ok, stride_xm, K, I, BLOCK_N, BLOCK_M, BLOCK_K,
            PRECISION, INTERPRET,
        )  # fmt: skip
        h = gate * tl.sigmoid(gate) * up
        out = Out + rows.to(tl.int64)[None, :] * I + cols[:, None]
        tl.store(out, h.to(Out.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])

    def launch(x: torch.Tensor, weight: torch.Tensor, tile: tuple | None = None) -> torch.Tensor:
        """The kernel (what the op and `bench_weight_stream.py` call): SiLU(x @ gate.T) ·
        (x @ up.T) [M, I] in x's dtype, weight = [gate; up] [2I, K]; `tile` (BLOCK_N, BLOCK_K,
        warps, stages), `tile_for` the rows' when not given."""
        x, weight, block_m = stream.operands(x, weight)
        block_n, block_k, warps, stages = tile or tile_for(x.shape[0])
        two_i, k = weight.shape
        torch._check(two_i % 2 == 0)
        i = two_i // 2
        out = torch.empty((x.shape[0], i), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(i, block_n), triton.cdiv(x.shape[0], block_m))
        tile = (block_m, block_n, block_k, warps, stages)
        stream.run(_gated_kernel, grid, x, weight, out, tile, K=k, I=i)
        return out

    @triton_op("boundgen::stream_gated", mutates_args=())
    def _stream_gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return launch(x, weight)


def gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate.T) · (x @ up.T): x [M, K], weight = gate_up's [2I, K] → [M, I] in x's
    dtype."""
    return torch.ops.boundgen.stream_gated(x, weight)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What `gated` computes, in float32, rounded once to x's dtype (the tests' oracle)."""
    gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
