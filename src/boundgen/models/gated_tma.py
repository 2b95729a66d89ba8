"""The MLP's gate_up projection and SiLU·mul at a prefill bucket's rows (more than
`stream.MAX_ROWS`) as one TMA-fed Triton GEMM whose epilogue computes SiLU(gate)·up: gate_up's
[T, 2I] output is never written, and no SiLU·mul kernel reads it back.

On the H200 (forty-third session) W2's graph spent 1,152 µs in cuBLAS's gate_up (24 layers,
~450 TFLOPS at 1,920 rows) and 309 µs in Inductor's SiLU·mul, a memory pass. The eleventh
session's fused kernel (pointer loads, the RMSNorm scaled into x on the operand path) ran at
~300 TFLOPS and lost 1.5x; this one keeps the operand path plain: the Tensor Memory Accelerator
copies x's tile and the tile of gate's and of up's rows (the checkpoint's [2I, K] layout:
`cols`, `I + cols`) into shared memory, two `tl.dot`s a K step feed two float32 accumulators,
and each output tile is written once, rounded to x's dtype (the plain path rounds gate_up's
output to bf16 before SiLU·mul: a difference within bf16's rounding). Persistent: one program an
SM walks the output tiles, `GROUP_M` row tiles together so their weight tiles are read from L2.

`BOUNDGEN_GATED_TMA=1` (`GATED`) turns it on; off by default until W2 and W1 measure it in their
buckets (`benchmarks/bench_gated_tma.py` times it alone). It takes the calls of more than
`stream.MAX_ROWS` rows (fewer stream through `models/stream_gated.py`), with static rows (the
prefill buckets; the compiled beam layers' rows are symbolic), on a GPU with TMA (sm_90+; the
interpreter under `stream.forced()` in the tests). Compiled packages record the switch
(`compile.cache.platform_info`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import nn

from boundgen import triton_launch
from boundgen.models import stream
from boundgen.settings import switched

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op
    from triton.tools.tensor_descriptor import TensorDescriptor

    AVAILABLE = stream.AVAILABLE
except Exception:  # pragma: no cover - a Triton without host-side tensor descriptors
    AVAILABLE = False

GATED = os.environ.get("BOUNDGEN_GATED_TMA", "0") == "1"
# Tile: rows, output columns (of each half), K a step, row tiles walked together, warps, stages
TILE = (128, 64, 64, 8, 8, 4)


def enabled(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: gate_up + SiLU·mul at a bucket's rows take the kernel (`GATED`) or not; read when a
    layer traces or compiles (an A/B's switch)."""
    return switched(globals(), "GATED", on)


@functools.cache
def _tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def applies(x: torch.Tensor, gate_up: nn.Module) -> bool:
    """Whether the kernel takes `x` through `gate_up` and SiLU·mul: on (`GATED`), a plain
    `nn.Linear` without a bias, more than `stream.MAX_ROWS` rows and a static row count, rows of
    16-byte multiples (TMA's stride rule), bf16/fp16 on a TMA GPU (or the interpreter under
    `stream.forced()`)."""
    if not (GATED and AVAILABLE) or x.dim() != 2 or not isinstance(x.shape[0], int):
        return False
    if x.shape[0] <= stream.MAX_ROWS:
        return False
    if type(gate_up) is not nn.Linear or gate_up.bias is not None:
        return False
    size = x.element_size()  # x's rows, the weight's and the output's: TMA wants 16-byte strides
    if (x.shape[1] * size) % 16 or (gate_up.weight.shape[0] // 2 * size) % 16:
        return False
    if x.is_cuda and not _tma(x.device.index if x.device.index is not None else 0):
        return False
    return triton_launch.takes(x, [gate_up.weight])


if AVAILABLE:

    @triton.jit
    def _tile_of(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """Output tile `tile` → (row tile, column tile): GROUP_M row tiles walk the column
        tiles together, so a weight tile one of them loads is in L2 for the others."""
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m

    @triton.jit
    def _gated_tma_kernel(
        x_desc,
        w_desc,
        o_desc,
        M,
        INTER: tl.constexpr,
        K: tl.constexpr,
        PROGRAMS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """Out[rows, cols] = SiLU(X[rows] @ W[cols].T) · (X[rows] @ W[INTER + cols].T), W =
        gate_up's weight [2·INTER, K], for each output tile this program walks."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(INTER, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
            pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k])
                g = w_desc.load([pid_n * BLOCK_N, k])
                u = w_desc.load([INTER + pid_n * BLOCK_N, k])
                if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                    x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
                gate = tl.dot(x, g.T, gate, input_precision=PRECISION)
                up = tl.dot(x, u.T, up, input_precision=PRECISION)
            h = gate * tl.sigmoid(gate) * up
            o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h.to(o_desc.dtype))

    def programs(tiles: int, x: torch.Tensor) -> int:
        """One program an SM (at most one a tile); the interpreter's: a few, to walk tiles."""
        if not x.is_cuda:
            return min(tiles, 3)
        return min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)

    def launch(x: torch.Tensor, weight: torch.Tensor, tile: tuple | None = None) -> torch.Tensor:
        """The kernel (what the op and `bench_gated_tma.py` call): SiLU(x @ gate.T) · (x @ up.T)
        [M, I] in x's dtype, weight = [gate; up] [2I, K]; `tile` (BLOCK_M, BLOCK_N, BLOCK_K,
        GROUP_M, warps, stages), `TILE` when not given."""
        x, weight = x.contiguous(), weight.contiguous()
        block_m, block_n, block_k, group_m, warps, stages = tile or TILE
        m, k = x.shape
        inter = weight.shape[0] // 2
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
        count = programs(triton.cdiv(m, block_m) * triton.cdiv(inter, block_n), x)
        triton_launch.traceable(_gated_tma_kernel)[(count,)](
            TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            TensorDescriptor.from_tensor(out, [block_m, block_n]),
            m,
            INTER=inter,
            K=k,
            PROGRAMS=count,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    @triton_op("boundgen::gated_tma", mutates_args=())
    def _gated_tma(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return launch(x, weight)


def gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate.T) · (x @ up.T): x [M, K], weight = gate_up's [2I, K] → [M, I] in x's
    dtype."""
    return torch.ops.boundgen.gated_tma(x, weight)
