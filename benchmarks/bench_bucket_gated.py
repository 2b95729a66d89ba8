"""Issue 25 item 3: a prefill bucket's gate_up with SiLU·mul as the GEMM's epilogue
(`models/bucket_gated.py`) against cuBLAS + Inductor's SiLU·mul, at W2's 1,920 rows and W1's
8,192–14,912, on the GPU; and how the kernel's operands reach shared memory.

    python benchmarks/bench_bucket_gated.py --out $OUT/bucket_gated.json      # H100/H200, ~1–2 min

On the H200 (forty-third session) W2's graph spent 1,152 µs in cuBLAS's gate_up (24 layers,
~450 TFLOPS) and 309 µs in Inductor's SiLU·mul (a memory pass: the [T, 2I] output read back,
[T, I] written). The forty-seventh session's first run (host-side TMA descriptors, 128 × 64
tiles, three stages) beat the pair at every size; persistent programs lost, and host-side
descriptors cannot go through `torch.compile` or AOTInductor (torch 2.11), so the engine's kernel
loads through pointers. This times, each over a tile sweep (`--quick`: one tile each):
- `engine`: `bucket_gated.launch_gated`, pointer loads, a program a tile;
- `tma-two`: host-side TMA descriptors, gate's and up's rows of a column tile (`cols`,
  `I + cols`) as two loads into two float32 accumulators — the checkpoint's own [2I, K] layout;
- `tma-inter`: the same with the weight's rows interleaved once (gate j, up j, …): one
  [2·BLOCK_N, K] load and one accumulator a step, split into gate and up in registers;
- `tma-device`: `tma-two` with the descriptors made in the kernel (`tl.make_tensor_descriptor`,
  what a compiled package could carry; Triton's allocator gives their scratch);
- `tma-ws-k`: `tma-device` with its K loop warp-specialized (one tile a program);
- `tma-persist` and `tma-ws`: `tma-device` as persistent programs (one an SM, walking the tiles
  GROUP_M row tiles at a time; `tma-persist` is the engine's `BOUNDGEN_BUCKET_GATED=persist` kernel,
  `bucket_gated.launch_gated(..., persistent=True)`), `tma-ws` the same loop written here,
  warp-specialized (`tl.range(..., warp_specialize=True)`: load warps feed the MMA warps, whose
  epilogue then overlaps the next tile's loads — what cuBLAS's kernels do; Triton's Hopper pass,
  triton-lang/triton#7642, at 4 warps a program: `ws_tile`). Whether the GPU image's Triton (3.6)
  specialized it, the compiled kernel's warps say (`compiled_warps` in the JSON: 12 where it did).
  Why: in W1's profile (forty-eighth session, H100) cuBLAS's gate_up took 26.19 ms a call and the
  engine's kernel, SiLU·mul included, 33.21; at cuBLAS's GEMM time W1 would be ~7 ms (~10 %) faster.
  The forty-seventh session's persistent programs had neither device descriptors nor warp
  specialization. On the H100 (fifty-first session, Triton 3.6) `tma-ws` compiled to 12 warps and
  beat the pair, but every tile's output held NaN;
- `tma-persist-inter` and `tma-ws-inter`: the two over `tma-inter`'s interleaved weight, one dot
  a K step (Triton 3.6's Hopper pass cannot partition its split: `tma-ws-inter` fails to
  compile there; 3.9 compiles it).

Per row count: device µs of one call replayed from a CUDA graph over `--layers` weight copies
called in turn, TFLOPS of the GEMM, max |difference| from the float32 oracle (SiLU·mul over the
float32 GEMM) and, where some are past bf16 noise, the fraction of wrong elements (`wrong`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, graph_us, write_json

from boundgen.models import bucket_gated
from boundgen.models.bucket_gated import _tile_of

# Qwen2.5-0.5B: hidden, intermediate
K, INTER = 896, 4864
# |difference| from the oracle past bf16 noise (the right kernels' max is ~0.03)
WRONG = 0.25


@triton.jit
def _gated_tile(
    x_desc,
    w_desc,
    off_m,
    off_n,
    INTER_N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WS_K: tl.constexpr,
):
    """SiLU·mul of the output tile at (off_m, off_n) in float32: x's tile loaded once a K step
    for gate's rows of the tile's columns and up's (`INTER_N` rows further): two dots; with
    INTERLEAVED the weight's rows alternate (gate j, up j) and one [2·BLOCK_N] dot takes both,
    split in registers. WS_K: the K loop warp-specialized."""
    if INTERLEAVED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WS_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([2 * off_n, k]).T, acc)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WS_K):
            a = x_desc.load([off_m, k])
            gate = tl.dot(a, w_desc.load([off_n, k]).T, gate)
            up = tl.dot(a, w_desc.load([INTER_N + off_n, k]).T, up)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gated_variant_kernel(
    x_desc,
    w_desc,
    o_desc,
    M,
    INTER_N: tl.constexpr,
    K: tl.constexpr,
    DEVICE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WS_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One output tile a program; with DEVICE the three arguments are the tensors' pointers and
    the descriptors are made here."""
    if DEVICE:
        x_desc = tl.make_tensor_descriptor(x_desc, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_desc, [2 * INTER_N, K], [K, 1], [BLOCK_N, BLOCK_K])
        o_desc = tl.make_tensor_descriptor(o_desc, [M, INTER_N], [INTER_N, 1], [BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER_N, BLOCK_N)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    h = _gated_tile(
        x_desc,
        w_desc,
        off_m,
        pid_n * BLOCK_N,
        INTER_N,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        INTERLEAVED,
        WS_K,
    )
    o_desc.store([off_m, pid_n * BLOCK_N], h.to(o_desc.dtype))


@triton.jit
def _gated_persistent_kernel(
    X,
    W,
    Out,
    M,
    INTER_N: tl.constexpr,
    K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """`_gated_variant_kernel`'s `tma-two` with the descriptors made here, as persistent
    programs: program p takes tiles p, p + NUM_PROGRAMS, … (`tma-inter`'s one dot with
    INTERLEAVED)."""
    W_ROWS: tl.constexpr = 2 * BLOCK_N if INTERLEAVED else BLOCK_N
    x_desc = tl.make_tensor_descriptor(X, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(W, [2 * INTER_N, K], [K, 1], [W_ROWS, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(Out, [M, INTER_N], [INTER_N, 1], [BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER_N, BLOCK_N)
    for tile in tl.range(
        tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        h = _gated_tile(
            x_desc, w_desc, off_m, off_n, INTER_N, K, BLOCK_M, BLOCK_N, BLOCK_K, INTERLEAVED, False
        )
        o_desc.store([off_m, off_n], h.to(o_desc.dtype))


# the variants this file's persistent kernel runs (`tma-persist` is the engine's)
PERSISTENT = ("tma-ws", "tma-persist-inter", "tma-ws-inter")
VARIANTS = ("engine", "tma-persist", "tma-two", "tma-inter", "tma-device", "tma-ws-k")
VARIANTS += PERSISTENT
# "variant tile" → the warps its persistent kernel compiled to (12 where Triton specialized it)
COMPILED_WARPS: dict[str, int] = {}


def gated_variant(x, w, tile, variant: str):
    """SiLU(x @ gate.T) · (x @ up.T) [M, I]: the engine's kernel or a TMA variant above; `w` is
    [2I, K] as the checkpoint holds it, or interleaved (row 2j gate j, 2j + 1 up j) for
    the `-inter` variants."""
    if variant in ("engine", "tma-persist"):
        return bucket_gated.launch_gated(x, w, tile, persistent=variant == "tma-persist")
    bm, bn, bk, group_m, warps, stages = tile
    m, k = x.shape
    i = w.shape[0] // 2
    out = torch.empty((m, i), device=x.device, dtype=x.dtype)
    meta = dict(INTER_N=i, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    meta.update(num_warps=warps, num_stages=stages)
    inter = variant.endswith("-inter")
    if variant in PERSISTENT:
        programs = bucket_gated._programs(x, triton.cdiv(m, bm) * triton.cdiv(i, bn))
        compiled = _gated_persistent_kernel[(programs,)](
            x,
            w,
            out,
            m,
            NUM_PROGRAMS=programs,
            WARP_SPECIALIZE=variant.startswith("tma-ws"),
            INTERLEAVED=inter,
            **meta,
        )
        label = f"{variant} " + "x".join(map(str, tile))
        COMPILED_WARPS[label] = getattr(getattr(compiled, "metadata", None), "num_warps", warps)
        return out
    device = variant in ("tma-device", "tma-ws-k")
    if device:
        args = (x, w, out)
    else:
        args = (
            TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(w, [2 * bn if inter else bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]),
        )
    _gated_variant_kernel[(triton.cdiv(m, bm) * triton.cdiv(i, bn),)](
        *args, m, DEVICE=device, INTERLEAVED=inter, WS_K=variant == "tma-ws-k", **meta
    )
    return out


def interleave(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows → gate 0, up 0, gate 1, up 1, …"""
    i = w.shape[0] // 2
    return torch.stack((w[:i], w[i:]), dim=1).reshape(w.shape).contiguous()


def tiles(quick: bool):
    """(BLOCK_M, BLOCK_N (output columns), BLOCK_K, GROUP_M, warps, stages) to time."""
    if quick:
        return [bucket_gated.GATED_TILE]
    out = []
    for bm, bn, bk, stages in itertools.product((64, 128), (64, 128), (64, 128), (3, 4)):
        # shared memory: the stages' x tile + 2·BLOCK_N weight rows, and the output tile (bf16)
        if (bm + 2 * bn) * bk * 2 * stages + bm * bn * 2 > 220_000:
            continue
        # a warpgroup (4 warps) per 64 rows: 64–128 float32 accumulator registers a thread
        out.append((bm, bn, bk, 8, 4 * bm // 64, stages))
    return out


def ws_tile(tile):
    """`tile` as `tma-ws` takes it: 4 warps, which Triton's Hopper warp specialization turns into
    a load warpgroup and two MMA warpgroups (12 warps: sm_90 compiles with Triton 3.9, checked in
    tests/test_bench_bucket_gated.py); with 8 it leaves the loop as it is, silently."""
    bm, bn, bk, group_m, _, stages = tile
    return (bm, bn, bk, group_m, 4, stages)


def timer(args, xs):
    """µs of one `call(x, weight)` a layer, replayed from a CUDA graph over the weight copies
    called in turn (each with its own x)."""

    def per_layer(call, weights):
        state = {"i": 0}

        def one():
            i = state["i"] = (state["i"] + 1) % len(weights)
            return call(xs[i], weights[i])

        for i in range(len(weights)):  # compiled before capture
            call(xs[i], weights[i])
        return graph_us(one, args.iters, reps=len(weights))

    return per_layer


def recorder(row, per_layer, x0, want, flops):
    """`record(label, call, weights, check)`: a call's µs, TFLOPS and max |difference| from
    `want` (of its output on the first weight, or of `check`'s where its output is not
    comparable as is) into `row[label]`, and the fraction of elements off by more than bf16
    noise (NaN included: which tiles a wrong kernel misses); a tile that fails to launch, its
    error."""

    def record(label, call, weights, check=None):
        try:
            delta = ((check or call)(x0, weights[0]).float() - want).abs()
            diff = delta.max().item()
            wrong = (~(delta <= WRONG)).float().mean().item()
            us = per_layer(call, weights)
        except Exception as exc:  # a tile over the shared-memory limit
            row[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            return
        row[label] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1), "diff": diff}
        if wrong:
            row[label]["wrong"] = round(wrong, 4)

    return record


def report(name, m, row, baseline, result) -> None:
    timed = sorted((v["us"], k) for k, v in row.items() if "us" in v and k != "cublas")
    result[name][m] = {"timings": row, "best": [k for _, k in timed[:8]]}
    best = ", ".join(
        f"{k} {row[k]['us']} µs ({row[k]['tflops']} TF, diff {row[k]['diff']:.3g}"
        + (f", {row[k]['wrong']:.1%} wrong)" if "wrong" in row[k] else ")")
        for _, k in timed[:6]
    )
    print(
        f"{name} M={m}: cuBLAS {row['cublas'].get('us')} µs, {baseline} "
        f"{row[baseline].get('us')} µs; best: {best}",
        flush=True,
    )
    errors = [k for k, v in row.items() if "error" in v]
    if errors:
        print(f"  {len(errors)} tiles failed, e.g. {errors[0]}: {row[errors[0]]['error']}")


def time_gated(args, g, m, result) -> None:
    ws = [
        torch.randn(2 * INTER, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03
        for _ in range(args.layers)
    ]
    wis = [interleave(w) for w in ws]
    silu_mul = torch.compile(lambda y: F.silu(y[:, :INTER]) * y[:, INTER:])
    xs = [torch.randn(m, K, device="cuda", generator=g, dtype=torch.bfloat16) for _ in ws]
    y = xs[0].float() @ ws[0].float().T
    want = F.silu(y[:, :INTER]) * y[:, INTER:]
    row = {}
    record = recorder(row, timer(args, xs), xs[0], want, 2 * m * K * 2 * INTER)
    plain = lambda x, w: silu_mul(F.linear(x, w))
    record("cublas", lambda x, w: F.linear(x, w), ws, plain)  # the GEMM alone, checked with it
    record("cublas+silu_mul", plain, ws)
    for tile in tiles(args.quick):
        for variant in args.variants:
            t = ws_tile(tile) if variant.startswith("tma-ws") else tile
            record(
                f"{variant} " + "x".join(map(str, t)),
                lambda x, w, t=t, v=variant: gated_variant(x, w, t, v),
                wis if variant.endswith("-inter") else ws,
            )
    report("gated", m, row, "cublas+silu_mul", result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1920, 8192, 14912])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one tile a variant (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    triton.set_allocator(bucket_gated._scratch)
    result = {
        "env": env_info(),
        "k": K,
        "inter": INTER,
        "tile": bucket_gated.GATED_TILE,
        "gated": {},
    }
    for m in args.rows:
        time_gated(args, g, m, result)
        result["compiled_warps"] = dict(COMPILED_WARPS)
        write_json(args.out, result)  # after each: a phase cut short keeps the done


if __name__ == "__main__":
    main()
