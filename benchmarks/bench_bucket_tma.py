"""Issue 25 item 3: a prefill bucket's GEMMs with their pointwise pass as the epilogue
(`models/bucket_tma.py`: gate_up + SiLU·mul, qkv + bias + the q/k rotation) against cuBLAS +
Inductor's pointwise kernel, at W2's 1,920 rows and W1's 8,192–14,912, on the GPU.

    python benchmarks/bench_bucket_tma.py --out $OUT/bucket_tma.json      # H100/H200, ~1–2 min

On the H200 (forty-third session) W2's graph spends 1,152 µs in cuBLAS's gate_up (24 layers,
~450 TFLOPS) and 309 µs in Inductor's SiLU·mul (a memory pass: the [T, 2I] output read back,
[T, I] written), 240 µs in qkv + bias and 167 µs in the q/k rotation. The eleventh session's
fused gate_up (RMSNorm on its input, pointer loads, two accumulators) reached ~300 TFLOPS and was
removed: it lost 1.5x to the pair. What differs here: no norm on the operand path (the
forty-fifth session measured that scaling a streamed operand in registers costs more than the
kernel it saves), TMA loads (the copy engine feeds shared memory; no pointer tensors in
registers), persistent programs (one an SM walking the output tiles).

gate_up's variants (each a tile sweep, `--quick`: one tile each; `two-pers` is the engine's
kernel, `bucket_tma.launch_gated`, the others this file's):
- `two`: gate's and up's rows of a column tile (`cols`, `I + cols`) through two descriptor loads
  into two float32 accumulators — the checkpoint's own [2I, K] layout;
- `inter`: the weight's rows interleaved once (gate j, up j, …): one [2·BLOCK_N, K] load and
  one accumulator a step, split into gate and up in registers (an MMA accumulator keeps adjacent
  columns in one thread: the split moves nothing).
qkv: the engine's kernel (`bucket_tma.launch_qkv`), its tiles swept, against cuBLAS's biased
GEMM and Inductor's rotation of q's and k's heads.

Per row count: device µs of one call replayed from a CUDA graph over `--layers` weight copies
called in turn, TFLOPS of the GEMM, max |difference| from the float32 oracle (SiLU·mul over the
float32 GEMM; `stream_qkv.reference`).
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

from boundgen.models import bucket_tma, stream_qkv
from boundgen.models.bucket_tma import _tile_of
from boundgen.models.layers import apply_rope

# Qwen2.5-0.5B: hidden, intermediate, q heads, kv heads, head size
K, INTER, HEADS, KV_HEADS, HEAD_D = 896, 4864, 14, 2, 64
ROT = (HEADS + KV_HEADS) * HEAD_D


@triton.jit
def _gated_variant_kernel(
    x_desc,
    w_desc,
    o_desc,
    M,
    INTER_N,
    K,
    PROGRAMS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER_N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        if INTERLEAVED:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x_desc.load([off_m, ki * BLOCK_K])
                b = w_desc.load([pid_n * 2 * BLOCK_N, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        else:
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x_desc.load([off_m, ki * BLOCK_K])
                g = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                u = w_desc.load([INTER_N + pid_n * BLOCK_N, ki * BLOCK_K])
                gate = tl.dot(a, g.T, gate)
                up = tl.dot(a, u.T, up)
        h = gate / (1.0 + tl.exp(-gate)) * up
        o_desc.store([off_m, pid_n * BLOCK_N], h.to(o_desc.dtype))


def gated_variant(x, w, tile, interleaved: bool, persistent: bool):
    """SiLU(x @ gate.T) · (x @ up.T) [M, I]: the engine's kernel (`bucket_tma.launch_gated`: two
    accumulators, persistent) or the variants above; `w` is [2I, K] as the checkpoint holds it, or
    interleaved (row 2j gate j, 2j + 1 up j)."""
    if not interleaved and persistent:
        return bucket_tma.launch_gated(x, w, tile)
    bm, bn, bk, group_m, warps, stages = tile
    m, k = x.shape
    i = w.shape[0] // 2
    out = torch.empty((m, i), device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(m, bm) * triton.cdiv(i, bn)
    programs = bucket_tma.programs(tiles, x) if persistent else tiles  # one an SM, as the engine's
    _gated_variant_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [2 * bn if interleaved else bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        m,
        i,
        k,
        PROGRAMS=programs,
        INTERLEAVED=interleaved,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def interleave(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows → gate 0, up 0, gate 1, up 1, …"""
    i = w.shape[0] // 2
    return torch.stack((w[:i], w[i:]), dim=1).reshape(w.shape).contiguous()


