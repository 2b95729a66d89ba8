"""A decoder layer's linear layers for few rows, each fused with the ops around it (Triton).

At a beam-search decode step (B·W = 16–64 rows) or a short prompt (W3: 64 tokens) a layer is
~10–15 kernels of a few microseconds each: RMSNorm, the qkv GEMM, the o_proj GEMM and its residual
add, RMSNorm again, gate_up, SiLU·mul, down (cuBLAS's split-K GEMM, then its `splitKreduce`) and
its residual add. The GEMMs only stream their weights (M rows ≪ the weights' K × N); everything
else is launch latency and ~1.6 µs gaps between kernels inside a CUDA graph (BENCHMARKS.md,
2026-12-01: a W4 search is 1,825 kernels, 2.9 ms of its 8.4 ms idle between them). Here each
linear layer takes its neighbours into one kernel:

    norm_linear      y = RMSNorm(x) @ W.T (+ bias), its q and k    (input norm + qkv + RoPE)
                     heads rotated
    norm_gated       y = SiLU(g) · u, [g | u] = RMSNorm(x) @ W.T  (post-attention norm + gate_up
                                                                   + SiLU·mul)
    linear_residual  y = r + x @ W.T                              (o_proj, down + residual)

At a decode step `norm_linear` also writes the rotated k and the v into the beams' cache slot and
returns q alone, its heads in KV-head order where the attention takes a KV head's queries as rows
(`DecoderLayer.decode_input`): the rotation, q's reordering and the slot's write were one or two
kernels more a layer-step (72 a W4 search each).

Each program streams a [BLOCK_N, K_SPLIT] slice of W once for all its rows (swap-AB: the weight
tile is the dot's left operand, so the rows may be as few as 16; BLOCK_M 16, 32 or 64 by the
rows). A call with few column tiles splits K over more programs (`SPLIT_K`): each leaves its
partial sums in a workspace and counts itself in on its tile's counter, and the last to arrive
sums the partials in split order and finishes the tile — one kernel, where cuBLAS's split-K needs
a second. It also sets the counter back to zero, so the calls of one forward (or decode step) run
on one counter buffer that the forward zeroes once (`counters`; `DecoderModel.forward` and the
beam layers pass it down): a buffer zeroed per call would be a fill kernel per GEMM.

RMSNorm is linear in its row scale, RMSNorm(x) @ W.T = rstd · ((x · norm) @ W.T), so the programs
multiply x by the norm weight as they load it, sum each row's squares over their part of K, and
scale the summed tile by 1/rms: no program reads its rows twice, and a split of K needs only the
partial sums of squares.

The sixth session's version (one program per 64 columns walking all of K, 64-row blocks, the
norm's rows read twice) lost to cuBLAS + Inductor on the H200 at every shape (BENCHMARKS.md,
2026-12-02): `down` and o_proj, 896 columns, ran 14 programs on 132 multiprocessors.

Numerics: the reduction in float32; x · norm rounded to the activation dtype before the product
(eager rounds x / rms, then its product with the norm); then eager's roundings in eager's order
(gate_up's output rounded before SiLU, SiLU before the product; the GEMM output before the
residual add); the q/k rotation in float32 from the rounded qkv, rounded once, as Inductor's
compiled rotation does (tiles of whole heads: `skinny_tiles.rope_block_n`). The fused layer
differs from the eager one by a unit in the last place or two.

Which tile a call takes (and the table of tiles swept on the device) is `models/skinny_tiles.py`.

The ops are `torch.library.triton_op`s: torch.compile and torch.export + AOTInductor trace into
the kernels, and the same code runs eagerly. Without CUDA they run in Triton's CPU interpreter
(`TRITON_INTERPRET=1`, set before triton is imported), which only the tests use (`forced()`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from boundgen import triton_launch
from boundgen.models import skinny_tiles
from boundgen.settings import switched

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen.triton_launch import traceable

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# The most rows a call takes the fused kernels for; 0 (the default): never. The sixth session's
# version streamed the MLP's weights at ~0.9 TB/s against ~1.6 for cuBLAS + Inductor's fused
# elementwise kernels on the H200, and a compiled W4 search took 9.05 ms with it against 6.79
# without (BENCHMARKS.md, 2026-12-02). The split-K version is not yet measured on the GPU: off
# until its swept tiles (`bench_skinny.py --sweep`) beat Inductor in W3 and W4.
# `BOUNDGEN_SKINNY_MAX_ROWS=64` turns them on (an A/B); compiled packages record the value
# (`compile.cache.platform_info`), so a change rebuilds them.
MAX_ROWS = int(os.environ.get("BOUNDGEN_SKINNY_MAX_ROWS", "0"))

# Inside: the fused kernels also for CPU tensors (Triton's interpreter; the tests' switch)
forced = triton_launch.interpreted


def rows_up_to(rows: int) -> contextlib.AbstractContextManager[None]:
    """Inside: the fused kernels take calls of at most `rows` rows (`MAX_ROWS`; 0: none), read when
    a layer traces, compiles or is captured (an A/B's switch: a benchmark's sides, a test's
    reference path)."""
    return switched(globals(), "MAX_ROWS", rows)


def applies(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether the fused kernels take `x` through `linears`: plain `nn.Linear`s (not FP8's), at
    most `MAX_ROWS` rows, on CUDA in bf16/fp16 (or anywhere under `forced()` with the
    interpreter)."""
    if not AVAILABLE or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    if any(type(lin) is not nn.Linear for lin in linears):
        return False
    return triton_launch.takes(x, [lin.weight for lin in linears])


