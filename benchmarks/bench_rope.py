"""Where W1's RoPE kernel time goes (issue 25 item 3): the model's q/k rotation compiled by Inductor
three ways, over the 24 layers of one W1 chunk (8,192 tokens, Qwen2.5-0.5B heads 14/2 × 64, bf16).

- `computed`: cos/sin from the positions inside the graph, as `RotaryEmbedding` did until
  2026-12-02; Inductor inlined the sin/cos into every layer's rotation kernel (the per-kernel
  table of a W1 call showed `..._cos_mul_sin_split...`: 42 µs a call).
- `table`: cos/sin gathered by position from a precomputed table (a buffer), as
  `RotaryEmbedding` does now (`models.layers.rope_tables`).
- `inputs`: cos/sin materialized outside the graph (the floor: the rotation alone).

    python benchmarks/bench_rope.py --out rope.json       # CUDA only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, graph_us, write_json

from boundgen.models.layers import apply_rope


def rotations(variant: str, inv_freq: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]):
    """fn(qkvs, positions[, cos, sin]) → the rotated q and k of every layer."""

    def rotate_all(qkvs, cos, sin, heads, kv_heads, d):
        out = []
        for qkv in qkvs:
            t = qkv.shape[0]
            q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            out.append(apply_rope(q.view(t, heads, d), cos, sin))
            out.append(apply_rope(k.view(t, kv_heads, d), cos, sin))
        return out

    def computed(qkvs, positions, heads, kv_heads, d):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos = freqs.cos().to(qkvs[0].dtype).unsqueeze(1)
        sin = freqs.sin().to(qkvs[0].dtype).unsqueeze(1)
        return rotate_all(qkvs, cos, sin, heads, kv_heads, d)

    def gathered(qkvs, positions, heads, kv_heads, d):
        cos, sin = table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)
        return rotate_all(qkvs, cos, sin, heads, kv_heads, d)

    return {"computed": computed, "table": gathered, "inputs": rotate_all}[variant]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("Q", "KV", "D"))
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rope needs CUDA")
    heads, kv_heads, d = args.heads
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    all_pos = torch.arange(args.max_positions, device=dev).float()[:, None] * inv_freq[None, :]
    table = (all_pos.cos().to(dt), all_pos.sin().to(dt))
    # W1-like positions: prompts of 64-256 tokens packed into the chunk
    lengths, total = [], 0
    while total < args.tokens:
        n = min(int(torch.randint(64, 257, ()).item()), args.tokens - total)
        lengths.append(n)
        total += n
    positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
    qkvs = [
        torch.randn(args.tokens, (heads + 2 * kv_heads) * d, device=dev, dtype=dt)
        for _ in range(args.layers)
    ]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos_in, sin_in = freqs.cos().to(dt).unsqueeze(1), freqs.sin().to(dt).unsqueeze(1)
    results, outputs = {}, {}
    for variant in ("computed", "table", "inputs"):
        fn = torch.compile(rotations(variant, inv_freq, table), fullgraph=True)
        if variant == "inputs":
            call = lambda fn=fn: fn(qkvs, cos_in, sin_in, heads, kv_heads, d)
        else:
            call = lambda fn=fn: fn(qkvs, positions, heads, kv_heads, d)
        outputs[variant] = call()
        us = graph_us(call, args.iters)
        results[variant] = {"us_per_chunk": us, "us_per_layer": us / args.layers}
    ref = outputs["computed"]
    for variant in ("table", "inputs"):
        results[variant]["max_abs_diff_vs_computed"] = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(outputs[variant], ref)
        )
    moved = 2 * args.tokens * (heads + kv_heads) * d * 2  # read q, k and write them, bf16
    for r in results.values():
        r["tb_s"] = moved / (r["us_per_layer"] * 1e-6) / 1e12
    print(f"{'variant':10} {'µs/layer':>9} {'TB/s':>6} {'max |Δ| vs computed':>20}")
    for name, r in results.items():
        diff = r.get("max_abs_diff_vs_computed", 0.0)
        print(f"{name:10} {r['us_per_layer']:9.1f} {r['tb_s']:6.2f} {diff:20.4g}")
    write_json(args.out, {"env": env_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
