"""A prefill bucket's GEMMs with their pointwise pass as the epilogue, TMA-fed persistent Triton
kernels: gate_up with SiLU·mul (`gated`), qkv (+ bias) with the q/k rotation (`rotated`). The
GEMM's output goes straight to what the next op reads; no pointwise kernel reads it back.

On the H200 (forty-third session) W2's graph (1,920 rows) spent 1,152 µs in cuBLAS's gate_up
(~450 TFLOPS) and 309 µs in Inductor's SiLU·mul, a memory pass over the [T, 2I] output; 240 µs
in qkv + bias and 167 µs in the q/k rotation (~7 µs a layer for a 4.4 MB read). The eleventh
session's fused gate_up (pointer loads, the RMSNorm scaled into x on the operand path) ran at
~300 TFLOPS and lost 1.5x; these kernels keep the operand path plain: the Tensor Memory
Accelerator copies x's tile and the weight's tiles into shared memory, two `tl.dot`s a K step
feed two float32 accumulators — gate's and up's rows of a column tile (`cols`, `I + cols`: the
checkpoint's [2I, K] layout), or a head's first and second halves (RoPE pairs column d with
d + D/2, HF's rotate-half) — and each output tile is written once. Persistent: one program an
SM walks the output tiles, `GROUP_M` row tiles together so their weight tiles come from L2.

Numerics as the few-row kernels': SiLU·mul on the float32 accumulators, rounded once (the plain
path rounds gate_up's output first); qkv's output rounded to x's dtype, then rotated in float32
and rounded again, as Inductor's rotation of the plain GEMM's output (`stream_qkv.reference`).

Off by default until W2 and W1 measure them in their buckets (`benchmarks/bench_bucket_tma.py`
times them alone): `BOUNDGEN_BUCKET_GATED=1` (`GATED`), `BOUNDGEN_BUCKET_QKV=1` (`ROTATED`).
They take the calls of more than `stream.MAX_ROWS` rows (fewer stream through
`models/stream_gated.py` and `models/stream_qkv.py`) with a static row count (the prefill
buckets; the compiled beam layers' rows are symbolic), on a GPU with TMA (sm_90+; Triton's
interpreter under `stream.forced()` in the tests). Compiled packages record both switches
(`compile.cache.platform_info`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
from torch import nn

from boundgen import triton_launch
from boundgen.models import stream, stream_qkv
from boundgen.settings import switched

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op
    from triton.tools.tensor_descriptor import TensorDescriptor

    AVAILABLE = stream.AVAILABLE
except Exception:  # pragma: no cover - a Triton without host-side tensor descriptors
    AVAILABLE = False

GATED = os.environ.get("BOUNDGEN_BUCKET_GATED", "0") == "1"
ROTATED = os.environ.get("BOUNDGEN_BUCKET_QKV", "0") == "1"
# Tiles: rows, output columns (of each half), K a step, row tiles walked together, warps,
# stages. First guesses for Hopper, to be swept (`bench_bucket_tma.py`): a warpgroup per 64 rows;
# qkv's columns a tile are at most a head's half (`qkv_tile`).
GATED_TILE = (128, 64, 64, 8, 8, 4)
QKV_TILE = (128, 32, 64, 8, 8, 4)


@contextlib.contextmanager
def enabled(gated: bool, rotated: bool) -> Iterator[None]:
    """Inside: a bucket's gate_up + SiLU·mul (`GATED`) and qkv + rotation (`ROTATED`) take the
    kernels or not; read when a layer traces or compiles (an A/B's switch)."""
    with switched(globals(), "GATED", gated), switched(globals(), "ROTATED", rotated):
        yield


@functools.cache
def _tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _takes(x: torch.Tensor, linear: nn.Module, out_columns: int) -> bool:
    """What both kernels ask of a call: a 2-D x of a static row count past `stream.MAX_ROWS`, a
    plain `nn.Linear`, 16-byte row strides for x, the weight and the output (TMA's rule),
    bf16/fp16 on a TMA GPU (or the interpreter under `stream.forced()`)."""
    if not AVAILABLE or x.dim() != 2 or not isinstance(x.shape[0], int):
        return False
    if x.shape[0] <= stream.MAX_ROWS or type(linear) is not nn.Linear:
        return False
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (out_columns * size) % 16:
        return False
    if x.is_cuda and not _tma(x.device.index if x.device.index is not None else 0):
        return False
    return triton_launch.takes(x, [linear.weight])


def applies(x: torch.Tensor, gate_up: nn.Module) -> bool:
    """Whether `gated` takes `x` through `gate_up` and SiLU·mul: on (`GATED`), no bias, and what
    `_takes` asks."""
    if not GATED or getattr(gate_up, "bias", None) is not None:
        return False
    return _takes(x, gate_up, gate_up.weight.shape[0] // 2)


def qkv_tile(head_dim: int) -> tuple[int, ...]:
    """`QKV_TILE` with its columns cut to a head's half where that is fewer."""
    block_m, block_h, *rest = QKV_TILE
    return (block_m, min(block_h, head_dim // 2), *rest)


def rotates(x: torch.Tensor, qkv: nn.Module, head_dim: int) -> bool:
    """Whether `rotated` takes `x` through the qkv projection `qkv` and the rotation: on
    (`ROTATED`), heads whose halves hold whole tiles of at least 16 columns (`tl.dot`'s least),
    and what `_takes` asks. The caller checks that q and k rotate together."""
    if not ROTATED or head_dim % 2:
        return False
    block_h = qkv_tile(head_dim)[1]
    if block_h < 16 or (head_dim // 2) % block_h:
        return False
    return _takes(x, qkv, qkv.weight.shape[0])


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
    def _two_products(
        x_desc, w_desc, off_m, a, b, K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """X[off_m:][:BLOCK_M] @ W[a:a + BLOCK_N].T and the same of W[b:], two float32
        accumulators [BLOCK_M, BLOCK_N] over all of K (x's tile loaded once for both)."""
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([off_m, k])
            w_a = w_desc.load([a, k])
            w_b = w_desc.load([b, k])
            if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                x, w_a, w_b = x.to(tl.float32), w_a.to(tl.float32), w_b.to(tl.float32)
            acc_a = tl.dot(x, w_a.T, acc_a, input_precision=PRECISION)
            acc_b = tl.dot(x, w_b.T, acc_b, input_precision=PRECISION)
        return acc_a, acc_b

    @triton.jit
    def _gated_kernel(
        x_desc, w_desc, o_desc, M, INTER: tl.constexpr, K: tl.constexpr,
        PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """Out[rows, cols] = SiLU(X[rows] @ W[cols].T) · (X[rows] @ W[INTER + cols].T), W =
        gate_up's weight [2·INTER, K], for each output tile this program walks."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(INTER, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
            pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
            gate, up = _two_products(
                x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, INTER + pid_n * BLOCK_N, K,
                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRET,
            )  # fmt: skip
            h = gate * tl.sigmoid(gate) * up
            o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h.to(o_desc.dtype))

    @triton.jit
    def _qkv_kernel(
        x_desc, w_desc, o_desc, Bias, Cos, Sin, M, stride_rope, N: tl.constexpr,
        K: tl.constexpr, HEAD_D: tl.constexpr, ROT_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
        PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """Out[rows, lo:lo + BLOCK_H] and Out[rows, lo + D/2:…] for each tile of `BLOCK_H`
        pairs of one head this program walks (lo = head·D + d0): X @ W[lo…].T and
        X @ W[lo + D/2…].T (+ bias), rounded to Out's dtype, then rotated by cos/sin [T, D/2]
        of the rows where the head is one of q's or k's (columns before ROT_COLS)."""
        HALF: tl.constexpr = HEAD_D // 2
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = N // 2 // BLOCK_H
        dtype = o_desc.dtype
        cols = tl.arange(0, BLOCK_H)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
            pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
            pair = pid_n * BLOCK_H  # the tile's first pair: head · D/2 + d0
            d0 = pair % HALF
            lo = (pair // HALF) * HEAD_D + d0
            acc_lo, acc_hi = _two_products(
                x_desc, w_desc, pid_m * BLOCK_M, lo, lo + HALF, K, BLOCK_M, BLOCK_H, BLOCK_K,
                PRECISION, INTERPRET,
            )  # fmt: skip
            if HAS_BIAS:
                acc_lo += tl.load(Bias + lo + cols).to(tl.float32)[None, :]
                acc_hi += tl.load(Bias + lo + HALF + cols).to(tl.float32)[None, :]
            # the plain GEMM's output, rounded; rotated in float32 from it and rounded once
            x1 = acc_lo.to(dtype).to(tl.float32)
            x2 = acc_hi.to(dtype).to(tl.float32)
            if lo < ROT_COLS:  # (a tile is one head: q's or k's, or v's)
                rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = (rows < M)[:, None]
                at = rows.to(tl.int64)[:, None] * stride_rope + (d0 + cols)[None, :]
                cos = tl.load(Cos + at, mask=row_ok, other=0.0).to(tl.float32)
                sin = tl.load(Sin + at, mask=row_ok, other=0.0).to(tl.float32)
                x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            o_desc.store([pid_m * BLOCK_M, lo], x1.to(dtype))
            o_desc.store([pid_m * BLOCK_M, lo + HALF], x2.to(dtype))

    def programs(tiles: int, x: torch.Tensor) -> int:
        """One program an SM (at most one a tile); the interpreter's: a few, to walk tiles."""
        if not x.is_cuda:
            return min(tiles, 3)
        return min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)

    def _run(kernel, tiles, x, weight, out, tile, weight_rows, **args) -> None:
        """`kernel` over `tiles` output tiles, one program an SM, with x's, the weight's
        (`weight_rows` × BLOCK_K a load) and the output's descriptors."""
        block_m, block_n, block_k, group_m, warps, stages = tile
        count = programs(tiles, x)
        triton_launch.traceable(kernel)[(count,)](
            TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [weight_rows, block_k]),
            TensorDescriptor.from_tensor(out, [block_m, block_n]),
            **args,
            K=x.shape[1],
            PROGRAMS=count,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda,
            num_warps=warps,
            num_stages=stages,
        )

    def launch_gated(x: torch.Tensor, weight: torch.Tensor, tile=None) -> torch.Tensor:
        """SiLU(x @ gate.T) · (x @ up.T) [M, I] in x's dtype, weight = [gate; up] [2I, K];
        `tile` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), `GATED_TILE` when not
        given (what the op and `bench_bucket_tma.py` call)."""
        x, weight = x.contiguous(), weight.contiguous()
        tile = tile or GATED_TILE
        torch._check(weight.shape[0] % 2 == 0 and weight.shape[1] == x.shape[1])
        m, inter = x.shape[0], weight.shape[0] // 2
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
        tiles = triton.cdiv(m, tile[0]) * triton.cdiv(inter, tile[1])
        _run(_gated_kernel, tiles, x, weight, out, tile, tile[1], M=m, INTER=inter,
             BLOCK_N=tile[1])  # fmt: skip
        return out

    def launch_qkv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated_columns: int,
        tile=None,
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) [M, N] in x's dtype with the heads of its first
        `rotated_columns` columns rotated by cos, sin ([M, 1, D/2] or [M, D/2]); `tile` as
        `launch_gated`'s with BLOCK_N the pairs a tile (≤ D/2), `qkv_tile` when not given."""
        x, weight = x.contiguous(), weight.contiguous()
        half = cos.shape[-1]
        tile = tile or qkv_tile(2 * half)
        n = weight.shape[0]
        torch._check(n % (2 * half) == 0 and half % tile[1] == 0 and weight.shape[1] == x.shape[1])
        cos, sin = stream_qkv.rope_rows(cos, sin)
        m = x.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        tiles = triton.cdiv(m, tile[0]) * (n // 2 // tile[1])
        _run(
            _qkv_kernel, tiles, x, weight, out, tile, tile[1],
            Bias=bias if bias is not None else weight, Cos=cos, Sin=sin, M=m,
            stride_rope=cos.stride(0), N=n, HEAD_D=2 * half, ROT_COLS=rotated_columns,
            HAS_BIAS=bias is not None, BLOCK_H=tile[1],
        )  # fmt: skip
        return out

    @triton_op("boundgen::bucket_gated", mutates_args=())
    def _bucket_gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return launch_gated(x, weight)

    @triton_op("boundgen::bucket_qkv", mutates_args=())
    def _bucket_qkv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated_columns: int,
    ) -> torch.Tensor:
        return launch_qkv(x, weight, bias, cos, sin, rotated_columns)


def gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate.T) · (x @ up.T): x [M, K], weight = gate_up's [2I, K] → [M, I] in x's
    dtype."""
    return torch.ops.boundgen.bucket_gated(x, weight)


def rotated(x, weight, bias, cos, sin, rotated_columns: int) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) with q's and k's heads (its first `rotated_columns`
    columns) rotated → [M, N] in x's dtype, as `stream_qkv.rotated` at a bucket's rows
    (`Attention.heads(..., rotate=False)` takes it)."""
    return torch.ops.boundgen.bucket_qkv(x, weight, bias, cos, sin, rotated_columns)