if AVAILABLE:

    @triton.jit
    def _rotate(
        y,
        rows,
        row_mask,
        cos_ptr,
        sin_ptr,
        stride_rope,
        dtype: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_D: tl.constexpr,
    ):
        """A tile of whole heads [BLOCK_N, BLOCK_M] rotated (HF's rotate-half: d pairs with
        d + D/2) by the rows' cos and sin ([T, D/2] each, rows `stride_rope` apart), in float32
        and rounded once, as Inductor's compiled rotation is."""
        half = tl.reshape(y.to(tl.float32), (BLOCK_N // HEAD_D, 2, HEAD_D // 2, BLOCK_M))
        x1, x2 = tl.split(tl.permute(half, (0, 2, 3, 1)))  # each [heads, D/2, BLOCK_M]
        d = tl.arange(0, HEAD_D // 2)
        at = rows[None, :] * stride_rope + d[:, None]
        cos = tl.load(cos_ptr + at, mask=row_mask[None, :], other=0.0).to(tl.float32)[None, :, :]
        sin = tl.load(sin_ptr + at, mask=row_mask[None, :], other=0.0).to(tl.float32)[None, :, :]
        out = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)  # [heads, D/2, BLOCK_M, 2]
        return tl.reshape(tl.permute(out, (0, 3, 1, 2)), (BLOCK_N, BLOCK_M)).to(dtype)

    @triton.jit
    def _finish(
        acc,
        acc_up,
        ss,
        rows,
        row_mask,
        cols,
        col_mask,
        out_ptr,
        bias_ptr,
        res_ptr,
        cos_ptr,
        sin_ptr,
        kv_ptr,
        step_ptr,
        stride_out,
        stride_res,
        stride_rope,
        stride_kv,
        stride_slot,
        col0,
        eps,
        dtype: tl.constexpr,
        K: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        GATED: tl.constexpr,
        RESIDUAL: tl.constexpr,
        ROT_COLS: tl.constexpr,
        HEAD_D: tl.constexpr,
        KV: tl.constexpr,
        Q_COLS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """The epilogue of a tile whose K is summed: the norm's row scale, bias, the q/k rotation
        (tiles of the first `ROT_COLS` columns), SiLU·mul, residual, then the store (acc
        [BLOCK_N, BLOCK_M]: the output transposed; `col0` its first column). With `KV`, only the
        first `Q_COLS` columns (q) go to the output, their heads in KV-head order with `GROUP` >
        1, and the rest (k, v) to the cache slot read from `step_ptr`."""
        if NORM:
            # Inductor launches a user kernel with a Python float typed fp64 (attention/segments.py)
            if not INTERPRET:  # (the interpreter hands scalars over as Python floats)
                eps = tl.cast(eps, tl.float32)
            # RMSNorm(x) @ W.T = rstd · ((x · norm) @ W.T) per row: the scale after the sum, so
            # no program reads its rows twice and a split of K needs only its rows' partial sums
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            acc = acc * rstd[None, :]
            if GATED:
                acc_up = acc_up * rstd[None, :]
        if BIAS:
            b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            acc = acc + b[:, None]
        y = acc.to(dtype)
        if ROT_COLS > 0:
            if col0 < ROT_COLS:  # (whole heads a tile: the launcher's BLOCK_N)
                y = _rotate(
                    y, rows, row_mask, cos_ptr, sin_ptr, stride_rope, dtype, BLOCK_N, BLOCK_M,
                    HEAD_D,
                )  # fmt: skip
        if GATED:
            # eager's roundings: gate_up's output, then SiLU, then the product
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        out_mask = col_mask[:, None] & row_mask[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + rows[None, :] * stride_res + cols[:, None], mask=out_mask)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        if KV:
            # a decode step: q to the output, query head j·G + g at [g, j] with G = GROUP (as
            # `by_kv_head` orders them, so the attention takes a KV head's queries as rows with
            # no copy); k and v, side by side as in the cache's slot, to slot `step` of each row
            is_q = cols < Q_COLS
            dst = cols
            if GROUP > 1:
                KV_HEADS: tl.constexpr = Q_COLS // (HEAD_D * GROUP)
                head = cols // HEAD_D
                dst = ((head % GROUP) * KV_HEADS + head // GROUP) * HEAD_D + cols % HEAD_D
            q_at = out_ptr + rows[None, :] * stride_out + dst[:, None]
            tl.store(q_at, y, mask=out_mask & is_q[:, None])
            slot = kv_ptr + tl.load(step_ptr) * stride_slot
            kv_at = slot + rows[None, :] * stride_kv + (cols - Q_COLS)[:, None]
            tl.store(kv_at, y, mask=out_mask & (cols >= Q_COLS)[:, None])
        else:
            tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], y, mask=out_mask)

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        bias_ptr,
        norm_ptr,
        res_ptr,
        cos_ptr,
        sin_ptr,
        kv_ptr,
        step_ptr,
        part_ptr,
        count_ptr,
        M,
        stride_x,
        stride_out,
        stride_res,
        stride_rope,
        stride_kv,
        stride_slot,
        eps,
        K: tl.constexpr,
        N: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        GATED: tl.constexpr,
        RESIDUAL: tl.constexpr,
        ROT_COLS: tl.constexpr,
        HEAD_D: tl.constexpr,
        KV: tl.constexpr,
        Q_COLS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_SPLIT: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # acc is [BLOCK_N, BLOCK_M] (out transposed): the weight tile is the dot's M side, so
        # the rows may be as few as 16. Program (n, m, s) sums its tile over the s-th K_SPLIT of K.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # the rows' sums of squares (NORM)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            ks = pid_k * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if NORM:
                af = a.to(tl.float32)
                ss += tl.sum(af * af, axis=1)
                g = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                a = (af * g[None, :]).to(dtype)
            w_mask = col_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            if INTERPRET:  # the CPU interpreter's bf16 dot is wrong: its inputs as float32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(
                    w_ptr + (N + cols)[:, None] * K + ks[None, :], mask=w_mask, other=0.0
                )
                if INTERPRET:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(w_up, tl.trans(a), acc_up, input_precision=PRECISION)
        if SPLIT_K == 1:
            _finish(
                acc, acc_up, ss, rows, row_mask, cols, col_mask, out_ptr, bias_ptr, res_ptr,
                cos_ptr, sin_ptr, kv_ptr, step_ptr, stride_out, stride_res, stride_rope,
                stride_kv, stride_slot, pid_n * BLOCK_N, eps, dtype, K, NORM, BIAS, GATED,
                RESIDUAL, ROT_COLS, HEAD_D, KV, Q_COLS, GROUP, BLOCK_N, BLOCK_M, INTERPRET,
            )  # fmt: skip
        else:
            # Split K: each program leaves its partial sums in `part_ptr` and counts itself in on
            # its tile's counter; the program that arrives last sums the partials in split order
            # (the same bits whichever arrives last) and finishes the tile. One kernel, where
            # cuBLAS's split-K GEMM is followed by its own `splitKreduce` kernel.
            tiles = tl.num_programs(0) * tl.num_programs(1)
            tile = pid_m * tl.num_programs(0) + pid_n
            TILE: tl.constexpr = BLOCK_N * BLOCK_M
            PARTS: tl.constexpr = 2 if GATED else 1
            offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            mine = part_ptr + (pid_k * tiles + tile) * (PARTS * TILE)
            tl.store(mine + offs, acc)
            if GATED:
                tl.store(mine + TILE + offs, acc_up)
            squares = part_ptr + SPLIT_K * tiles * (PARTS * TILE)  # then [SPLIT_K, tiles, BLOCK_M]
            if NORM:
                tl.store(squares + (pid_k * tiles + tile) * BLOCK_M + tl.arange(0, BLOCK_M), ss)
            # every thread's stores issued before the count (the threadfence-reduction pattern:
            # the barrier, then a release at device scope; the last program's acquire sees them)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                ss = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in range(SPLIT_K):
                    part = part_ptr + (s * tiles + tile) * (PARTS * TILE)
                    # .cg: from L2, where the other multiprocessors' stores are
                    acc += tl.load(part + offs, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(part + TILE + offs, cache_modifier=".cg")
                    if NORM:
                        ss += tl.load(
                            squares + (s * tiles + tile) * BLOCK_M + tl.arange(0, BLOCK_M),
                            cache_modifier=".cg",
                        )
                _finish(
                    acc, acc_up, ss, rows, row_mask, cols, col_mask, out_ptr, bias_ptr, res_ptr,
                    cos_ptr, sin_ptr, kv_ptr, step_ptr, stride_out, stride_res, stride_rope,
                    stride_kv, stride_slot, pid_n * BLOCK_N, eps, dtype, K, NORM, BIAS, GATED,
                    RESIDUAL, ROT_COLS, HEAD_D, KV, Q_COLS, GROUP, BLOCK_N, BLOCK_M, INTERPRET,
                )  # fmt: skip
                # the counter back to zero: the next call on this stream may take the same
                # buffer (a forward's calls share one, `counters`)
                tl.store(count_ptr + tile, 0)

    def _launch(
        x,
        weight,
        *,
        bias=None,
        norm=None,
        eps=0.0,
        residual=None,
        gated=False,
        counts=None,
        cos=None,
        sin=None,
        rotate_cols=0,
        group=1,
        kv=None,
        kv_step=None,
    ):
        # the kernel takes rows by their stride and everything else packed
        (x,) = triton_launch.unit_last_stride(x)
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
        out_cols = _check_kv(kv, kv_step, group, m, n, cos, rotate_cols)
        out = torch.empty((m, out_cols), dtype=x.dtype, device=x.device)
        block_m = skinny_tiles.block_m_for(m)
        m_tiles = skinny_tiles.cdiv(m, block_m) if isinstance(m, int) else 1
        tile = skinny_tiles.tile_for(k, n, gated, block_m, m_tiles)
        block_n, block_k, split, warps, stages = tile
        block_k = skinny_tiles.block_k_for(k, block_k)
        head_d = 0
        if cos is not None:  # cos, sin [M, D/2]: read by one row stride
            if cos.stride() != sin.stride() or cos.stride(-1) != 1:
                cos, sin = cos.contiguous(), sin.contiguous()
            torch._check(cos.shape[0] == m)
            torch._check(sin.shape[0] == m)
            head_d = 2 * cos.shape[1]
            if sin.shape[1] != cos.shape[1] or rotate_cols % head_d or not 0 < rotate_cols <= n:
                raise ValueError(
                    f"norm_linear: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be "
                    f"[M, D/2] and rotate_cols ({rotate_cols}) whole heads of D within {n}"
                )
            block_n = skinny_tiles.rope_block_n(block_n, head_d, rotate_cols)
        per, split = skinny_tiles.k_split(k, block_k, split)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
        if split > 1:
            # partial sums [split, tiles, parts, BLOCK_N·BLOCK_M] and the rows' sums of squares
            # [split, tiles, BLOCK_M]; the tiles' counters: the caller's (`counters`: zero, and
            # left at zero by every call) or zeroed here for this call alone
            tiles = grid[0] * grid[1]
            size = split * tiles * ((2 if gated else 1) * block_n * block_m + block_m)
            parts = torch.empty(size, dtype=torch.float32, device=x.device)
            if counts is None:
                counts = torch.zeros(tiles, dtype=torch.int32, device=x.device)
            torch._check(counts.numel() >= tiles)
        else:
            parts, counts = out, out  # (not read: SPLIT_K 1 finishes in place)
        traceable(_skinny_kernel)[grid](
            x,
            weight,
            out,
            bias if bias is not None else weight,
            norm if norm is not None else weight,
            residual if residual is not None else out,
            cos if cos is not None else out,
            sin if sin is not None else out,
            kv if kv is not None else out,
            kv_step if kv is not None else out,
            parts,
            counts,
            m,
            x.stride(0),
            out.stride(0),
            residual.stride(0) if residual is not None else 0,
            cos.stride(0) if cos is not None else 0,
            kv.stride(0) if kv is not None else 0,
            kv.stride(1) if kv is not None else 0,
            eps,
            K=k,
            N=n,
            NORM=norm is not None,
            BIAS=bias is not None,
            GATED=gated,
            RESIDUAL=residual is not None,
            ROT_COLS=rotate_cols if cos is not None else 0,
            HEAD_D=head_d,
            KV=kv is not None,
            Q_COLS=out_cols,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            K_SPLIT=per,
            SPLIT_K=split,
            PRECISION=triton_launch.dot_precision(x),
            INTERPRET=not x.is_cuda,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    def _check_kv(kv, kv_step, group, m, n, cos, rotate_cols) -> int:
        """The output's columns: q's alone for a call that stores k and v into a cache slot
        (`kv`), else all n."""
        if kv is None:
            if group != 1:
                raise ValueError("norm_linear: q heads by KV head (group) only with a kv cache")
            return n
        q_cols = 2 * rotate_cols - n  # rotated: q and k; the rest: v, as wide as k
        if cos is None or kv_step is None or q_cols <= 0:
            raise ValueError(
                "norm_linear: a kv cache slot takes the rotated q and k heads (cos, sin, "
                "rotate_cols) and the slot's index (kv_step)"
            )
        kv_cols = n - q_cols
        slot = kv.shape[2:]
        if kv.dim() < 3 or not kv[0, 0].is_contiguous() or kv[0, 0].numel() != kv_cols:
            raise ValueError(
                f"norm_linear: kv {tuple(kv.shape)} must be [M, S, ...] with each slot's "
                f"{kv_cols} k and v columns contiguous, got slots of {tuple(slot)}"
            )
        torch._check(kv.shape[0] == m)
        if group < 1 or (q_cols // (2 * cos.shape[1])) % group:
            raise ValueError(f"norm_linear: group {group} does not divide the q heads")
        return q_cols

    # The ops' schemas give no argument a default, and callers go through the functions below,
    # which pass every argument: torch 2.11's dispatcher drops trailing arguments equal to their
    # defaults before the op's ADInplaceOrView step, which then indexes the mutated `counts` or
    # `kv` past the end (IndexError on the H200, 2026-12-05; torch 2.13 fills the defaults in).
    # `counts` (`counters`): the int32 counters of a K split, zero, which the call leaves at
    # zero; declared mutated, since the kernel counts in them while it runs; `kv`: a decode
    # step's cache, written
    @triton_op("boundgen::norm_linear", mutates_args={"counts", "kv"})
    def _norm_linear(
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        counts: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        rotate_cols: int,
        group: int,
        kv: torch.Tensor | None,
        kv_step: torch.Tensor | None,
    ) -> torch.Tensor:
        return _launch(
            x,
            weight,
            bias=bias,
            norm=norm,
            eps=eps,
            counts=counts,
            cos=cos,
            sin=sin,
            rotate_cols=rotate_cols,
            group=group,
            kv=kv,
            kv_step=kv_step,
        )

    @triton_op("boundgen::norm_gated", mutates_args={"counts"})
    def _norm_gated(
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        counts: torch.Tensor | None,
    ) -> torch.Tensor:
        return _launch(x, weight, norm=norm, eps=eps, gated=True, counts=counts)

    @triton_op("boundgen::linear_residual", mutates_args={"counts"})
    def _linear_residual(
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        counts: torch.Tensor | None,
    ) -> torch.Tensor:
        return _launch(x, weight, residual=residual, counts=counts)


def norm_linear(
    x: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotate_cols: int = 0,
    group: int = 1,
    kv: torch.Tensor | None = None,
    kv_step: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm(x; norm, eps) @ weight.T (+ bias): x [M, K] → [M, N]; with `cos` and `sin`
    ([M, D/2] each) its first `rotate_cols` columns (the q and k heads of a qkv projection)
    rotated by them, head by head (HF's rotate-half). `counts`: `counters`.

    With `kv` (a decode step's cache [M, S, ...], each slot k then v contiguous, `BeamKV`) and
    `kv_step` (int64 [1]): k and v go into slot kv_step of each row, and only q is returned,
    [M, Hq·D], its heads in KV-head order with `group` G > 1 (query head j·G + g at [:, g, j] of
    its [M, G, Hkv, D] view, `by_kv_head`)."""
    return torch.ops.boundgen.norm_linear(
        x, norm, eps, weight, bias, counts, cos, sin, rotate_cols, group, kv, kv_step
    )


def norm_gated(
    x: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(g)·u with [g | u] = RMSNorm(x; norm, eps) @ weight.T: x [M, K], weight [2I, K] →
    [M, I]."""
    return torch.ops.boundgen.norm_gated(x, norm, eps, weight, counts)


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + x @ weight.T: x [M, K], residual [M, N] → [M, N]."""
    return torch.ops.boundgen.linear_residual(x, weight, residual, counts)


def counters(x: torch.Tensor, layer: nn.Module) -> torch.Tensor | None:
    """One zeroed counter buffer for every fused call of a forward (or a decode step) over rows
    `x` through layers shaped like `layer`, or None where the kernels do not take `x`. The calls
    run one after another on the forward's stream, and each leaves the counters at zero, so one
    zero fill serves them all, where a buffer zeroed per call is a fill kernel per GEMM (an
    AOTInductor bucket's `torch.zeros` is an Inductor kernel). A buffer kept across forwards
    would be shared by forwards running at once on the device's streams: one per forward."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not any(applies(x, lin) for lin in linears):  # (FP8 layers keep their own path)
        return None
    # the most tiles any call may take: 16-column tiles (the narrowest a tile table may give)
    # over 16-row blocks
    n = max(lin.out_features for lin in linears)
    size = skinny_tiles.cdiv(n, 16) * skinny_tiles.cdiv(x.shape[0], 16)
    return torch.zeros(size, dtype=torch.int32, device=x.device)


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
