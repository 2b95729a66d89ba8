"""Issue 24 item 2 / issue 25's W3: a weight-streaming GEMM for few rows against cuBLAS, on the GPU.

    python benchmarks/bench_weight_stream.py --out $OUT/weight_stream.json     # H100/H200, ~2 min

At 16–64 rows (a beam decode step, a W3 prompt) a decoder's four GEMMs only stream their weights:
Qwen2.5-0.5B's layer is 29.7 MB, 9 µs at 3.35 TB/s, but cuBLAS's kernels run W3's layer in ~26 µs
(BENCHMARKS.md, thirty-sixth session: gate_up 2.0 TB/s, `down` 1.0 TB/s with its split-K reduce, qkv
and o_proj 0.4 TB/s). The earlier few-row fused kernels (norm + GEMM + epilogue, K summed in the
kernel; removed) streamed at 0.35–1.41 TB/s (twenty-sixth session). This kernel is the plain GEMM
`x @ W.T` only, built for the stream:

- "swap AB": the weight tile [BLOCK_N, BLOCK_K] is the MMA's left operand (the MMA's M is the
  weight's columns, ≥ 64: Hopper's warpgroup MMA), the rows of x its right one (N = the few rows);
- K split over SPLIT_K programs a column tile, each writing its own fp32 partial [M, N] — no
  atomics, no counters to zero, no reduction kernel of its own: in a layer the sum over the
  partials is one more input of the elementwise kernel that follows the GEMM (Inductor fuses
  `partials.sum(0) + residual` into the residual + RMSNorm it already runs). Timed here alone
  (`kernel`) and with a separate `sum(0)` (`+sum`), the two bounds of that.

`--shapes gated`: gate_up with SiLU·mul as its epilogue (`models/stream_gated.py`, its tiles swept)
against cuBLAS's gate_up and Inductor's SiLU·mul kernel (what the compiled layers run), checked
against the same. `--shapes rotated`: qkv (+ bias) with the q/k rotation as its epilogue
(`models/stream_qkv.py`) against cuBLAS's biased GEMM and Inductor's rotation kernel.

Per GEMM shape of the preset (qkv, o_proj, gate_up, down) and row count, the device µs of one call
replayed from a CUDA graph over `--layers` weight copies called in turn (past the L2: one layer's
weights would stay in it), the bytes streamed over that time, for cuBLAS (`F.linear`) and for the
fastest tiles of the sweep (BLOCK_N × BLOCK_K × SPLIT_K × stages, 4 warps); each tile checked
against cuBLAS (max abs difference, fp32 accumulation both).
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

from boundgen.models import stream, stream_gated, stream_qkv
from boundgen.models.layers import apply_rope

# (name, K, N): Qwen2.5-0.5B's projections (x [M, K] @ W [N, K].T)
SHAPES = {
    "qkv": (896, 1152),
    "o_proj": (896, 896),
    "gate_up": (896, 9728),
    "down": (4864, 896),
}


@triton.jit
def _stream_mm_tma(
    x_desc,
    w_desc,
    Out,
    M,
    N,
    K,
    stride_os,
    stride_om,
    K_PER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`models.stream`'s kernel with both tiles loaded by the Tensor Memory Accelerator
    (host-made descriptors: no pointer tensors in registers, zero fill past the edges)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k0 = pid_k * K_PER
    for k in range(k0, tl.minimum(k0 + K_PER, K), BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = x_desc.load([0, k])
        acc += tl.dot(w, tl.trans(x))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    out = Out + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc, mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


def stream_mm(x, w, block_n, block_k, split_k, stages, warps=4, tma=False):
    """x [M, K] @ w [N, K].T as float32 partials [splits, M, N]: `stream.launch` (pointer loads)
    or the TMA kernel above, the same tile."""
    if not tma:
        return stream.launch(x, w, split_k, block_n, block_k, warps, stages)
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per = stream.k_per(k, split_k, block_k)
    split = triton.cdiv(k, k_per)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    _stream_mm_tma[(triton.cdiv(n, block_n), split)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(w, [block_n, block_k]),
        out,
        m,
        n,
        k,
        out.stride(0),
        out.stride(1),
        K_PER=k_per,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def tiles(k: int, n: int, quick: bool):
    """(BLOCK_N, BLOCK_K, SPLIT_K, stages, TMA) to time for a K × N weight."""
    splits = (1, 2, 4, 8, 16) if k > 2048 else (1, 2, 4)
    if n > 4096:
        splits = (1, 2)
    blocks_n, blocks_k, stages = (64, 128), (64, 128, 256), (3, 5)
    if quick:
        blocks_n, blocks_k, stages, splits = (64,), (128,), (3,), splits[:2]
    # the pointer loads for one tile a split (their pointer tensors take 128–255 registers a
    # thread and spill at BLOCK_N 128: Triton's sm_90 build), every tile with TMA loads
    plain = [(64, 128, s, 3, False) for s in splits]
    return plain + list(itertools.product(blocks_n, blocks_k, splits, stages, (True,)))


def time_tile(row, label, call, w0, want, per_layer, nbytes, total=lambda out: out) -> float | None:
    """One tile's `call`: its largest difference from `want` (of `total` of its output on the
    first weight `w0`), its µs a layer and the weight's TB/s, into `row[label]` → its µs; a tile
    over the shared-memory limit: its error there, None."""
    try:
        diff = (total(call(w0)).float() - want).abs().max().item()
        us = per_layer(call)
    except Exception as exc:  # a tile over the shared-memory limit
        row[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return None
    row[label] = {"us": us, "tb_s": nbytes / us / 1e6, "max_abs_diff": diff}
    return us


def gated_tiles(quick: bool, m: int):
    """(BLOCK_N, BLOCK_K, warps, stages) to time for gate_up + SiLU·mul at `m` rows (BLOCK_N
    columns of each half): the one `stream_gated.tile_for` gives, or all."""
    if quick:
        return [stream_gated.tile_for(m)]
    grid = itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5))
    return [(bn, bk, 4, st) for bn, bk, st in grid]


def sweep_fused(name, args, ws, per_layer_of, plain_label, setup) -> dict:
    """A fused kernel's tiles at each row count against the plain ops it replaces (µs a layer,
    the weight's TB/s, max |difference| from the float32 oracle): `setup(m)` → (plain call, the
    oracle's output on the first weight, [(tile label, call)]), each call taking a weight."""
    nbytes = ws[0].numel() * ws[0].element_size()
    rows = {}
    for m in args.rows:
        plain, want, calls = setup(m)
        per_layer = per_layer_of(ws)
        row = {"rows": m, "weight_mb": nbytes / 1e6}
        plain(ws[0])  # compiled before the graph is captured
        us = per_layer(plain)
        diff = (plain(ws[0]).float() - want).abs().max().item()
        row[plain_label] = {"us": us, "tb_s": nbytes / us / 1e6, "max_abs_diff": diff}
        timed = []
        for label, call in calls:
            us = time_tile(row, label, call, ws[0], want, per_layer, nbytes)
            if us is not None:
                timed.append((us, label))
        timed.sort()
        row["best"] = [label for _, label in timed[:5]]
        rows[f"{name} m{m}"] = row
        best = row[timed[0][1]] if timed else {}
        print(
            f"{name:8s} M={m:3d} {nbytes / 1e6:6.2f} MB  {plain_label} "
            f"{row[plain_label]['us']:6.2f} µs  best {timed[0][1] if timed else '-'}: "
            f"{best.get('us', float('nan')):6.2f} µs ({best.get('tb_s', 0):.2f} TB/s)  "
            f"diff {best.get('max_abs_diff', float('nan')):.2e} (plain "
            f"{row[plain_label]['max_abs_diff']:.2e})",
            flush=True,
        )
    return rows


