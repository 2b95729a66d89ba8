"""Where a bucket's RoPE kernel time goes (issue 25 item 3): the model's q/k rotation compiled by
Inductor, over the 24 layers of one chunk (`--tokens`: W1's 8,192, W2's 1,920; Qwen2.5-0.5B heads
14/2 × 64, bf16), q and k rotated as one run of heads as `Attention.heads` does by default
(`--apart`: one rotation each).

Where cos/sin come from (`--variants`):
- `computed`: from the positions inside the graph, as `RotaryEmbedding` did until 2026-12-02;
  Inductor inlined the sin/cos into every layer's rotation kernel (the per-kernel table of a W1
  call showed `..._cos_mul_sin_split...`: 42 µs a call).
- `table`: gathered by position from a precomputed table (a buffer), as `RotaryEmbedding` does
  now (`models.layers.rope_tables`).
- `inputs`: materialized outside the graph (the floor: the rotation alone).

How the rotation is written (`--forms`, `models.layers.ROPE_FORM`): `cat` (the default) or `flip`
(no `cat`: W2's rotation kernel took 69.1–166.8 µs a call in three compiles of one bucket).

    python benchmarks/bench_rope.py --out rope.json       # CUDA only
    python benchmarks/bench_rope.py --variants table --forms cat flip --tokens 1920 8192
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, graph_us, write_json

from boundgen.models import layers
from boundgen.models.layers import apply_rope


def rotations(
    variant: str, inv_freq: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], apart: bool
):
    """fn(qkvs, positions[, cos, sin]) → the rotated q and k of every layer."""

    def rotate_all(qkvs, cos, sin, heads, kv_heads, d):
        out = []
        for qkv in qkvs:
            t = qkv.shape[0]
            if not apart:  # one run of q's and k's heads, split after (`Attention.heads`)
                qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
                out.extend(apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1))
                continue
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
        # float32 tables, the rows cast after the gather (`RotaryEmbedding.forward`)
        dt = qkvs[0].dtype
        cos = table[0][positions].to(dt).unsqueeze(1)
        sin = table[1][positions].to(dt).unsqueeze(1)
        return rotate_all(qkvs, cos, sin, heads, kv_heads, d)

    return {"computed": computed, "table": gathered, "inputs": rotate_all}[variant]


VARIANTS = ("computed", "table", "inputs")


def packed_positions(tokens: int, device) -> torch.Tensor:
    """W1-like positions: prompts of 64–256 tokens packed into the chunk."""
    lengths, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(64, 257, ()).item()), tokens - total)
        lengths.append(n)
        total += n
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("Q", "KV", "D"))
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--forms", nargs="+", default=["cat"], choices=layers.ROPE_FORMS)
    ap.add_argument("--apart", action="store_true", help="q and k rotated one op each")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rope needs CUDA")
    heads, kv_heads, d = args.heads
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    all_pos = torch.arange(args.max_positions, device=dev).float()[:, None] * inv_freq[None, :]
    table = (all_pos.cos(), all_pos.sin())  # float32, as `rope_tables` makes them
    results = {}
    head = f"{'tokens':>6} {'form':5} {'variant':9} {'µs/layer':>9} {'TB/s':>6}"
    print(f"{head} {'max |Δ| vs first':>17}")
    for tokens in args.tokens:
        positions = packed_positions(tokens, dev)
        qkvs = [
            torch.randn(tokens, (heads + 2 * kv_heads) * d, device=dev, dtype=dt)
            for _ in range(args.layers)
        ]
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos_in, sin_in = freqs.cos().to(dt).unsqueeze(1), freqs.sin().to(dt).unsqueeze(1)
        moved = 2 * tokens * (heads + kv_heads) * d * 2  # read q, k and write them, bf16
        first = None
        for form in args.forms:
            layers.ROPE_FORM = form  # read as the rotation traces
            for variant in args.variants:
                torch._dynamo.reset()
                fn = torch.compile(rotations(variant, inv_freq, table, args.apart), fullgraph=True)
                if variant == "inputs":
                    call = lambda fn=fn: fn(qkvs, cos_in, sin_in, heads, kv_heads, d)
                else:
                    call = lambda fn=fn: fn(qkvs, positions, heads, kv_heads, d)
                out = call()
                first = out if first is None else first
                us = graph_us(call, args.iters)
                r = {
                    "us_per_chunk": us,
                    "us_per_layer": us / args.layers,
                    "tb_s": moved / (us / args.layers * 1e-6) / 1e12,
                    "max_abs_diff_vs_first": max(
                        (a.float() - b.float()).abs().max().item() for a, b in zip(out, first)
                    ),
                }
                results[f"{tokens}/{form}/{variant}"] = r
                print(
                    f"{tokens:6d} {form:5} {variant:9} {r['us_per_layer']:9.1f} "
                    f"{r['tb_s']:6.2f} {r['max_abs_diff_vs_first']:17.4g}"
                )
    write_json(args.out, {"env": env_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
