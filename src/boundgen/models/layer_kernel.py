"""A whole decoder layer of a short prompt as one persistent Triton kernel (opt-in, eager only).

A W3 prompt (64 tokens) is latency-bound layer by layer: its 24 layers are ~7 kernels each —
qkv + rotation, attention, o_proj, residual + RMSNorm, gate_up + SiLU·mul, `down`, residual +
RMSNorm — ~37 µs a layer on an H100 where its 29.8 MB of weights stream in ~9 µs, and even
with every weight in L2 a 64-row layer of those kernels took 41 µs (BENCHMARKS.md, forty-ninth
session): each kernel's programs ramp up, walk their K loop and drain before the next may start.
Here one launch a layer runs every step on one program per multiprocessor, the steps separated
by grid-wide barriers (an arrival count and a spin on it, as a cooperative launch's grid sync):

    A  RMSNorm(x) @ qkv.T + bias, q and k rotated      items: head × K slice (a head's two
                                                              halves as two accumulators)
    B  causal attention within each packed segment    items: the query heads
    C  x1 = x + attn @ o_proj.T, x1's squares summed   items: hidden column tile × K slice
    D  SiLU(g)·u, [g | u] = RMSNorm(x1) @ gate_up.T    items: intermediate column tile × slice
    E  out = x1 + act @ down.T, out's squares summed   items: hidden column tile × K slice

RMSNorm needs a row's sum of squares before its first product: each layer returns its output's
(per column tile, `squares`), the next layer sums them, and the first layer's come from torch.
A GEMM's K slices (`QKV_SPLITS` etc.) leave float32 partials; the last of a tile's slices to
arrive (a counter per tile) sums them in slice order, so the result does not depend on which
finishes last, runs the step's epilogue and sets the counter back to zero. One slice: the
epilogue at once, no partials.

The barriers need every program resident at once: the grid is the multiprocessor count, one
program each (`programs`), launched cooperatively (all programs start together or none), so two
such kernels on two streams (the runtime's device streams) cannot each hold multiprocessors the
other's programs wait for. The counters live in
`counters`' first SYNC_SLOTS int32, zero between calls: the last program to leave (counted in slot
4) sets them back. Without CUDA (Triton's interpreter, the tests) the programs of a launch run one
after another, so each step is launched on its own (`PHASE`) instead of crossing a barrier.

`FLOW` (opt-in) drops the barriers: each work item waits only for the items of the step before
that it reads — the finishing program of an output tile counts it for the K slices of the next
step that read it (a release), and an item spins until its count is complete (an acquire) — so
a program done with one step goes on to the next step's ready items instead of waiting for the
slowest program of the step. The interpreter, a launch a step, checks that every such count is
complete when its step begins (the op raises otherwise).

`STACK` (opt-in) runs every layer of a forward in one launch (`fused_layers` with `offsets`):
the first layer's weight pointers and each layer's distance from them (`stack_offsets`, in
16-element units so the moved pointers keep the alignment the loads are compiled for); the
layers between the first and the last hand their output on through two buffers in turn; a
barrier (or, under FLOW, each A's wait for all of the layer before's output tiles) between
layers; every count only grows over the launch (a wait needs its count times the layers
passed) and the last program out sets them back. The layer's steps are a function of their own
(`_layer_steps`), called once for one layer and from a loop, not inlined (`noinline`), for a
launch of several: inlined in the loop, the kernel took 255 registers and spilled 56 bytes on
sm_90 (Triton 3.6) where one layer takes 190 and none.

Numerics follow the compiled layer's: the norms as eager (x · rstd rounded, times the weight,
rounded), GEMMs in float32 rounded once with their bias, the rotation in float32 from the
rounded qkv, rounded once, SiLU·mul from the rounded gate and up in float32, residual sums in
float32 rounded once.

`MAX_ROWS` (`BOUNDGEN_LAYER_KERNEL_MAX_ROWS`, default 0: never) decides which forwards take it:
packed prefill without a shared prefix or KV to store, at most that many tokens (≤ 64), not
traced by torch.compile (`TRACED`), so no compiled package holds it and the packages' keys leave
it out.

Measured (H100, fifty-second session, `bench_layer_kernel.py`): the first version — one K slice
for qkv, o_proj and gate_up, 9 for `down` — matched the model's layers eagerly (the GPU tests)
but took 1,760 µs a 24-layer forward of one 64-token prompt against 922 for the compiled layers
(68.6 µs a layer of kernel time): a program walked K = 896 in 14 dependent steps. The K slices
of every GEMM (this version), the unrolled sums of the partials and of the norm's squares
(fifty-fourth session: as loops, each load waited for the one before), `PREFETCH` and `FLOW`
are not yet timed (the K slices, the unrolled sums and `FLOW` pass the GPU tests: H100,
fifty-fifth session) and `STACK` (written in the fifty-sixth, tested in the interpreter) are
off until they beat the compiled layers.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

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

MAX_ROWS = int(os.environ.get("BOUNDGEN_LAYER_KERNEL_MAX_ROWS", "0"))
LIMIT = 64  # the most rows one program's tiles hold (BLOCK_M)
# barriers A|B, B|C, C|D, D|E, the exit count, the interpreter's unmet `FLOW` waits, E|A
# (a layer's output whole before the next layer of a launch), spare
SYNC_SLOTS = 8
HIDDEN_TILE = 64  # columns of the hidden size a C or E item takes
INTER_TILE = 32  # columns of the intermediate size a D item takes (gate's and up's each)
BLOCK_K = 64
# K slices a column tile's products are cut into, per GEMM: each (tile, slice) is an item, and the
# slices' float32 partials are summed by the last of them to arrive. More slices: more programs
# at work and shorter chains of dependent loads in each (the first version, one slice for qkv,
# o_proj and gate_up, walked K=896 in 14 steps: 68.6 µs a layer, H100, fifty-second session),
# for one round trip of the partials through L2. At 896 × 4,864: qkv 18 heads × 7 = 126 items,
# o_proj 14 × 7 = 98, gate_up 152 × 2 = 304, `down` 14 × 9 = 126 on 132 multiprocessors.
QKV_SPLITS, O_SPLITS, GATED_SPLITS, DOWN_SPLITS = 7, 7, 2, 9
NUM_WARPS, NUM_STAGES = 4, 3
# 1: each program asks L2 for its next steps' weights while the steps before run (o_proj's and
# gate_up's after A, `down`'s after C; the weights need nothing computed): DRAM streams on through
# the barriers and attention instead of waiting for each step's first loads. 0: each step loads
# its own. Unmeasured: off until `bench_layer_kernel.py --configs` says.
PREFETCH = 0
# 1: no grid-wide barriers; each work item waits only for the items of the step before that it
# reads (counts the finishing program of each output tile signals, FLOW's waits): a query head
# for its q, k and v heads, an o_proj K slice for its heads' attention, gate_up for every tile
# of x1 (the norm reads whole rows), a `down` K slice for its SiLU·mul tiles. Programs that
# finish a step early go on to the next step's ready items instead of waiting for the slowest
# (the barriers made 118 of 132 programs wait out attention's 14 heads, and every program
# gate_up's third round of items). Every program resident (the cooperative launch) and every
# wait on an earlier step: no cycle. 0: the barriers. Unmeasured: off until
# `bench_layer_kernel.py --configs` says.
FLOW = 0
# 1: every layer of a forward in one launch (the layers' weights found from the first's by
# `stack_offsets`; a barrier, or under FLOW each A's wait for the layer before's output tiles,
# between layers), where a launch a layer ramps its programs up and drains them 24 times a W3
# forward. Eager forwards only (the offsets are the weights' addresses). Unmeasured: off until
# `bench_layer_kernel.py --knobs` says.
STACK = 0
# The launches a call makes, a step each (`PHASE`; -1: all with the barriers between): None, as
# the device says (all at once on CUDA, one by one in the interpreter); `bench_layer_kernel.py
# --steps` times each step alone.
STEPS: tuple[int, ...] | None = None
# Traced by torch.compile the forward came out wrong on an H100 (max |diff| 7.6 against eager's
# 0.09, fifty-second session) where the eager kernel matched: eager forwards only (the `eager`
# and `eager+graphs` backends) until the compiled path matches; `bench_layer_kernel.py
# --diagnose` sets this to trace it anyway.
TRACED = False
# the tile knobs above, as `bench_layer_kernel.py --configs` sweeps them (read at each launch)
KNOBS = (
    "BLOCK_K", "INTER_TILE", "QKV_SPLITS", "O_SPLITS", "GATED_SPLITS", "DOWN_SPLITS",
    "NUM_WARPS", "NUM_STAGES", "PREFETCH", "FLOW", "STACK",
)  # fmt: skip


def rows_up_to(rows: int) -> contextlib.AbstractContextManager[None]:
    """Inside: forwards of at most `rows` tokens take the kernel (`MAX_ROWS`; 0: none), read when
    a forward traces, compiles or is captured (an A/B's switch)."""
    return switched(globals(), "MAX_ROWS", rows)


def applies(model, x: torch.Tensor, attn, kv) -> bool:
    """Whether `model`'s forward of `x` runs its layers through the kernel: on for `x`'s rows
    (`MAX_ROWS`, ≤ `LIMIT`), a packed prefill without a shared prefix or KV to store, CUDA bf16
    (or the interpreter, `triton_launch.interpreted`) and a layer the kernel has: plain
    `nn.Linear`s (no FP8), no q/k norm (Qwen3), a head size of 64 or 128."""
    rows = x.shape[0]
    if not (AVAILABLE and 0 < rows <= min(MAX_ROWS, LIMIT)):
        return False
    if torch.compiler.is_compiling() and not TRACED:
        return False
    if kv is not None or attn is None or attn.has_shared_prefix:
        return False
    layer = model.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(type(m) is not torch.nn.Linear for m in linears):
        return False
    if getattr(a, "q_norm", None) is not None or a.head_dim not in (64, 128):
        return False
    cfg = model.config
    if cfg.hidden_size % HIDDEN_TILE or cfg.intermediate_size % INTER_TILE:
        return False
    return triton_launch.takes(x, [m.weight for m in linears])


def programs(device: torch.device) -> int:
    """The grid: one program a multiprocessor (every program must be resident for the
    barriers), a few in the interpreter."""
    if device.type != "cuda":
        return 3
    return triton_launch.multiprocessors(device)


if AVAILABLE:

    @triton.jit
    def _grid_sync(Sync, slot, need, ENABLED: tl.constexpr):
        """Every program waits here until the count at `slot` reaches `need` (CUDA's grid sync:
        the program's writes ordered before its arrival, the others' visible after the wait): an
        arrival, then `_await`'s spin on the count. A slot serves a barrier of every layer of a
        launch: its count only grows (`need`: the programs times the layers passed, itself
        included), and the last program out sets it back."""
        if ENABLED:
            tl.debug_barrier()
            tl.atomic_add(Sync + slot, 1, sem="release", scope="gpu")
            _await(Sync + slot, need, Sync, 1)

    @triton.jit
    def _await(Ready, need, Sync, MODE: tl.constexpr):
        """`FLOW`'s wait: until the count at `Ready` reaches `need` (MODE 1, the GPU's one launch
        of every step); MODE 2, the interpreter's launch a step, where what a step waits for was
        done by the launches before: a count short of `need` is counted in `Sync[5]` (the op
        raises); MODE 0: no wait (`FLOW` off, or one step timed alone). The spin's atomic add of
        0 is a load (Triton writes it as `ld.global.gpu.acquire`, sm_90 PTX): the waiting
        programs do not queue read-modify-writes ahead of the counts they wait for."""
        if MODE == 1:
            while tl.atomic_add(Ready, 0, sem="acquire", scope="gpu") < need:
                pass
            tl.debug_barrier()
        elif MODE == 2:
            if tl.atomic_add(Ready, 0) < need:
                tl.atomic_add(Sync + 5, 1)

    @triton.jit
    def _signal(Ready, col0, W: tl.constexpr, K_PER: tl.constexpr, ON: tl.constexpr):
        """`FLOW`'s signal of a finished output tile of columns [col0, col0 + W): one count for
        each K slice of `K_PER` of the next step that reads any of them (one or two), after every
        thread's stores of the tile (the barrier; the release makes them visible with it)."""
        if ON:
            g = col0 // K_PER + tl.arange(0, 2)
            tl.debug_barrier()
            tl.atomic_add(Ready + g, 1, mask=g <= (col0 + W - 1) // K_PER, sem="release",
                          scope="gpu")  # fmt: skip

    @triton.jit
    def _producers(split, K_PER: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
        """How many tiles of W columns of the step before (each signalled once) K slice `split`
        of `K_PER` reads: what its `_await` needs."""
        lo = split * K_PER
        return (tl.minimum(lo + K_PER, K) - 1) // W - lo // W + 1

    @triton.jit
    def _item(item, TILES: tl.constexpr, BLOCK_N: tl.constexpr):
        """Item → (column tile, K slice, the tile's columns): consecutive items take
        consecutive tiles, so a tile's slices go to programs TILES apart (every step's items
        and the prefetches of them are dealt by this)."""
        tile = item % TILES
        return tile, item // TILES, tile * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _prefetch(W, row0, k0, K: tl.constexpr, ROWS: tl.constexpr, K_PER: tl.constexpr,
                  LANES: tl.constexpr):  # fmt: skip
        """Asks L2 for W[row0 : row0 + ROWS, k0 : k0 + K_PER] (W: [N, K]) without waiting for it:
        one 128-byte line a lane (lanes past the slice ask for its first line again)."""
        LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth  # elements a line
        PER_ROW: tl.constexpr = (K_PER + LINE - 1) // LINE
        N: tl.constexpr = ROWS * PER_ROW
        for start in tl.static_range(0, N, LANES):
            i = start + tl.arange(0, LANES)
            k = k0 + (i % PER_ROW) * LINE
            ok = (i < N) & (k < K)
            at = W + tl.where(ok, (row0 + i // PER_ROW) * K + k, row0 * K + k0)
            # one line, no backslash escapes: Inductor copies a traced kernel's source into a
            # string literal that turns an escaped line break into a real one (a SyntaxError in
            # its generated module, fifty-fifth session)
            tl.inline_asm_elementwise(
                "mov.u32 $0, 0; prefetch.global.L2 [$1];",
                "=r,l",
                [at],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )

    @triton.jit
    def _prefetch_items(
        W, pid, nprog, K: tl.constexpr, TILES: tl.constexpr, SPLITS: tl.constexpr,
        K_PER: tl.constexpr, BLOCK_N: tl.constexpr, B_OFFSET: tl.constexpr, PAIR: tl.constexpr,
        LANES: tl.constexpr,
    ):  # fmt: skip
        """`_prefetch` of the weight slices this program's items of a C, D or E step will read
        (the items as `_item` deals them; PAIR: also the rows B_OFFSET further, D's up)."""
        for item in range(pid, TILES * SPLITS, nprog):
            tile, split, _ = _item(item, TILES, BLOCK_N)
            _prefetch(W, tile * BLOCK_N, split * K_PER, K, BLOCK_N, K_PER, LANES)
            if PAIR:
                _prefetch(W, tile * BLOCK_N + B_OFFSET, split * K_PER, K, BLOCK_N, K_PER, LANES)

    @triton.jit
    def _normed_tile(X, rows, row_ok, ks, k_ok, rstd, NormW, H: tl.constexpr):
        """RMSNorm(X)[rows, ks] transposed, [BLOCK_K, BLOCK_M], as eager rounds it:
        (x · rstd) rounded, times the norm's weight, rounded."""
        x = tl.load(
            X + rows[None, :] * H + ks[:, None],
            mask=row_ok[None, :] & k_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        ).to(tl.float32)
        # the product of two rounded values is exact in float32: one rounding, as eager's
        xn = (x * rstd[None, :]).to(NormW.dtype.element_ty).to(tl.float32)
        w = tl.load(NormW + ks, mask=k_ok, other=0.0).to(tl.float32)
        return (xn * w[:, None]).to(NormW.dtype.element_ty)

    @triton.jit
    def _rstd(Squares, rows, row_ok, eps, H: tl.constexpr, BLOCK_M: tl.constexpr,
              TILES: tl.constexpr):  # fmt: skip
        """1 / rms of each row from its sums of squares per column tile (summed in tile order).
        Unrolled: every tile's load in flight at once, where a loop of a runtime count (sm_90
        PTX, fifty-fourth session) waited for each load before the next."""
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for t in tl.static_range(0, TILES):
            total += tl.load(
                Squares + t * BLOCK_M + rows, mask=row_ok, other=0.0, cache_modifier=".cg"
            )
        return tl.rsqrt(total / H + eps)

    @triton.jit
    def _products(
        X, rstd, NormW, W, rows, row_ok, a, k0,
        K: tl.constexpr, K_PER: tl.constexpr, B_OFFSET: tl.constexpr, NORM: tl.constexpr,
        PAIR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """W[a] @ inputᵀ over K slice [k0, k0 + K_PER), and W[a + B_OFFSET]'s where PAIR (a
        head's two halves, gate's and up's columns): two float32 [BLOCK_N, BLOCK_M] (swap AB:
        the weight rows are the MMA's M). input: RMSNorm(X) (NORM; `rstd`, `NormW`) or X
        [M, K]."""
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in range(k0, k0 + K_PER, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            if NORM:
                h = _normed_tile(X, rows, row_ok, ks, k_ok, rstd, NormW, K)
            else:
                h = tl.load(
                    X + rows[None, :] * K + ks[:, None],
                    mask=row_ok[None, :] & k_ok[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
            w_a = tl.load(W + a[:, None] * K + ks[None, :], mask=k_ok[None, :], other=0.0)
            if INTERPRET:  # the interpreter's dot multiplies 16-bit floats as integers
                h, w_a = h.to(tl.float32), w_a.to(tl.float32)
            acc_a += tl.dot(w_a, h, input_precision=PRECISION)
            if PAIR:
                at_b = W + (a + B_OFFSET)[:, None] * K + ks[None, :]
                w_b = tl.load(at_b, mask=k_ok[None, :], other=0.0)
                if INTERPRET:
                    w_b = w_b.to(tl.float32)
                acc_b += tl.dot(w_b, h, input_precision=PRECISION)
        return acc_a, acc_b

    @triton.jit
    def _arrive(acc_a, acc_b, Parts, Counts, tile, split, rows, row_ok, a,
                N_W: tl.constexpr, B_OFFSET: tl.constexpr, PAIR: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
        """This K slice's products left as float32 partials (Parts[split, rows, a]); whether
        this program is the last of the tile's slices to arrive (it then sums them)."""
        at = Parts + (split * BLOCK_M + rows)[None, :] * N_W + a[:, None]
        tl.store(at, acc_a, mask=row_ok[None, :])
        if PAIR:
            tl.store(at + B_OFFSET, acc_b, mask=row_ok[None, :])
        tl.debug_barrier()  # the whole partial written before the arrival below
        return tl.atomic_add(Counts + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1

    @triton.jit
    def _summed(Parts, rows, row_ok, a, N_W: tl.constexpr, SPLITS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
        """The partials of columns `a`, summed in slice order (whichever arrived last).
        Unrolled: every slice's load in flight at once (as a loop, sm_90 PTX waited for each
        slice's load before the next, fifty-fourth session)."""
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(0, SPLITS):
            at = Parts + (s * BLOCK_M + rows)[None, :] * N_W + a[:, None]
            total += tl.load(at, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
        return total

    @triton.jit
    def _qkv_out(acc_a, acc_b, head, a, Bias, Cos, Sin, Qkv, rows, row_ok,
                 D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
        """A's epilogue: a head's halves + bias, rounded as the GEMM's output is, q and k
        rotated in float32 and rounded once (as the compiled layer's rotation), stored."""
        if HAS_BIAS:
            acc_a += tl.load(Bias + a).to(tl.float32)[:, None]
            acc_b += tl.load(Bias + a + D // 2).to(tl.float32)[:, None]
        x1 = acc_a.to(Qkv.dtype.element_ty).to(tl.float32)
        x2 = acc_b.to(Qkv.dtype.element_ty).to(tl.float32)
        if head < HQ + HKV:  # q and k heads turn; v heads do not
            half = tl.arange(0, D // 2)
            cs_at = rows[None, :] * (D // 2) + half[:, None]
            cos = tl.load(Cos + cs_at, mask=row_ok[None, :], other=0.0).to(tl.float32)
            sin = tl.load(Sin + cs_at, mask=row_ok[None, :], other=0.0).to(tl.float32)
            x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        QKV: tl.constexpr = (HQ + 2 * HKV) * D
        out = Qkv + rows[None, :] * QKV + a[:, None]
        tl.store(out, x1.to(Qkv.dtype.element_ty), mask=row_ok[None, :])
        tl.store(out + D // 2, x2.to(Qkv.dtype.element_ty), mask=row_ok[None, :])

    @triton.jit
    def _gated_out(acc_g, acc_u, cols, Act, rows, row_ok, I: tl.constexpr):  # noqa: E741
        """D's epilogue: SiLU(g)·u from the rounded gate and up, in float32, rounded once."""
        g = acc_g.to(Act.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Act.dtype.element_ty).to(tl.float32)
        out = Act + rows[None, :] * I + cols[:, None]
        tl.store(out, (g * tl.sigmoid(g) * u).to(Act.dtype.element_ty), mask=row_ok[None, :])

    @triton.jit
    def _signal_heads(ReadyB, head, HQ: tl.constexpr, HKV: tl.constexpr, ON: tl.constexpr,
                      G_P2: tl.constexpr):  # fmt: skip
        """`FLOW`'s signal of a finished qkv head to the query heads whose attention reads it:
        a q head to itself, a k or v head to each q head of its group (each q head waits for 3)."""
        if ON:
            G: tl.constexpr = HQ // HKV
            kv = tl.where(head < HQ + HKV, head - HQ, head - HQ - HKV)
            first = tl.where(head < HQ, head, kv * G)
            n = tl.where(head < HQ, 1, G)
            lane = tl.arange(0, G_P2)
            tl.debug_barrier()
            tl.atomic_add(ReadyB + first + lane, 1, mask=lane < n, sem="release", scope="gpu")

    @triton.jit
    def _step_qkv(
        X, SqIn, NormW, W, Bias, Cos, Sin, Qkv, Parts, Counts, ReadyB, Sync, EDone, M, eps, pid,
        nprog, layer, H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, K_PER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HIDDEN_TILE: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRET: tl.constexpr, WAIT: tl.constexpr, ON: tl.constexpr,
        G_P2: tl.constexpr,
    ):  # fmt: skip
        """A: (head, K slice) an item — a head's two halves (rows `a`, `a + D/2` of W) as two
        accumulators, so the rotation pairs them in registers. `FLOW`, past a launch's first
        layer: after every tile of the layer before's output (the norm reads whole rows)."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        if layer > 0:
            _await(EDone, layer * (H // HIDDEN_TILE), Sync, WAIT)
        rstd = _rstd(SqIn, rows, row_ok, eps, H, BLOCK_M, H // HIDDEN_TILE)
        HEADS: tl.constexpr = HQ + 2 * HKV
        for item in range(pid, HEADS * SPLITS, nprog):
            head, split, _ = _item(item, HEADS, D)
            a = head * D + tl.arange(0, D // 2)
            acc_a, acc_b = _products(
                X, rstd, NormW, W, rows, row_ok, a, split * K_PER, H, K_PER, D // 2, True,
                True, D // 2, BLOCK_M, BLOCK_K, PRECISION, INTERPRET,
            )  # fmt: skip
            if SPLITS == 1:
                _qkv_out(acc_a, acc_b, head, a, Bias, Cos, Sin, Qkv, rows, row_ok, D, HQ, HKV,
                         HAS_BIAS)  # fmt: skip
                _signal_heads(ReadyB, head, HQ, HKV, ON, G_P2)
            elif _arrive(acc_a, acc_b, Parts, Counts, head, split, rows, row_ok, a,
                         HEADS * D, D // 2, True, SPLITS, BLOCK_M):  # fmt: skip
                sum_a = _summed(Parts, rows, row_ok, a, HEADS * D, SPLITS, D // 2, BLOCK_M)
                sum_b = _summed(Parts, rows, row_ok, a + D // 2, HEADS * D, SPLITS, D // 2,
                                BLOCK_M)  # fmt: skip
                _qkv_out(sum_a, sum_b, head, a, Bias, Cos, Sin, Qkv, rows, row_ok, D, HQ, HKV,
                         HAS_BIAS)  # fmt: skip
                tl.atomic_xchg(Counts + head, 0)
                _signal_heads(ReadyB, head, HQ, HKV, ON, G_P2)

    @triton.jit
    def _segment_of(rows, CuSeq, n_seg, BLOCK_M: tl.constexpr, SEG_P: tl.constexpr):
        """Each row's causal segment: how many segment ends `cu_seqlens[1:]` are ≤ the row."""
        s = tl.arange(0, SEG_P)
        ends = tl.load(CuSeq + 1 + s, mask=s < n_seg, other=2147483647)
        return tl.sum((rows[:, None] >= ends[None, :]).to(tl.int32), 1)

    @triton.jit
    def _step_attention(
        Qkv, CuSeq, n_seg, Attn, Sync, ReadyB, ReadyC, M, scale, pid, nprog, rounds,
        D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
        BLOCK_M: tl.constexpr, SEG_P: tl.constexpr, INTERPRET: tl.constexpr,
        O_K_PER: tl.constexpr, WAIT: tl.constexpr, ON: tl.constexpr,
    ):  # fmt: skip
        """B: one query head a item, all rows at once — softmax(q kᵀ · scale) v over the keys
        of the row's own segment up to itself."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        d = tl.arange(0, D)
        seg = _segment_of(rows, CuSeq, n_seg, BLOCK_M, SEG_P)
        causal = (seg[:, None] == seg[None, :]) & (rows[None, :] <= rows[:, None])
        # keys past M never count; a padding row keeps its own key (no row without one: no NaN)
        allowed = causal & (row_ok[None, :] | (rows[None, :] == rows[:, None]))
        QKV: tl.constexpr = (HQ + 2 * HKV) * D
        for head in range(pid, HQ, nprog):
            # its q head, its group's k and v heads (3 a layer: the counts only grow)
            _await(ReadyB + head, 3 * rounds, Sync, WAIT)
            kv_head = head // (HQ // HKV)
            at = Qkv + rows[:, None] * QKV + d[None, :]
            ok = row_ok[:, None]
            q = tl.load(at + head * D, mask=ok, other=0.0, cache_modifier=".cg")
            k = tl.load(at + (HQ + kv_head) * D, mask=ok, other=0.0, cache_modifier=".cg")
            v = tl.load(at + (HQ + HKV + kv_head) * D, mask=ok, other=0.0, cache_modifier=".cg")
            if INTERPRET:
                q, k = q.to(tl.float32), k.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_M]
            s = tl.where(allowed, s, float("-inf"))
            p = tl.exp(s - tl.max(s, 1)[:, None])
            p = p / tl.sum(p, 1)[:, None]
            pv = p.to(v.dtype)
            if INTERPRET:
                pv, v = pv.to(tl.float32), v.to(tl.float32)
            o = tl.dot(pv, v)  # [BLOCK_M, D]
            out = Attn + rows[:, None] * (HQ * D) + head * D + d[None, :]
            tl.store(out, o.to(Attn.dtype.element_ty), mask=ok)
            _signal(ReadyC, head * D, D, O_K_PER, ON)

    @triton.jit
    def _residual_out(acc, Res, Out, Squares, tile, cols, rows, row_ok, H: tl.constexpr,
                      BLOCK_M: tl.constexpr):  # fmt: skip
        """Out[rows, cols] = Res + acc (float32, rounded once) and the rows' sums of squares of
        the rounded result over these columns (`Squares[tile]`, the next norm's)."""
        at = rows[None, :] * H + cols[:, None]
        res = tl.load(Res + at, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
        y = (acc + res.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + at, y, mask=row_ok[None, :])
        yf = y.to(tl.float32)
        tl.store(Squares + tile * BLOCK_M + rows, tl.sum(yf * yf, 0), mask=row_ok)

    @triton.jit
    def _step_residual(
        In, W, Res, Out, SqOut, Parts, Counts, Sync, Ready, Done, M, pid, nprog, rounds,
        H: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr, K_PER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRET: tl.constexpr, IN_TILE: tl.constexpr,
        WAIT: tl.constexpr, ON: tl.constexpr, SIGNAL_DONE: tl.constexpr,
    ):  # fmt: skip
        """C and E: Out = Res + In @ Wᵀ (o_proj on the attention, `down` on SiLU·mul),
        (column tile, K slice) an item, and Out's sums of squares per tile. `FLOW`: an item waits
        for the tiles of `In` (IN_TILE columns each) its slice reads; C's finished tiles are
        counted at `Done` (SIGNAL_DONE), what D waits for, and E's, what the next layer's A
        waits for. A count of every layer of a launch only grows: `rounds` layers' worth is what
        a wait needs."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        TILES: tl.constexpr = H // BLOCK_N
        for item in range(pid, TILES * SPLITS, nprog):
            tile, split, cols = _item(item, TILES, BLOCK_N)
            _await(Ready + split, rounds * _producers(split, K_PER, IN_TILE, K), Sync, WAIT)
            acc, _ = _products(
                In, None, None, W, rows, row_ok, cols, split * K_PER, K, K_PER, 0, False, False,
                BLOCK_N, BLOCK_M, BLOCK_K, PRECISION, INTERPRET,
            )  # fmt: skip
            if SPLITS == 1:
                _residual_out(acc, Res, Out, SqOut, tile, cols, rows, row_ok, H, BLOCK_M)
                _signal(Done, 0, 1, 1, ON and SIGNAL_DONE)
            elif _arrive(acc, acc, Parts, Counts, tile, split, rows, row_ok, cols, H, 0, False,
                         SPLITS, BLOCK_M):  # fmt: skip
                total = _summed(Parts, rows, row_ok, cols, H, SPLITS, BLOCK_N, BLOCK_M)
                _residual_out(total, Res, Out, SqOut, tile, cols, rows, row_ok, H, BLOCK_M)
                tl.atomic_xchg(Counts + tile, 0)
                _signal(Done, 0, 1, 1, ON and SIGNAL_DONE)

    @triton.jit
    def _step_gated(
        X1, Sq1, NormW, W, Act, Parts, Counts, Sync, CDone, ReadyE, M, eps, pid, nprog, rounds,
        H: tl.constexpr, I: tl.constexpr, SPLITS: tl.constexpr, K_PER: tl.constexpr,  # noqa: E741
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HIDDEN_TILE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
        DOWN_K_PER: tl.constexpr, WAIT: tl.constexpr, ON: tl.constexpr,
    ):  # fmt: skip
        """D: SiLU(g)·u of RMSNorm(x1), (column tile of gate's and up's, K slice) an item.
        `FLOW`: after every tile of x1 (the norm reads whole rows); each finished tile
        signalled to the K slices of `down` that read it."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        _await(CDone, rounds * (H // HIDDEN_TILE), Sync, WAIT)
        rstd = _rstd(Sq1, rows, row_ok, eps, H, BLOCK_M, H // HIDDEN_TILE)
        TILES: tl.constexpr = I // BLOCK_N
        for item in range(pid, TILES * SPLITS, nprog):
            tile, split, cols = _item(item, TILES, BLOCK_N)
            acc_g, acc_u = _products(
                X1, rstd, NormW, W, rows, row_ok, cols, split * K_PER, H, K_PER, I, True, True,
                BLOCK_N, BLOCK_M, BLOCK_K, PRECISION, INTERPRET,
            )  # fmt: skip
            if SPLITS == 1:
                _gated_out(acc_g, acc_u, cols, Act, rows, row_ok, I)
                _signal(ReadyE, tile * BLOCK_N, BLOCK_N, DOWN_K_PER, ON)
            elif _arrive(acc_g, acc_u, Parts, Counts, tile, split, rows, row_ok, cols, 2 * I, I,
                         True, SPLITS, BLOCK_M):  # fmt: skip
                g = _summed(Parts, rows, row_ok, cols, 2 * I, SPLITS, BLOCK_N, BLOCK_M)
                u = _summed(Parts, rows, row_ok, cols + I, 2 * I, SPLITS, BLOCK_N, BLOCK_M)
                _gated_out(g, u, cols, Act, rows, row_ok, I)
                tl.atomic_xchg(Counts + tile, 0)
                _signal(ReadyE, tile * BLOCK_N, BLOCK_N, DOWN_K_PER, ON)

    @triton.jit
    def _layer_steps(
        layer, total, X, SqIn, Out, SqOut, Between, SqBetween, Offsets, Norm1, Wqkv, Bqkv, Wo,
        Norm2, Wgu, Wd, Cos, Sin, CuSeq, n_seg, Qkv, Attn, X1, Sq1, Act, Parts, Parts2, Sync,
        Counts1, Counts2, ReadyB, ReadyC, CDone, ReadyE, EDone, M, eps, scale, pid, nprog,
        H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
        I: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,  # noqa: E741
        SEG_P: tl.constexpr, BLOCK_K: tl.constexpr, HIDDEN_TILE: tl.constexpr,
        INTER_TILE: tl.constexpr, QKV_SPLITS: tl.constexpr,
        QKV_K_PER: tl.constexpr, O_SPLITS: tl.constexpr, O_K_PER: tl.constexpr,
        GATED_SPLITS: tl.constexpr, GATED_K_PER: tl.constexpr, DOWN_SPLITS: tl.constexpr,
        DOWN_K_PER: tl.constexpr, PHASE: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr, PREFETCH: tl.constexpr, G_P2: tl.constexpr, STACKED: tl.constexpr,
        WAIT: tl.constexpr, ON: tl.constexpr, BARRIERS: tl.constexpr, AHEAD: tl.constexpr,
    ):  # fmt: skip
        """Layer `layer`'s steps A–E (of `total`), each program's part of them: `_layer_kernel`'s
        body, a function of its own so that one layer a launch compiles as before (the loop over
        a launch's layers, inlined, raised the kernel from 188 registers to 255 and 56 bytes of
        spills on sm_90: its values live across the whole body)."""
        BETWEEN: tl.constexpr = BLOCK_M * H  # one of `Between`'s two buffers
        rounds = layer + 1  # the layers a count has passed once this one's step is done
        if STACKED:
            at = Offsets + layer * 7
            norm1 = Norm1 + tl.load(at).to(tl.int64) * 16
            wqkv = Wqkv + tl.load(at + 1).to(tl.int64) * 16
            bqkv = Bqkv + tl.load(at + 2).to(tl.int64) * 16
            wo = Wo + tl.load(at + 3).to(tl.int64) * 16
            norm2 = Norm2 + tl.load(at + 4).to(tl.int64) * 16
            wgu = Wgu + tl.load(at + 5).to(tl.int64) * 16
            wd = Wd + tl.load(at + 6).to(tl.int64) * 16
        else:
            norm1, wqkv, bqkv, wo, norm2, wgu, wd = Norm1, Wqkv, Bqkv, Wo, Norm2, Wgu, Wd
        if layer == 0:
            x, sq_in = X, SqIn
        else:
            x = Between + ((layer - 1) % 2) * BETWEEN
            sq_in = SqBetween + ((layer - 1) % 2) * (H // HIDDEN_TILE) * BLOCK_M
        if layer == total - 1:
            out, sq_out = Out, SqOut
        else:
            out = Between + (layer % 2) * BETWEEN
            sq_out = SqBetween + (layer % 2) * (H // HIDDEN_TILE) * BLOCK_M
        # the layer before's output whole (its A reads whole rows): a barrier of its own
        if layer > 0:
            _grid_sync(Sync, 6, layer * nprog, BARRIERS)
        if PHASE < 0 or PHASE == 0:
            _step_qkv(
                x, sq_in, norm1, wqkv, bqkv, Cos, Sin, Qkv, Parts, Counts1, ReadyB, Sync,
                EDone, M, eps, pid, nprog, layer, H, D, HQ, HKV, HAS_BIAS, QKV_SPLITS,
                QKV_K_PER, BLOCK_M, BLOCK_K, HIDDEN_TILE, PRECISION, INTERPRET, WAIT, ON,
                G_P2,
            )  # fmt: skip
        if AHEAD:  # o_proj's and gate_up's slices stream in through the barrier and attention
            _prefetch_items(wo, pid, nprog, HQ * D, H // HIDDEN_TILE, O_SPLITS, O_K_PER,
                            HIDDEN_TILE, 0, False, PREFETCH)  # fmt: skip
            _prefetch_items(wgu, pid, nprog, H, I // INTER_TILE, GATED_SPLITS, GATED_K_PER,
                            INTER_TILE, I, True, PREFETCH)  # fmt: skip
        _grid_sync(Sync, 0, rounds * nprog, BARRIERS)
        if PHASE < 0 or PHASE == 1:
            _step_attention(
                Qkv, CuSeq, n_seg, Attn, Sync, ReadyB, ReadyC, M, scale, pid, nprog, rounds,
                D, HQ, HKV, BLOCK_M, SEG_P, INTERPRET, O_K_PER, WAIT, ON,
            )  # fmt: skip
        _grid_sync(Sync, 1, rounds * nprog, BARRIERS)
        if PHASE < 0 or PHASE == 2:
            _step_residual(
                Attn, wo, x, X1, Sq1, Parts2, Counts2, Sync, ReadyC, CDone, M, pid, nprog,
                rounds, H, HQ * D, O_SPLITS, O_K_PER, BLOCK_M, HIDDEN_TILE, BLOCK_K,
                PRECISION, INTERPRET, D, WAIT, ON, True,
            )  # fmt: skip
        if AHEAD:  # `down`'s, while gate_up's run
            _prefetch_items(wd, pid, nprog, I, H // HIDDEN_TILE, DOWN_SPLITS, DOWN_K_PER,
                            HIDDEN_TILE, 0, False, PREFETCH)  # fmt: skip
        _grid_sync(Sync, 2, rounds * nprog, BARRIERS)
        if PHASE < 0 or PHASE == 3:
            _step_gated(
                X1, Sq1, norm2, wgu, Act, Parts, Counts1, Sync, CDone, ReadyE, M, eps, pid,
                nprog, rounds, H, I, GATED_SPLITS, GATED_K_PER, BLOCK_M, INTER_TILE, BLOCK_K,
                HIDDEN_TILE, PRECISION, INTERPRET, DOWN_K_PER, WAIT, ON,
            )  # fmt: skip
        _grid_sync(Sync, 3, rounds * nprog, BARRIERS)
        if PHASE < 0 or PHASE == 4:
            _step_residual(
                Act, wd, X1, out, sq_out, Parts2, Counts2, Sync, ReadyE, EDone, M, pid, nprog,
                rounds, H, I, DOWN_SPLITS, DOWN_K_PER, BLOCK_M, HIDDEN_TILE, BLOCK_K,
                PRECISION, INTERPRET, INTER_TILE, WAIT, ON, True,
            )  # fmt: skip

    # the same steps as a called function, for the loop over a launch's layers (inlined there,
    # the loop kept the body's values live across it: 255 registers, 56 bytes of spills)
    _layer_steps_call = triton.jit(_layer_steps.fn, noinline=True)

    @grid_dependency.awaits
    @triton.jit
    def _layer_kernel(
        X, SqIn, Cos, Sin, CuSeq, n_seg,
        Norm1, Wqkv, Bqkv, Wo, Norm2, Wgu, Wd, Offsets,
        Qkv, Attn, X1, Sq1, Act, Parts, Out, SqOut, Between, SqBetween, Counters,
        M, eps, scale, first, count, total,
        SLOTS: tl.constexpr, COUNTED: tl.constexpr, PARTS2: tl.constexpr,
        H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
        I: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SEG_P: tl.constexpr,  # noqa: E741
        BLOCK_K: tl.constexpr, HIDDEN_TILE: tl.constexpr, INTER_TILE: tl.constexpr,
        QKV_SPLITS: tl.constexpr, QKV_K_PER: tl.constexpr, O_SPLITS: tl.constexpr,
        O_K_PER: tl.constexpr, GATED_SPLITS: tl.constexpr, GATED_K_PER: tl.constexpr,
        DOWN_SPLITS: tl.constexpr, DOWN_K_PER: tl.constexpr, PHASE: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr, FLOW: tl.constexpr, G_P2: tl.constexpr,
        FLOW_SLOTS: tl.constexpr, FLOW_P2: tl.constexpr, STACKED: tl.constexpr,
    ):  # fmt: skip
        """Decoder layers `first` .. `first + count - 1` of `total` over M ≤ BLOCK_M packed
        rows: steps A–E of each (the module's docstring), all of them with barriers (or `FLOW`'s
        counts) between (PHASE -1) or only step PHASE (the interpreter). Layer 0 reads X and
        SqIn, the last writes Out and SqOut, the ones between pass theirs on through `Between`
        and `SqBetween` (two of each, in turn). `STACKED`: layer k's weights are layer 0's
        pointers moved by `Offsets[k]` (16-element units: what `stack_offsets` measured, so the
        moved pointers keep 16-byte alignment for the compiler); else the pointers are the
        layer's own (one layer)."""
        await_inputs(PDL)
        # Inductor hands a user kernel Python floats typed fp64 (Triton's own launcher: fp32), as
        # in `attention.segments`: cast, so the norms' and the softmax's math stays float32
        if not INTERPRET:  # (the interpreter hands scalars over as Python floats)
            eps = tl.cast(eps, tl.float32)
            scale = tl.cast(scale, tl.float32)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        # `counters`: the barriers' slots; the tiles' arrival counts of A and D, then of C and E
        # (under FLOW a step may run while the one before is still summing: two regions, as
        # `Parts` has two, D's and E's reused only once A's and C's are all summed); FLOW's
        # counts, which only grow over a launch's layers (a wait needs the layers passed times
        # its count) and the last program out sets back
        Sync = Counters
        Counts1 = Counters + SLOTS
        Counts2 = Counts1 + COUNTED
        ReadyB = Counts2 + COUNTED  # a query head's: its q, k and v heads done (3 a layer)
        ReadyC = ReadyB + HQ  # an o_proj K slice's: the attention heads it reads done
        CDone = ReadyC + (HQ * D) // 16  # x1's column tiles done (D needs all: whole rows)
        ReadyE = CDone + 1  # a `down` K slice's: the SiLU·mul tiles it reads done
        EDone = ReadyE + I // 16  # the output's column tiles done (the next layer's A: all)
        Parts2 = Parts + PARTS2
        SYNC: tl.constexpr = PHASE < 0
        # FLOW's waits: spun on in the one launch of every step; checked in the interpreter's
        # launch a step; none where one step is timed alone (what it waits for never runs)
        WAIT: tl.constexpr = (1 if SYNC else 2 if INTERPRET else 0) if FLOW else 0
        ON: tl.constexpr = WAIT > 0  # FLOW's signals
        BARRIERS: tl.constexpr = SYNC and not FLOW
        # the prefetches: inline assembly, which the interpreter cannot run
        AHEAD: tl.constexpr = PREFETCH > 0 and SYNC and not INTERPRET
        if STACKED:
            for layer in range(first, first + count):
                _layer_steps_call(
                    layer, total, X, SqIn, Out, SqOut, Between, SqBetween, Offsets, Norm1, Wqkv,
                    Bqkv, Wo, Norm2, Wgu, Wd, Cos, Sin, CuSeq, n_seg, Qkv, Attn, X1, Sq1, Act,
                    Parts, Parts2, Sync, Counts1, Counts2, ReadyB, ReadyC, CDone, ReadyE, EDone, M,
                    eps, scale, pid, nprog, H, D, HQ, HKV, I, HAS_BIAS, BLOCK_M, SEG_P, BLOCK_K,
                    HIDDEN_TILE, INTER_TILE, QKV_SPLITS, QKV_K_PER, O_SPLITS, O_K_PER, GATED_SPLITS,
                    GATED_K_PER, DOWN_SPLITS, DOWN_K_PER, PHASE, PRECISION, INTERPRET, PREFETCH,
                    G_P2, STACKED, WAIT, ON, BARRIERS, AHEAD,
                )  # fmt: skip
        else:  # one layer: no loop around it
            _layer_steps(
                first, total, X, SqIn, Out, SqOut, Between, SqBetween, Offsets, Norm1, Wqkv, Bqkv,
                Wo, Norm2, Wgu, Wd, Cos, Sin, CuSeq, n_seg, Qkv, Attn, X1, Sq1, Act, Parts, Parts2,
                Sync, Counts1, Counts2, ReadyB, ReadyC, CDone, ReadyE, EDone, M, eps, scale, pid,
                nprog, H, D, HQ, HKV, I, HAS_BIAS, BLOCK_M, SEG_P, BLOCK_K, HIDDEN_TILE, INTER_TILE,
                QKV_SPLITS, QKV_K_PER, O_SPLITS, O_K_PER, GATED_SPLITS, GATED_K_PER, DOWN_SPLITS,
                DOWN_K_PER, PHASE, PRECISION, INTERPRET, PREFETCH, G_P2, STACKED, WAIT, ON,
                BARRIERS, AHEAD,
            )  # fmt: skip
        # the last program out sets the counters back for the next call (the interpreter's: the
        # last of the last layer's last step's launch, where FLOW left counts)
        if SYNC or (ON and PHASE == 4):
            if first + count == total:
                tl.debug_barrier()
                if tl.atomic_add(Sync + 4, 1, sem="acq_rel", scope="gpu") == nprog - 1:
                    for slot in range(0, 4):
                        tl.atomic_xchg(Sync + slot, 0)
                    tl.atomic_xchg(Sync + 6, 0)
                    if ON:
                        at = tl.arange(0, FLOW_P2)
                        zero = tl.zeros([FLOW_P2], tl.int32)
                        tl.store(ReadyB + at, zero, mask=at < FLOW_SLOTS)
                    tl.atomic_xchg(Sync + 4, 0, sem="release", scope="gpu")

    def _cut(k: int, splits: int, rows: int) -> tuple[int, int, int]:
        """(slices, K a slice, weight rows) of a GEMM over K = `k` cut into at most `splits`
        slices of whole BLOCK_K steps (fewer where K is short)."""
        per = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
        return triton.cdiv(k, per), per, rows

    @triton_op("boundgen::fused_layers", mutates_args=("counters",))
    def _fused_layers(
        x: torch.Tensor,
        squares: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        norm1: torch.Tensor,
        qkv: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        o_proj: torch.Tensor,
        norm2: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        offsets: torch.Tensor | None,
        counters: torch.Tensor,
        eps: float,
        head_dim: int,
        kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers over x [M, H] → (out [M, H], its sums of squares per hidden tile
        [H / HIDDEN_TILE, LIMIT] float32). `squares`: x's, as that (`first_squares`);
        `counters` int32 (`new_counters`), zero: the barriers' slots, the column tiles' arrival
        counts, `FLOW`'s counts (one tensor: as two written views of one buffer, the traced
        forward ran ~50 `slice` copy kernels besides, fifty-second session's profile). The
        weights are one layer's; with `offsets` (int64 [L, 7], `stack_offsets`) the first of L
        layers', the others' found from them, all L in one launch."""
        m, h = x.shape
        tiles = h // HIDDEN_TILE
        if tuple(squares.shape) != (tiles, LIMIT):  # the kernel reads that many, unchecked
            raise ValueError(f"squares {tuple(squares.shape)}: want ({tiles}, {LIMIT})")
        layers = 1 if offsets is None else offsets.shape[0]
        if offsets is not None and (offsets.dtype != torch.int64 or offsets.shape[1:] != (7,)):
            raise ValueError(f"offsets {offsets.dtype} {tuple(offsets.shape)}: want int64 [L, 7]")
        d = head_dim
        heads = o_proj.shape[1] // d
        inter = down.shape[1]
        width = (heads + 2 * kv_heads) * d
        per_region = _counted(h, inter, heads + 2 * kv_heads)
        flow_slots = _flow_slots(heads, d, inter)
        if counters.numel() < SYNC_SLOTS + 2 * per_region + flow_slots:
            raise ValueError(f"counters of {counters.numel()}: too few (`new_counters`)")
        dev, dt = x.device, x.dtype
        qkv_s = torch.empty((m, width), dtype=dt, device=dev)
        attn = torch.empty((m, heads * d), dtype=dt, device=dev)
        x1 = torch.empty_like(x)
        sq1 = torch.empty((tiles, LIMIT), dtype=torch.float32, device=dev)
        act = torch.empty((m, inter), dtype=dt, device=dev)
        # (slices, K a slice, weight rows) of A's, C's, D's and E's GEMMs
        cuts = [
            _cut(h, QKV_SPLITS, width),
            _cut(heads * d, O_SPLITS, h),
            _cut(h, GATED_SPLITS, 2 * inter),
            _cut(inter, DOWN_SPLITS, h),
        ]
        # the float32 partials: A's or D's in a first region, C's or E's in a second (`FLOW`
        # lets C begin while A is still summing; D and E begin only once A and C have summed)
        floats = [splits * LIMIT * rows if splits > 1 else 0 for splits, _, rows in cuts]
        first = max(floats[0], floats[2])
        size = max(first + max(floats[1], floats[3]), 1)
        parts = torch.empty(size, dtype=torch.float32, device=dev)
        out = torch.empty_like(x)
        sq_out = torch.empty((tiles, LIMIT), dtype=torch.float32, device=dev)
        between, sq_between = _between(layers, x, tiles)
        n_seg = cu_seqlens.shape[0] - 1
        interpret = not x.is_cuda
        phases = STEPS if STEPS is not None else range(5) if interpret else (-1,)
        bias = qkv_bias if qkv_bias is not None else qkv  # unread without HAS_BIAS
        # a cooperative launch starts every program at once or none (the barriers' need): two
        # forwards on two streams cannot each hold multiprocessors the other's programs wait for.
        # Eager launches only: traced (`TRACED`), Inductor launches the kernel itself.
        launch = (
            {} if interpret or torch.compiler.is_compiling() else {"launch_cooperative_grid": True}
        )
        # every layer in one launch on the GPU; the interpreter's launches run a layer's step
        # each, in order (what the GPU's one launch orders by its barriers or waits)
        spans = [(k, 1) for k in range(layers)] if interpret else [(0, layers)]
        for span_first, span_count in spans:
            for phase in phases:
                traceable(_layer_kernel)[(programs(dev),)](
                    x, squares, cos, sin, cu_seqlens, n_seg,
                    norm1, qkv, bias, o_proj, norm2, gate_up, down,
                    offsets if offsets is not None else counters,  # unread unless STACKED
                    qkv_s, attn, x1, sq1, act, parts, out, sq_out, between, sq_between, counters,
                    m, eps, d**-0.5, span_first, span_count, layers,
                    SLOTS=SYNC_SLOTS, COUNTED=per_region, PARTS2=first,
                    H=h, D=d, HQ=heads, HKV=kv_heads, I=inter, HAS_BIAS=qkv_bias is not None,
                    BLOCK_M=LIMIT, SEG_P=max(triton.next_power_of_2(n_seg), 2), BLOCK_K=BLOCK_K,
                    HIDDEN_TILE=HIDDEN_TILE, INTER_TILE=INTER_TILE,
                    QKV_SPLITS=cuts[0][0], QKV_K_PER=cuts[0][1], O_SPLITS=cuts[1][0],
                    O_K_PER=cuts[1][1], GATED_SPLITS=cuts[2][0], GATED_K_PER=cuts[2][1],
                    DOWN_SPLITS=cuts[3][0], DOWN_K_PER=cuts[3][1], PHASE=phase,
                    PRECISION=triton_launch.dot_precision(x), INTERPRET=interpret,
                    PDL=grid_dependency.waits(x), PREFETCH=32 * NUM_WARPS if PREFETCH else 0,
                    FLOW=bool(FLOW), G_P2=triton.next_power_of_2(heads // kv_heads),
                    FLOW_SLOTS=flow_slots, FLOW_P2=triton.next_power_of_2(flow_slots),
                    STACKED=offsets is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                    **launch,
                )  # fmt: skip
        # FLOW's waits the steps before did not meet (the interpreter counts them)
        missed = int(counters[5]) if interpret and FLOW else 0
        if missed:
            counters[5] = 0
            raise RuntimeError(f"layer kernel: {missed} FLOW waits found their count short")
        return out, sq_out


def _between(layers: int, x: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the layers between a launch's first and last hand their output (and its sums of
    squares) on: two buffers used in turn, since a layer's input is read until the next layer's
    A is done ([2, LIMIT, H], [2, tiles, LIMIT]); fewer layers, fewer (one layer: a placeholder,
    unread)."""
    n = min(layers - 1, 2)
    if n == 0:
        return x.new_empty(1), x.new_empty(1, dtype=torch.float32)
    return (
        x.new_empty((n, LIMIT, x.shape[1])),
        x.new_empty((n, tiles, LIMIT), dtype=torch.float32),
    )


def first_squares(x: torch.Tensor) -> torch.Tensor:
    """x's rows' sums of squares as the first layer's `squares` [H / HIDDEN_TILE, LIMIT]
    (float32), laid out as a layer leaves its output's: the whole sum in the first tile, zeros
    in the others (adding them changes nothing), so every layer's norm sums a known count of
    tiles."""
    sq = torch.nn.functional.pad(x.float().pow(2).sum(-1), (0, LIMIT - x.shape[0]))
    squares = sq.new_zeros((x.shape[1] // HIDDEN_TILE, LIMIT))
    squares[0] = sq
    return squares


def _counted(hidden: int, inter: int, qkv_heads: int) -> int:
    """The column tiles of the GEMM with the most (each tile's slices count their arrivals):
    the counts of one of `counters`' two arrival regions."""
    return max(hidden // HIDDEN_TILE, inter // INTER_TILE, qkv_heads)


def _flow_slots(heads: int, head_dim: int, inter: int) -> int:
    """`FLOW`'s counts: one a query head, one an o_proj K slice, x1's finished tiles, one a
    `down` K slice (room for slices as narrow as 16 columns, `tl.dot`'s least K), the output's
    finished tiles."""
    return heads + heads * head_dim // 16 + 1 + inter // 16 + 1


def new_counters(model, device) -> torch.Tensor:
    """The zeroed `counters` a forward's layers share (each call leaves them zero): the
    barriers' slots, two regions of arrival counts, `FLOW`'s counts."""
    cfg = model.config
    counts = _counted(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads + 2 * cfg.num_kv_heads)
    flow = _flow_slots(cfg.num_heads, cfg.head_dim, cfg.intermediate_size)
    return torch.zeros(SYNC_SLOTS + 2 * counts + flow, dtype=torch.int32, device=device)


def first_inputs(model, x, cos, sin) -> tuple[torch.Tensor, ...]:
    """What the first layer's op takes beside x: (cos, sin [M, D/2] from `RotaryEmbedding`'s
    [M, 1, D/2], x's `first_squares`, zeroed `new_counters` every layer shares)."""
    cos, sin = cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous()
    return cos, sin, first_squares(x), new_counters(model, x.device)


def op_args(layer, x, squares, cos, sin, cu_seqlens, counters, offsets=None) -> tuple:
    """The `fused_layers` op's arguments for `layer` over x (cos, sin [M, D/2]); with `offsets`
    (`stack_offsets`), `layer` is the model's first and the op runs every layer."""
    a, mlp = layer.self_attn, layer.mlp
    return (
        x, squares, cos, sin, cu_seqlens,
        layer.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias,
        a.o_proj.weight, layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight, mlp.down_proj.weight, offsets, counters,
        layer.input_layernorm.eps, a.head_dim, a.num_kv_heads,
    )  # fmt: skip


def _layer_weights(layer) -> list[torch.Tensor]:
    """A layer's weights in the order the kernel's `Offsets` rows hold them (no bias: qkv's
    weight again, unread)."""
    a, mlp = layer.self_attn, layer.mlp
    bias = a.qkv_proj.bias if a.qkv_proj.bias is not None else a.qkv_proj.weight
    return [
        layer.input_layernorm.weight, a.qkv_proj.weight, bias, a.o_proj.weight,
        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
    ]  # fmt: skip


_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_offsets(model) -> torch.Tensor | None:
    """Where each layer's weights lie from the first layer's, for one launch of every layer:
    int64 [L, 7] in units of 16 elements (so the kernel's moved pointers keep the 16-byte
    alignment its loads are compiled for), on the weights' device. None where a distance is not
    a whole number of 16 elements (weights as views into a buffer at odd offsets): the layers
    then take a launch each. Made once per model and placement of its weights."""
    weights = [_layer_weights(layer) for layer in model.layers]
    key = tuple(w.data_ptr() for ws in weights for w in ws)
    cached = _OFFSETS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = []
    for ws in weights:
        row = []
        for w, w0 in zip(ws, weights[0]):
            distance = w.data_ptr() - w0.data_ptr()
            unit = 16 * w.element_size()
            if w.dtype != w0.dtype or distance % unit:
                _OFFSETS[model] = (key, None)
                return None
            row.append(distance // unit)
        rows.append(row)
    offsets = torch.tensor(rows, dtype=torch.int64).to(weights[0][0].device)
    _OFFSETS[model] = (key, offsets)
    return offsets


def launches(model) -> list[tuple[torch.nn.Module, torch.Tensor | None]]:
    """The op calls a forward of `model` makes, each as (the layer whose weights it is given,
    its `offsets`): with `STACK`, eagerly, one for every layer (`stack_offsets`); else one a
    layer."""
    if STACK and not torch.compiler.is_compiling():
        offsets = stack_offsets(model)
        if offsets is not None:
            return [(model.layers[0], offsets)]
    return [(layer, None) for layer in model.layers]


def run_layers(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
    """Every layer of `model` over x [M, H] through the kernel (`applies` said so): cos, sin
    [M, 1, D/2] as `RotaryEmbedding` gives them, the op called as `launches` says; one zeroed
    counter buffer serves every call (each leaves it zero)."""
    cos, sin, squares, counters = first_inputs(model, x, cos, sin)
    for layer, offsets in launches(model):
        args = op_args(layer, x, squares, cos, sin, attn.cu_seqlens, counters, offsets)
        x, squares = torch.ops.boundgen.fused_layers(*args)
    return x