def _weights(args, g, k: int, n: int) -> list[torch.Tensor]:
    return [
        torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        for _ in range(args.layers)
    ]


def time_gated(args, g, per_layer_of) -> dict:
    """gate_up + SiLU·mul at each row count: cuBLAS + Inductor's SiLU·mul kernel against the
    streamed kernel's tiles."""
    k, two_i = SHAPES["gate_up"]
    i = two_i // 2
    ws = _weights(args, g, k, two_i)
    silu_mul = torch.compile(lambda gu: F.silu(gu[:, :i]) * gu[:, i:], dynamic=False)

    def setup(m):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        calls = [
            (f"n{t[0]} k{t[1]} st{t[3]}", lambda w, t=t: stream_gated.launch(x, w, t))
            for t in gated_tiles(args.quick, m)
        ]
        plain = lambda w: silu_mul(F.linear(x, w))
        return plain, stream_gated.reference(x, ws[0]).float(), calls

    return sweep_fused("gated", args, ws, per_layer_of, "cuBLAS + SiLU·mul", setup)


def rotated_tiles(quick: bool):
    """(BLOCK_H, most rows a program, BLOCK_K, warps, stages) to time for qkv + the rotation."""
    q = stream_qkv
    if quick:
        return [(q.BLOCK_H, q.MAX_BLOCK_M, q.BLOCK_K, q.NUM_WARPS, q.NUM_STAGES)]
    grid = itertools.product((16, 32), (16, 32, 64), (64, 128, 256), (3, 4))
    return [(bh, bm, bk, 4, st) for bh, bm, bk, st in grid]