def tiles(quick: bool):
    """(BLOCK_M, BLOCK_N (output columns), BLOCK_K, GROUP_M, warps, stages) to time."""
    if quick:
        return [(128, 128, 64, 8, 8, 3)]
    out = []
    for bm, bn, bk, stages in itertools.product((64, 128), (64, 128), (64, 128), (3, 4)):
        # shared memory: the stages' x tile + 2·BLOCK_N weight rows, and the output tile (bf16)
        if (bm + 2 * bn) * bk * 2 * stages + bm * bn * 2 > 220_000:
            continue
        # a warpgroup (4 warps) per 64 rows: 64–128 float32 accumulator registers a thread
        out.append((bm, bn, bk, 8, 4 * bm // 64, stages))
    return out


def qkv_tiles(quick: bool):
    """(BLOCK_M, BLOCK_H (pairs a tile, ≤ D/2), BLOCK_K, GROUP_M, warps, stages) to time."""
    if quick:
        return [bucket_tma.qkv_tile(HEAD_D)]
    grid = itertools.product((64, 128), (16, 32), (64, 128), (3, 4))
    return [(bm, bh, bk, 8, 4 * bm // 64, st) for bm, bh, bk, st in grid]


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
    comparable as is) into `row[label]`; a tile that fails to launch, its error."""

    def record(label, call, weights, check=None):
        try:
            diff = ((check or call)(x0, weights[0]).float() - want).abs().max().item()
            us = per_layer(call, weights)
        except Exception as exc:  # a tile over the shared-memory limit
            row[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            return
        row[label] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1), "diff": diff}

    return record


def report(name, m, row, baseline, result) -> None:
    timed = sorted((v["us"], k) for k, v in row.items() if "us" in v and k != "cublas")
    result[name][m] = {"timings": row, "best": [k for _, k in timed[:8]]}
    best = ", ".join(
        f"{k} {row[k]['us']} µs ({row[k]['tflops']} TF, diff {row[k]['diff']:.3g})"
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
        for interleaved, persistent in ((False, False), (True, False), (False, True), (True, True)):
            label = f"{'inter' if interleaved else 'two'}{'-pers' if persistent else ''} "
            record(
                label + "x".join(map(str, tile)),
                lambda x, w, t=tile, i=interleaved, p=persistent: gated_variant(x, w, t, i, p),
                wis if interleaved else ws,
            )
    report("gated", m, row, "cublas+silu_mul", result)


def time_qkv(args, g, m, result) -> None:
    n = ROT + KV_HEADS * HEAD_D
    ws = [
        (torch.randn(n, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03,
         torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1)
        for _ in range(args.layers)
    ]  # fmt: skip
    xs = [torch.randn(m, K, device="cuda", generator=g, dtype=torch.bfloat16) for _ in ws]
    theta = torch.rand(m, 1, HEAD_D // 2, device="cuda", generator=g) * 6.3
    cos, sin = theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)
    rotate = torch.compile(
        lambda y: apply_rope(y[:, :ROT].view(m, HEADS + KV_HEADS, HEAD_D), cos, sin)
    )
    want = stream_qkv.reference(xs[0], *ws[0], cos, sin, ROT).float()
    row = {}
    record = recorder(row, timer(args, xs), xs[0], want, 2 * m * K * n)

    # the plain path: the GEMM, then q's and k's heads rotated (v is the GEMM's own columns;
    # compared as one [M, N] with them)
    def plain(x, w):
        y = F.linear(x, *w)
        return torch.cat((rotate(y).reshape(m, ROT), y[:, ROT:]), 1)

    record("cublas", lambda x, w: F.linear(x, *w), ws, plain)  # the GEMM alone
    record("cublas+rotation", lambda x, w: rotate(F.linear(x, *w)), ws, plain)
    for tile in qkv_tiles(args.quick):
        record(
            "pers " + "x".join(map(str, tile)),
            lambda x, w, t=tile: bucket_tma.launch_qkv(x, *w, cos, sin, ROT, t),
            ws,
        )
    report("qkv", m, row, "cublas+rotation", result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1920, 8192, 14912])
    ap.add_argument("--gemms", nargs="+", default=["gated", "qkv"], choices=["gated", "qkv"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one tile a variant (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"env": env_info(), "k": K, "inter": INTER, "gated": {}, "qkv": {}}
    for m in args.rows:
        for gemm in args.gemms:
            (time_gated if gemm == "gated" else time_qkv)(args, g, m, result)
            write_json(args.out, result)  # after each: a phase cut short keeps the done


if __name__ == "__main__":
    main()
