"""`beam_decode`: a beam-search decode step's attention as one Triton kernel.

A decode step's query rows are the beams (one token each); a beam attends to its prompt's KV,
shared by the prompt's beams, and to its own generated tokens' KV slots up to the step. The layer
ran that as flash attention over the prompts (`varlen`: 7.4 µs a layer for W4's 16 beams × 128
prompt tokens on the H200) plus one Inductor kernel for the own slots and the log-sum-exp merge
(2.9 µs), both far above the work (BENCHMARKS.md, 2026-12-02 sixth session, W4's profile): flash
is built for long sequences. Here one program owns one prompt's beams × the GQA query heads of
one KV head (row r: beam r // gqa, head r % gqa), so each prompt K/V tile is loaded once for all
of them; one online softmax runs over the prompt's keys, then over the rows' own slots ≤ step
(products and sums: a handful of slots), so no merge and no second kernel.

`beam_decode` is a `torch.library.triton_op`: the compiled beam layers (`compile/decode.py`) trace
into it. It reads the step from its int64 tensor, so one CUDA graph serves every step. Where it
runs is `chosen()`'s measured choice: every decode layer over flash-based attention, eager or
compiled. With 128 rows a program (a W4 prompt's rows of one KV head in one program, 2 programs a
b1 step) it lost to flash + Inductor's own-slot kernels in compiled layers (H200, W4 b1 6.8 → 7.4
ms, BENCHMARKS.md 2026-12-02 eighth session) and won in eager ones (18.2 → 13.7 ms); with 16 rows
a program (14 programs a b1 step) it beats flash + the own-slot kernel (`own_slots.py`) in
compiled layers at b1, b8 and b32 (H100, one process: 6.43 → 6.20, 8.29 → 7.72, 14.34 → 14.00 ms
over the vocabulary; 216 launches and 0.33–0.42 ms of GPU time fewer a search; BENCHMARKS.md
2026-12-05 twenty-eighth session).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from boundgen.settings import env_choice

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from boundgen import grid_dependency
    from boundgen.attention.segments import dot
    from boundgen.grid_dependency import await_inputs
    from boundgen.triton_launch import one_stride_set, traceable, unit_last_stride

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

# A decode step's attention: `auto` as `chosen()` says, `fused` (this kernel) or `flash` (flash +
# Inductor's own-slot kernel) wherever the decode layers run — an A/B's switch.
MODES = ("auto", "fused", "flash")
MODE = os.environ.get("BOUNDGEN_BEAM_ATTENTION", "auto")


def chosen(backend_name: str = "varlen") -> bool:
    """Whether decode layers take this kernel: under `auto` every one over flash-based attention,
    eager (it replaces flash and the own-slot ops launched one at a time) or compiled (it
    replaces flash and the own-slot kernel: at 16 rows a program, faster at b1, b8 and b32; the
    module's docstring has the numbers). The `reference` backend (exact math, asked for by name)
    keeps its own."""
    mode = env_choice("BOUNDGEN_BEAM_ATTENTION", MODE, MODES)
    if mode == "auto":
        return AVAILABLE and backend_name != "reference"
    return AVAILABLE and mode == "fused"


# Rows a program takes (beams × GQA heads; W4's 16 × 7 = 112) and keys a prompt tile holds.
# 16 rows spread a small batch's step over more SMs (W4 b1: 14 programs, where 128 rows — a
# prompt's rows of one KV head in one program — made 2), each loading the prompt's K/V again:
# faster in compiled layers at b1, b8 and b32 (above), and in eager ones at b1 (H100, 12.10 →
# 11.32 ms over the vocabulary; b8 14.86 → 14.29, children 15.39 → 15.51; separate processes on
# one machine). `BOUNDGEN_BEAM_DECODE_ROWS` (16, 32, 64 or 128) and `BOUNDGEN_BEAM_DECODE_WARPS`
# (1, 2, 4 or 8; unset: `DEFAULT_WARPS`) for an A/B.
BLOCK_ROWS = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
BLOCK_N = 64
# Warps a program, whatever its rows: at 16 rows 4 warps took the kernel 0.61 → 0.48 ms a b1
# search (72 calls), 0.65 → 0.52 at b8 and 0.73 → 0.66 at b32, against one warp; two warps in
# between (H100, one process, BENCHMARKS.md twenty-ninth session). 64 and 128 rows had 4 already.
DEFAULT_WARPS = 4


# the environment's tile, checked as every `BOUNDGEN_*` switch is (`settings.env_choice`)
BLOCK_M = int(
    env_choice(
        "BOUNDGEN_BEAM_DECODE_ROWS",
        os.environ.get("BOUNDGEN_BEAM_DECODE_ROWS", "16"),
        tuple(map(str, BLOCK_ROWS)),
    )
)
NUM_WARPS = int(
    env_choice(
        "BOUNDGEN_BEAM_DECODE_WARPS",
        os.environ.get("BOUNDGEN_BEAM_DECODE_WARPS", str(DEFAULT_WARPS)),
        tuple(map(str, WARPS)),
    )
)


@contextlib.contextmanager
def tile(block_m: int, warps: int | None = None):
    """`BLOCK_M` and `NUM_WARPS` (unset: `DEFAULT_WARPS`) for what is built or traced inside
    (the decode layers read them as they trace: a compiled layer keeps the tile it was traced
    with, and dynamo guards on it); a benchmark's variants side by side."""
    global BLOCK_M, NUM_WARPS
    new = block_m, warps or DEFAULT_WARPS
    if block_m not in BLOCK_ROWS or new[1] not in WARPS:
        raise ValueError(
            f"tile({block_m}, {warps}): expected rows in {', '.join(map(str, BLOCK_ROWS))} and "
            f"warps in {', '.join(map(str, WARPS))}"
        )
    before, (BLOCK_M, NUM_WARPS) = (BLOCK_M, NUM_WARPS), new
    try:
        yield
    finally:
        BLOCK_M, NUM_WARPS = before


if AVAILABLE:

    @triton.jit
    def _online(m_i, l_i, acc, s, v, IEEE: tl.constexpr):
        """One online-softmax step: scores `s` [M, N] (−inf: masked) against values `v` [N, D]."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        return m_new, l_i, acc

    @grid_dependency.awaits
    @triton.jit
    def _beam_decode_kernel(
        Q,
        PK,
        PV,
        BK,
        BV,
        Out,
        STEP,
        CU_BEAMS,
        CU_PROMPT,
        stride_qn,
        stride_qh,
        stride_pt,
        stride_ph,
        stride_bn,
        stride_bs,
        stride_bh,
        stride_on,
        stride_oh,
        qk_scale,
        GQA: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SLOTS_P2: tl.constexpr,  # the own slots, padded to a power of two
        IEEE: tl.constexpr,
        INTERPRET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        # Inductor hands a Python float over typed fp64 (attention/segments.py); the interpreter
        # as a Python float
        if not INTERPRET:
            qk_scale = tl.cast(qk_scale, tl.float32)
        # every scalar the program needs, loaded at once (each load waited for is a memory latency)
        beam0 = tl.load(CU_BEAMS + b)
        beams = tl.load(CU_BEAMS + b + 1) - beam0
        p0 = tl.load(CU_PROMPT + b)
        p1 = tl.load(CU_PROMPT + b + 1)
        step = tl.load(STEP)
        r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < beams * GQA
        beam = (beam0 + tl.minimum(r // GQA, tl.maximum(beams - 1, 0))).to(tl.int64)
        head = kvh * GQA + r % GQA
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(
            Q + beam[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if INTERPRET:  # the CPU interpreter's bf16 dot is wrong: its operands as float32
            q = q.to(tl.float32)
        # each row's own slots 0..step (its beam's generated tokens, this step's included) first,
        # as one [rows, slots, D] tile: its loads are issued at once and overlap the first prompt
        # tile's, where one slot at a time after the prompt's keys was a chain of waits (H200, W4
        # shapes: 4.6 → 3.5 µs a call at b1, 4.9 → 3.8 at b8, 7.2 → 6.0 at b32;
        # bench_beam_decode.py, BENCHMARKS.md thirtieth session). Slot 0 is always written, so
        # the softmax starts from a finite maximum.
        qf = q.to(tl.float32)
        sl = tl.arange(0, SLOTS_P2)
        offs3 = (
            beam[:, None, None] * stride_bn
            + sl[None, :, None] * stride_bs
            + kvh * stride_bh
            + d[None, None, :]
        )
        mask3 = row_ok[:, None, None] & (sl <= step)[None, :, None] & d_ok[None, None, :]
        ks = tl.load(BK + offs3, mask=mask3, other=0.0).to(tl.float32)
        vs = tl.load(BV + offs3, mask=mask3, other=0.0).to(tl.float32)
        sc = tl.sum(qf[:, None, :] * ks, axis=2) * qk_scale
        sc = tl.where((sl <= step)[None, :], sc, float("-inf"))
        m_i = tl.max(sc, axis=1)
        p = tl.exp(sc - m_i[:, None])
        l_i = tl.sum(p, axis=1)
        acc = tl.sum(p[:, :, None] * vs, axis=1)
        # then the prompt's keys, shared by all the rows
        n = tl.arange(0, BLOCK_N)
        start = p0
        while start < p1:
            keys = (start + n).to(tl.int64)
            kv_mask = (keys < p1)[:, None] & d_ok[None, :]
            offs = keys[:, None] * stride_pt + kvh * stride_ph + d[None, :]
            k = tl.load(PK + offs, mask=kv_mask, other=0.0)
            v = tl.load(PV + offs, mask=kv_mask, other=0.0)
            if INTERPRET:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = dot(q, tl.trans(k), IEEE) * qk_scale
            s = tl.where((start + n < p1)[None, :], s, float("-inf"))
            m_i, l_i, acc = _online(m_i, l_i, acc, s, v, IEEE)
            start += BLOCK_N
        out = acc / l_i[:, None]
        tl.store(
            Out + beam[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )

    @triton_op("boundgen::beam_decode", mutates_args=())
    def beam_decode(
        q: torch.Tensor,
        pk: torch.Tensor,
        pv: torch.Tensor,
        bk: torch.Tensor,
        bv: torch.Tensor,
        step: torch.Tensor,
        cu_beams: torch.Tensor,
        cu_prompt: torch.Tensor,
        max_beams: int,
        block_m: int,
        num_warps: int,
    ) -> torch.Tensor:
        """q [N, Hq, D] (one token per beam; beams of prompt b are rows cu_beams[b]:cu_beams[b+1]),
        the prompts' pk/pv [T, Hkv, D] (prompt b: cu_prompt[b]:cu_prompt[b+1]), the beams' own
        bk/bv [N, S, Hkv, D] of which slots 0..step[0] are written → [N, Hq, D]: each beam's
        attention over its prompt's keys and its own slots ≤ step, in one softmax; `block_m`
        rows (beam × GQA head) a program of `num_warps` warps (the callers pass `BLOCK_M`,
        `NUM_WARPS`). No argument has a default: torch 2.11's dispatcher drops trailing
        defaults (see tests/test_op_schemas.py)."""
        hq, d = q.shape[1], q.shape[2]
        hkv, slots = pk.shape[1], bk.shape[1]
        gqa = hq // hkv
        q, pk, pv, bk, bv = unit_last_stride(q, pk, pv, bk, bv)
        bk, bv = one_stride_set(bk, bv)
        out = torch.empty_like(q)
        grid = (cu_beams.shape[0] - 1, hkv, triton.cdiv(max_beams * gqa, block_m))
        traceable(_beam_decode_kernel)[grid](
            q,
            pk,
            pv,
            bk,
            bv,
            out,
            step,
            cu_beams,
            cu_prompt,
            q.stride(0),
            q.stride(1),
            pk.stride(0),
            pk.stride(1),
            bk.stride(0),
            bk.stride(1),
            bk.stride(2),
            out.stride(0),
            out.stride(1),
            1.0 / math.sqrt(d),
            GQA=gqa,
            HEAD_DIM=d,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            SLOTS_P2=triton.next_power_of_2(slots),
            # float32 multiplied exactly: as tf32 the H200 missed the eager path's 2e-5 (GPU test)
            IEEE=q.dtype == torch.float32,
            INTERPRET=not q.is_cuda,
            PDL=grid_dependency.waits(q),
            num_warps=num_warps,
        )
        return out