def time_rotated(args, g, per_layer_of) -> dict:
    """qkv (+ bias) and the q/k rotation at each row count: cuBLAS's biased GEMM + Inductor's
    rotation kernel (the compiled layers' path) against the streamed kernel's tiles."""
    k, n = SHAPES["qkv"]
    d, kv = 64, 128  # Qwen2.5-0.5B: heads of 64, K and V 128 columns each
    rot = n - 2 * kv
    ws = _weights(args, g, k, n)
    bias = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1

    def rotation(y, cos, sin):
        t = y.shape[0]
        qk = apply_rope(y[:, :rot].view(t, rot // d, d), cos, sin).reshape(t, rot)
        return torch.cat((qk, y[:, rot:]), dim=1)

    rotation = torch.compile(rotation, dynamic=False)

    def setup(m):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        theta = torch.rand(m, 1, d // 2, device="cuda", generator=g) * 6.3
        cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
        calls = [
            (
                f"h{t[0]} m{t[1]} k{t[2]} st{t[4]}",
                lambda w, t=t: stream_qkv.launch(x, w, bias, cos, sin, rot, t),
            )
            for t in rotated_tiles(args.quick)
        ]
        plain = lambda w: rotation(F.linear(x, w, bias), cos, sin)
        want = stream_qkv.reference(x, ws[0], bias, cos, sin, rot).float()
        return plain, want, calls

    return sweep_fused("rotated", args, ws, per_layer_of, "cuBLAS + rotation", setup)


# the fused kernels' sweeps, by --shapes name
FUSED = {"gated": time_gated, "rotated": time_rotated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    shapes = [*SHAPES, *FUSED]
    ap.add_argument("--shapes", nargs="+", default=shapes, choices=shapes)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="one tile a shape (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_weight_stream needs CUDA")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    result = {"env": env_info(), "layers": args.layers, "shapes": {}}

    def per_layer_of(ws):
        return lambda fn: graph_us(lambda: [fn(w) for w in ws], args.iters) / len(ws)

    for name in args.shapes:
        if name in FUSED:
            result["shapes"].update(FUSED[name](args, g, per_layer_of))
            continue
        k, n = SHAPES[name]
        ws = [
            torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            for _ in range(args.layers)
        ]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            row = {"rows": m, "weight_mb": nbytes / 1e6}
            per_layer = per_layer_of(ws)

            us = per_layer(lambda w: F.linear(x, w))
            row["cublas"] = {"us": us, "tb_s": nbytes / us / 1e6}
            timed = []
            for bn, bk, sk, st, tma in tiles(k, n, args.quick):
                label = f"n{bn} k{bk} s{sk} st{st}" + (" tma" if tma else "")
                call = lambda w, a=(bn, bk, sk, st), t=tma: stream_mm(x, w, *a, tma=t)
                us = time_tile(row, label, call, ws[0], want, per_layer, nbytes, lambda p: p.sum(0))
                if us is None:
                    continue
                if sk > 1:  # with the partials summed apart
                    row[label]["us_with_sum"] = per_layer(lambda w, c=call: c(w).sum(0))
                timed.append((us, label))
            timed.sort()
            row["best"] = [label for _, label in timed[:5]]
            result["shapes"][f"{name} m{m}"] = row
            best = row[timed[0][1]] if timed else {}
            print(
                f"{name:8s} M={m:3d} {nbytes / 1e6:6.2f} MB  cuBLAS {row['cublas']['us']:6.2f} µs "
                f"({row['cublas']['tb_s']:.2f} TB/s)  best {timed[0][1] if timed else '-'}: "
                f"{best.get('us', float('nan')):6.2f} µs ({best.get('tb_s', 0):.2f} TB/s, "
                f"+sum {best.get('us_with_sum', best.get('us', float('nan'))):6.2f})  "
                f"diff {best.get('max_abs_diff', float('nan')):.2e}",
                flush=True,
            )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
