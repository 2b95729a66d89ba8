"""A prefill bucket's gate_up with SiLU·mul as its epilogue: one Triton GEMM whose output is the
MLP's hidden h = SiLU(x @ gate.T) · (x @ up.T); gate_up's [T, 2I] output is never written and
no pointwise kernel reads it back.

On the H200 (forty-third session) W2's graph (1,920 rows) spent 1,152 µs in cuBLAS's gate_up
(~450 TFLOPS) and 309 µs in Inductor's SiLU·mul, a memory pass over the [T, 2I] output. Timed
alone (forty-seventh session, H200, `benchmarks/bench_bucket_gated.py`) two float32
accumulators a tile — gate's and up's rows of a column tile (`cols`, `I + cols`: the
checkpoint's [2I, K] layout), x's tile loaded once for both — with the epilogue on them beat
cuBLAS + SiLU·mul at every bucket size, more the larger: 59.3 against 63.2 µs a layer at 1,920
rows, 227 against 256 at 8,192, 409 against 502 at 14,912 (128 × 64 tiles, K 64 a step, three
stages, a program a tile). That run fed shared memory by host-side TMA descriptors, which
`torch.compile` and AOTInductor (torch 2.11) cannot carry into a package; this kernel loads
through pointers (Triton pipelines them with `cp.async` on Hopper). On an H100 it ran 65.5 µs
against cuBLAS + SiLU·mul's 68.0 at 1,920 rows, 242 against 280 at 8,192 and 430 against 506 at
14,912 (TMA-fed: 60.4 / 233 / 463; descriptors made in the kernel lost everywhere), and took
W2's call 0.08 ms shorter (interleaved, twice). Persistent programs (one an SM walking the
tiles) with host-made descriptors lost (67–82 µs at 1,920 rows on the H200); with descriptors
made in the kernel they are `PERSISTENT` below. qkv + bias with the q/k
rotation as the epilogue of the same kind of kernel lost 1.7–1.9x to cuBLAS + the rotation at
every size (removed).

Numerics as `stream_gated`'s: SiLU·mul on the float32 accumulators, rounded once (the plain path
rounds gate_up's output first).

On by default since the forty-eighth session: the whole GPU suite passed with it on (86 passed,
H100) and W1 in the planner's buckets ran 576.2K → 590.2K tok/s with the GPU busy 67.3 → 62.7 ms a
call, 587.7K → 621.6K once the pieces no longer waited for each other (H100, `run_h200.sh
w1-gated`); `BOUNDGEN_BUCKET_GATED=0` (`GATED`) turns it off. It takes the calls of more than
`stream.MAX_ROWS` rows (fewer stream through `models/stream_gated.py`) with a static row count (the
prefill buckets; the compiled beam layers' rows are symbolic), bf16/fp16 on CUDA (Triton's
interpreter under `stream.forced()` in the tests). Compiled packages record the switch
(`compile.cache.platform_info`).

`BOUNDGEN_BUCKET_GATED=persist` (`PERSISTENT`, opt-in until measured in W1 and W2): the same
product by persistent programs, one an SM walking the output tiles in the grouped order, each
tile's operands fed to shared memory by TMA through descriptors the kernel makes
(`tl.make_tensor_descriptor`: a compiled package can carry them, host-made ones it cannot; their
global scratch comes from Triton's allocator, which AOTInductor's and Inductor's launchers set
and `launch_gated` sets on its thread). On an H100 (fifty-first session,
`bench_bucket_gated.py`'s `tma-persist`, the same tile) it ran 64.5 µs against this kernel's
65.2 at 1,920 rows, 239.6 against 255.6 at 8,192 and 439.4 against 471.6 at 14,912. It takes
what the pointer kernel takes when K's and I's rows are whole 16-byte multiples (TMA's strides).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from boundgen import triton_launch
from boundgen.models import stream
from boundgen.settings import env_choice, switched

AVAILABLE = stream.AVAILABLE  # Triton and torch's triton_op, as `stream` found them
if AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op

# "0" off, "1" the pointer-fed kernel, "persist" the persistent TMA-fed one
FORMS = ("0", "1", "persist")


def _switches(form: str) -> tuple[bool, bool]:
    """(`GATED`, `PERSISTENT`) of `BOUNDGEN_BUCKET_GATED=form` (checked: one of `FORMS`)."""
    env_choice("BOUNDGEN_BUCKET_GATED", form, FORMS)
    return form != "0", form == "persist"


GATED, PERSISTENT = _switches(os.environ.get("BOUNDGEN_BUCKET_GATED", "1"))
# Tile: rows, output columns (of each half), K a step, row tiles walked together, warps, stages.
# This kernel's best at W1's 14,912 rows on an H100 (forty-seventh session: 430 µs, the next
# 478) and within 0.4 µs of its best at W2's 1,920 (65.5 against 65.2; a warpgroup per 64 rows).
GATED_TILE = (128, 128, 64, 8, 8, 3)


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Inside: a bucket's gate_up + SiLU·mul takes the kernel (`GATED`) or not; read when a layer
    traces or compiles (an A/B's switch)."""
    with switched(globals(), "GATED", on):
        yield


