"""Packed prefill attention, one layer's call: flash attention (causal varlen call + the cascade's
cross call + LSE merge + cat) against the Triton `segments` kernel (one call), on the GPU.

    # H200 (a minute):
    python benchmarks/bench_attention.py --out $OUT/attention.json
    # also sweep the kernel's tiles (BLOCK_M, BLOCK_N, warps, stages):
    python benchmarks/bench_attention.py --sweep --out $OUT/attention.json

Layouts (Qwen2.5-0.5B heads by default: 14 query heads, 2 KV heads, head_dim 64):
- w2: one query prefix of 256 tokens + 100 candidates × 16 tokens (one cascade group), padded into
  the bucket `--w2-bucket` (default t2048-s128-m512-g2-p320-q1728, as the server runs it) and as
  packed (`w2-unpadded`);
- w1: plain sequences of 64–256 tokens (DESIGN §9 W1 lengths) packed to 8192 tokens, padded into
  `--w1-bucket` (default t8192-s256-m512);
- w5: eight W2 requests merged, as the W5 server runs them at saturation (eight cascade groups,
  14,848 tokens), padded into `--w5-bucket` (default: the largest of `common.w5_buckets`);
- w3: one 64-token prompt in W3's bucket `--w3-bucket` (default t64-s4-m64, `profile_w3.py`'s):
  the kernel's default tile makes 16 programs there (64 rows: 9 tokens × 7 query heads each, 2
  KV heads), 4 µs a layer in W3's graph on an H100 (BENCHMARKS.md, thirty-ninth session).

Each variant is timed two ways with CUDA events: `graph_us`, one call captured in a CUDA graph and
replayed (GPU time, what `aoti+graphs` buckets see), and `eager_us`, back-to-back eager calls
(adds the Python/launch cost of every kernel). `max_abs_diff` is against flash.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, graph_us, w1_prompts, w5_buckets, write_json

from boundgen.attention.backends import get_backend
from boundgen.attention.cascade import prefill_attention
from boundgen.compile.attention import FlashBackend
from boundgen.compile.buckets import Bucket, BucketSet
from boundgen.text.packing import SequenceGroup, pack


def layouts(args) -> dict:
    w2_request = SequenceGroup([1] * 256, [[2] * 16 for _ in range(100)])
    w2 = pack([w2_request])
    w5 = pack([w2_request] * 8)
    lens, total = [], 0
    for p in w1_prompts(1000):
        if total + len(p) > 8192:
            break
        lens.append(len(p))
        total += len(p)
    w1 = pack([SequenceGroup([], [[1] * n for n in lens])])
    w3 = pack([SequenceGroup([], [[3] * 64])])
    out = {"w2-unpadded": w2}
    padded = (
        ("w2", w2, args.w2_bucket),
        ("w1", w1, args.w1_bucket),
        ("w5", w5, args.w5_bucket),
        ("w3", w3, args.w3_bucket),
    )
    for name, batch, spec in padded:
        bucket, padded = BucketSet([Bucket.parse(spec)]).pad(batch)
        if bucket is None:
            raise SystemExit(f"{name} does not fit bucket {spec}")
        out[name] = padded
    return out


def time_us(fn, iters: int) -> dict:
    """Per-call microseconds: CUDA-graph replay and back-to-back eager calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    eager = start.elapsed_time(end) * 1e3 / iters
    try:
        replayed = graph_us(fn, iters)
    except Exception as exc:  # a variant that cannot be captured still reports its eager time
        replayed = f"error: {exc}"
    return {"graph_us": replayed, "eager_us": eager}


def with_tile(segments, tile, backend, q, k, v, a):
    """The kernel through the backend with another tile (BLOCK_M, BLOCK_N, warps, stages)."""
    saved = dict(segments.CONFIGS)
    segments.CONFIGS.update(dict.fromkeys(saved, tile))
    try:
        return prefill_attention(q, k, v, a, backend)
    finally:
        segments.CONFIGS.update(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--w2-bucket", default="t2048-s128-m512-g2-p320-q1728")
    p.add_argument("--w1-bucket", default="t8192-s256-m512")
    p.add_argument("--w5-bucket", default=w5_buckets(warmup=False)[-1])
    p.add_argument("--w3-bucket", default="t64-s4-m64")
    p.add_argument("--layouts", nargs="+", default=None, help="only these layouts (default: all)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--sweep", action="store_true", help="also time other kernel tiles")
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs CUDA")
    from boundgen.attention import segments

    dtype = getattr(torch, args.dtype)
    flash, aten = get_backend("varlen", "cuda"), FlashBackend()
    aten.prepare("cuda")
    ours = get_backend("segments", "cuda")
    result = {
        "env": env_info(),
        "heads": [args.heads, args.kv_heads, args.head_dim],
        "dtype": args.dtype,
        "default_tile": segments.config_for(args.head_dim),
        "layouts": {},
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, batch in layouts(args).items():
        if args.layouts and name not in args.layouts:
            continue
        batch = batch.to("cuda")
        a, t = batch.attn, batch.num_tokens
        mk = lambda h: torch.randn(t, h, args.head_dim, device="cuda", generator=g, dtype=dtype)
        q, k, v = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
        want = prefill_attention(q, k, v, a, flash)
        row = {
            "tokens": t,
            "segments": int(a.cu_seqlens.shape[0]) - 1,
            "max_seqlen": a.max_seqlen,
            "cascade": a.has_shared_prefix,
        }
        variants = {
            "flash (varlen_attn)": lambda: prefill_attention(q, k, v, a, flash),
            "flash (aten, AOTI's)": lambda: prefill_attention(q, k, v, a, aten),
            "segments": lambda: prefill_attention(q, k, v, a, ours),
        }
        if args.sweep:
            # BLOCK_M counts rows (tokens × the GQA group): 7 query heads a KV head make 64 rows
            # 9 tokens, so a program re-reads its group's prefix for every 9 tokens; 16 rows (2
            # tokens) spread a short prompt (W3) over more programs
            tiles = itertools.product((16, 32, 64, 128, 256), (32, 64), (4, 8), (2, 3))
            for tile in tiles:
                label = "segments m{} n{} w{} s{}".format(*tile)
                variants[label] = lambda tile=tile: with_tile(segments, tile, ours, q, k, v, a)
        for label, fn in variants.items():
            try:
                got = fn()
                diff = (got.float() - want.float()).abs().max().item()
                row[label] = {**time_us(fn, args.iters), "max_abs_diff": diff}
            except Exception as exc:  # e.g. a tile over the shared-memory limit
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        timed = {
            label: res["graph_us"]
            for label, res in row.items()
            if isinstance(res, dict) and isinstance(res.get("graph_us"), float)
        }
        if timed:
            best = min(timed, key=timed.get)
            row["best"] = {"variant": best, "graph_us": timed[best]}
        if "segments" in timed and "flash (aten, AOTI's)" in timed:
            row["flash_over_segments"] = timed["flash (aten, AOTI's)"] / timed["segments"]
        result["layouts"][name] = row
        fastest = sorted(timed.items(), key=lambda kv: kv[1])[:6]
        print(name, {label: round(us, 1) for label, us in fastest}, file=sys.stderr)
    print(json.dumps(result, indent=2, default=str))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
