"""A beam-search decode step's attention kernel (`attention/beam_decode.py`) alone, at W4's shapes:
its tiles and load orders side by side in one process, on the GPU.

W4 is prompt 128, width 16, 4 steps on Qwen2.5-0.5B heads (14 query heads, 2 KV heads, head_dim
64, bf16); a search calls the kernel 24 layers × 3 decode steps = 72 times. A variant is
`rRwWnN`: R rows (beam × GQA head) a program, W warps, N prompt keys a tile (`beam_decode.BLOCK_N`).
(The thirtieth session's run also had the own slots loaded after the prompt's keys, the kernel's
order until then, under a switch since removed.) Each is timed two ways:
`graph_us`, a CUDA graph of 24 calls replayed (µs a call, launch gaps inside the graph included),
and `kernel_us`, the kernel's own mean duration under torch.profiler; `max_abs_diff` is against
the first variant.

    python benchmarks/bench_beam_decode.py --out beam_decode.json      # CUDA only, ~30 s
    python benchmarks/bench_beam_decode.py --variants r16w4n64 r16w4n128 r32w4n128 --batches 32
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, graph_us, kernel_table, write_json

from boundgen.attention import beam_decode

VARIANT = re.compile(r"r(\d+)w(\d+)n(\d+)")
KEYS = (32, 64, 128)


def parse_variant(name: str) -> dict:
    """`rRwWnN` → the kernel's settings; a clear error for anything else."""
    m = VARIANT.fullmatch(name)
    if m is None:
        raise SystemExit(f"{name!r}: expected rRwWnN, e.g. r16w4n64 or r32w4n128")
    rows, warps, keys = map(int, m.groups())
    ok = rows in beam_decode.BLOCK_ROWS and warps in beam_decode.WARPS and keys in KEYS
    if not ok:
        raise SystemExit(
            f"{name!r}: rows in {beam_decode.BLOCK_ROWS}, warps in {beam_decode.WARPS}, "
            f"keys in {KEYS}"
        )
    return {"rows": rows, "warps": warps, "keys": keys}


def inputs(batch: int, width: int, prompt: int, heads: tuple[int, int, int], slots: int):
    """One decode step's tensors: `batch` prompts of `prompt` tokens, `width` beams each."""
    hq, hkv, d = heads
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    n, t = batch * width, batch * prompt
    cu = lambda step, count: torch.arange(
        0, step * (count + 1), step, device="cuda", dtype=torch.int32
    )
    return (
        mk(n, hq, d),
        mk(t, hkv, d),
        mk(t, hkv, d),
        mk(n, slots, hkv, d),
        mk(n, slots, hkv, d),
        cu(width, batch),
        cu(prompt, batch),
    )


def kernel_us(fn, calls: int = 24) -> float:
    """The decode-attention kernel's mean duration over `calls` calls of `fn`, from the profiler's
    per-kernel table (`common.kernel_table`); 0 when it did not run."""
    table = kernel_table(lambda: [fn() for _ in range(calls)])
    row = next((r for r in table["kernels"] if "_beam_decode_kernel" in r["kernel"]), None)
    return row["ms"] * 1e3 / row["calls"] if row else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("Q", "KV", "D"))
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["r16w4n64", "r16w4n128", "r32w4n64", "r32w4n128"],
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = {name: parse_variant(name) for name in args.variants}
    if not torch.cuda.is_available():
        raise SystemExit("bench_beam_decode needs CUDA")
    results = []
    for batch in args.batches:
        q, pk, pv, bk, bv, cu_b, cu_p = inputs(
            batch, args.width, args.prompt, tuple(args.heads), args.slots
        )
        for step in sorted({0, args.slots - 1}):
            s = torch.tensor([step], device="cuda", dtype=torch.int64)
            first = None
            for name, v in variants.items():
                with mock.patch.object(beam_decode, "BLOCK_N", v["keys"]):
                    fn = lambda: beam_decode.beam_decode(
                        q, pk, pv, bk, bv, s, cu_b, cu_p, args.width, v["rows"], v["warps"]
                    )
                    out = fn()
                    torch.cuda.synchronize()
                    first = out if first is None else first
                    row = {
                        "batch": batch,
                        "step": step,
                        "variant": name,
                        "graph_us": round(graph_us(fn, args.iters, reps=24), 2),
                        "kernel_us": round(kernel_us(fn), 2),
                        "max_abs_diff": (out.float() - first.float()).abs().max().item(),
                    }
                results.append(row)
                print(
                    f"b{batch} step {step} {name:>12}: {row['graph_us']:6.2f} µs a call in a graph,"
                    f" kernel {row['kernel_us']:6.2f} µs, diff {row['max_abs_diff']:.1e}",
                    flush=True,
                )
    write_json(args.out, {"env": env_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