def set_form(form: str) -> None:
    """`GATED` and `PERSISTENT` as `BOUNDGEN_BUCKET_GATED=form` sets them (an A/B's sides,
    read when the buckets trace)."""
    global GATED, PERSISTENT
    GATED, PERSISTENT = _switches(form)


def applies(x: torch.Tensor, gate_up: nn.Module) -> bool:
    """Whether `gated` takes `x` through `gate_up` and SiLU·mul: on (`GATED`), a 2-D x of a
    static row count past `stream.MAX_ROWS`, a plain `nn.Linear` without bias, bf16/fp16 on
    CUDA (or the interpreter under `stream.forced()`)."""
    if not (GATED and AVAILABLE) or x.dim() != 2 or not isinstance(x.shape[0], int):
        return False
    if x.shape[0] <= stream.MAX_ROWS or type(gate_up) is not nn.Linear:
        return False
    if gate_up.bias is not None or gate_up.weight.shape[0] % 2:
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
    def _gated_kernel(
        X, W, Out, M, INTER: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """Out[rows, cols] = SiLU(X[rows] @ W[cols].T) · (X[rows] @ W[INTER + cols].T) of this
        program's output tile, W = gate_up's weight [2·INTER, K], X [M, K] and Out [M, INTER]
        contiguous."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(INTER, BLOCK_N)
        pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        # rows and columns past the edge load row M - 1's and column INTER - 1's operands
        # (wrapped, as Triton's matmul does): every load in bounds and unmasked, which keeps
        # the pipeline's copies whole; their results are never stored
        x_at = X + (rows % M).to(tl.int64)[:, None] * K + ks[None, :]
        gate_at = W + (cols % INTER).to(tl.int64)[:, None] * K + ks[None, :]
        up_at = gate_at + INTER * K
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                x = tl.load(x_at + k)
                w_gate = tl.load(gate_at + k)
                w_up = tl.load(up_at + k)
            else:  # a last step past K: its columns read as zeros
                k_ok = (k + ks < K)[None, :]
                x = tl.load(x_at + k, mask=k_ok, other=0.0)
                w_gate = tl.load(gate_at + k, mask=k_ok, other=0.0)
                w_up = tl.load(up_at + k, mask=k_ok, other=0.0)
            if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            gate = tl.dot(x, w_gate.T, gate, input_precision=PRECISION)
            up = tl.dot(x, w_up.T, up, input_precision=PRECISION)
        h = gate * tl.sigmoid(gate) * up
        out_at = Out + rows.to(tl.int64)[:, None] * INTER + cols[None, :]
        tl.store(
            out_at, h.to(Out.dtype.element_ty), mask=(rows < M)[:, None] & (cols < INTER)[None, :]
        )

    @triton.jit
    def _gated_persistent_kernel(
        X, W, Out, M, INTER: tl.constexpr, K: tl.constexpr, PROGRAMS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """`_gated_kernel`'s product by PROGRAMS persistent programs, program p taking output
        tiles p, p + PROGRAMS, …; operands loaded by TMA through descriptors made here. Past
        the edges TMA reads zeros and drops stores; a gate tile past column INTER reads up's
        first rows, never stored."""
        x_desc = tl.make_tensor_descriptor(X, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W, [2 * INTER, K], [K, 1], [BLOCK_N, BLOCK_K])
        o_desc = tl.make_tensor_descriptor(Out, [M, INTER], [INTER, 1], [BLOCK_M, BLOCK_N])
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(INTER, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
            pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                x = x_desc.load([off_m, k])
                w_gate = w_desc.load([off_n, k])
                w_up = w_desc.load([INTER + off_n, k])
                if INTERPRET:  # as in `_gated_kernel`
                    x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
                gate = tl.dot(x, w_gate.T, gate, input_precision=PRECISION)
                up = tl.dot(x, w_up.T, up, input_precision=PRECISION)
            h = gate * tl.sigmoid(gate) * up
            o_desc.store([off_m, off_n], h.to(o_desc.dtype))

    def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's allocator: the global scratch the persistent kernel's descriptors are made
        in, from torch's caching allocator (a graph's pool while capturing)."""
        return torch.empty(size, dtype=torch.int8, device="cuda")

    def _tma_strides(x: torch.Tensor, inter: int) -> bool:
        """Whether TMA takes x's, the weight's and the output's rows: 16-byte multiples."""
        return (x.shape[1] * x.element_size()) % 16 == 0 and (inter * x.element_size()) % 16 == 0

    def _programs(x: torch.Tensor, tiles: int) -> int:
        """The persistent grid: an SM a program (4 in the interpreter), at most a tile each."""
        sms = triton_launch.multiprocessors(x.device) if x.is_cuda else 4
        return min(sms, tiles)

    def launch_gated(
        x: torch.Tensor, weight: torch.Tensor, tile=None, persistent: bool | None = None
    ) -> torch.Tensor:
        """SiLU(x @ gate.T) · (x @ up.T) [M, I] in x's dtype, weight = [gate; up] [2I, K];
        `tile` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), `GATED_TILE` when not
        given (what the op and `bench_bucket_gated.py` call); `persistent`: the persistent TMA
        kernel (`PERSISTENT` when not given) where TMA takes the rows (`_tma_strides`)."""
        x, weight = x.contiguous(), weight.contiguous()
        block_m, block_n, block_k, group_m, warps, stages = tile or GATED_TILE
        torch._check(weight.shape[0] % 2 == 0 and weight.shape[1] == x.shape[1])
        m, inter = x.shape[0], weight.shape[0] // 2
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(inter, block_n)
        if (PERSISTENT if persistent is None else persistent) and _tma_strides(x, inter):
            if x.is_cuda:  # on this thread (a context variable: each thread starts without
                # one), as Inductor's launcher sets its own before each run; AOTInductor's
                # allocates the scratch itself
                triton.set_allocator(_scratch)
            programs = _programs(x, tiles)
            triton_launch.traceable(_gated_persistent_kernel)[(programs,)](
                x, weight, out, m, INTER=inter, K=x.shape[1], PROGRAMS=programs, BLOCK_M=block_m,
                BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                PRECISION=triton_launch.dot_precision(x), INTERPRET=not x.is_cuda,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            return out
        triton_launch.traceable(_gated_kernel)[(tiles,)](
            x, weight, out, m, INTER=inter, K=x.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, GROUP_M=group_m, PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    @triton_op("boundgen::bucket_gated", mutates_args=())
    def _bucket_gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return launch_gated(x, weight)


def gated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate.T) · (x @ up.T): x [M, K], weight = gate_up's [2I, K] → [M, I] in x's
    dtype."""
    return torch.ops.boundgen.bucket_gated(x, weight)
