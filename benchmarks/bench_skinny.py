"""A decoder layer's linear parts at few rows: the fused kernels (`models/skinny.py`) against the
unfused ops eagerly (cuBLAS + torch's elementwise kernels) and compiled by Inductor, on the GPU.

    # H200 (a minute; --sweep: every tile of the fused kernels, a few minutes):
    python benchmarks/bench_skinny.py --out $OUT/skinny.json [--sweep]

One random bf16 decoder layer of the preset's shape (Qwen2.5-0.5B: hidden 896, intermediate
4,864, qkv 1,152 wide). Per row count M (a beam step's B·W rows, a W3 prompt's 64 tokens) and per
part — `attention_input`'s norm + qkv (RoPE excluded: it stays in Inductor), `attention_output`'s
o_proj + residual, `mlp_block`'s norm + gate_up + SiLU·mul + down + residual — the device µs of one
call replayed from a CUDA graph (`common.graph_us`), and the weights' bytes over that time (the
parts stream their weights: the bandwidth says how far from the floor a part is). `--sweep` times
every (BLOCK_N, BLOCK_K, warps, stages) per GEMM shape at `--sweep-rows` and prints the fastest,
which belong in `skinny.TILES`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, graph_us, print_table, write_json

from boundgen.checkpoints import hf_config
from boundgen.config import ModelConfig
from boundgen.models import skinny
from boundgen.models.decoder import DecoderLayer

PARTS = ("attention_input", "attention_output", "mlp_block")


def make_layer(preset: str, device) -> DecoderLayer:
    cfg = ModelConfig.from_hf(hf_config(preset))
    layer = DecoderLayer(cfg).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    return layer


def part_call(layer: DecoderLayer, part: str, m: int, device):
    """A no-argument call of one part at m rows, and the weights it streams (bytes)."""
    cfg = layer.self_attn
    g = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, layer.input_layernorm.weight.shape[0], device=device, generator=g)
    x = x.to(torch.bfloat16)
    if part == "attention_input":
        qkv = layer.self_attn.qkv_proj
        d = cfg.head_dim
        cos = torch.ones(m, 1, d // 2, device=device, dtype=torch.bfloat16)
        return (lambda: layer.attention_input(x, cos, 0 * cos)), qkv.weight
    if part == "attention_output":
        o = torch.randn(m, cfg.num_heads * cfg.head_dim, device=device, generator=g)
        o = o.to(torch.bfloat16)
        return (lambda: layer.attention_output(x, o)), layer.self_attn.o_proj.weight
    mlp = layer.mlp
    return (lambda: layer.mlp_block(x)), (mlp.gate_up_proj.weight, mlp.down_proj.weight)


def nbytes(weights) -> int:
    weights = weights if isinstance(weights, tuple) else (weights,)
    return sum(w.numel() * w.element_size() for w in weights)


@contextlib.contextmanager
def unfused():
    """A context in which the layer takes its unfused path (MAX_ROWS 0)."""
    before, skinny.MAX_ROWS = skinny.MAX_ROWS, 0
    try:
        yield
    finally:
        skinny.MAX_ROWS = before


def time_parts(layer, rows: list[int], iters: int, device) -> list[dict]:
    out = []
    for m, part in itertools.product(rows, PARTS):
        fn, weights = part_call(layer, part, m, device)
        row = {"rows": m, "part": part, "weight_MB": nbytes(weights) / 1e6}
        with torch.inference_mode():
            with unfused():
                row["eager_us"] = graph_us(fn, iters)
                compiled = torch.compile(fn, fullgraph=True, dynamic=False)
                row["inductor_us"] = graph_us(compiled, iters)
                want = fn()
            if m <= skinny.MAX_ROWS:
                row["fused_us"] = graph_us(fn, iters)
                got = fn()
                pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
                row["max_abs_diff"] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in pairs
                )
        for k in ("eager_us", "inductor_us", "fused_us"):
            if k in row:
                row[k.replace("_us", "_TBps")] = nbytes(weights) / (row[k] * 1e-6) / 1e12
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        out.append(row)
    return out


def sweep(layer, m: int, iters: int, device) -> list[dict]:
    """Every tile per GEMM shape of the three kernels at m rows; the fastest first per shape."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    x = torch.randn(m, norm.weight.shape[0], device=device).to(torch.bfloat16)
    h = torch.randn(m, mlp.down_proj.weight.shape[1], device=device).to(torch.bfloat16)
    o = torch.randn(m, attn.o_proj.weight.shape[1], device=device).to(torch.bfloat16)
    ops = torch.ops.boundgen
    shapes = {
        "qkv": (
            lambda: ops.norm_linear(x, norm.weight, 1e-6, attn.qkv_proj.weight, attn.qkv_proj.bias),
            attn.qkv_proj.weight,
            False,
        ),
        "o_proj": (
            lambda: ops.linear_residual(o, attn.o_proj.weight, x),
            attn.o_proj.weight,
            False,
        ),
        "gate_up": (
            lambda: ops.norm_gated(x, norm.weight, 1e-6, mlp.gate_up_proj.weight),
            mlp.gate_up_proj.weight,
            True,
        ),
        "down": (
            lambda: ops.linear_residual(h, mlp.down_proj.weight, x),
            mlp.down_proj.weight,
            False,
        ),
    }
    rows = []
    for name, (fn, w, gated) in shapes.items():
        k = w.shape[1]
        n = w.shape[0] // 2 if gated else w.shape[0]
        key = (k, n, gated)
        found = []
        for tile in itertools.product((16, 32, 64), (128, 256), (4, 8), (2, 4)):
            if tile[1] > k:
                continue
            skinny.TILES[key] = tile
            try:
                us = graph_us(fn, iters)
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                found.append({"tile": tile, "error": str(exc)[:80]})
                continue
            found.append({"tile": tile, "us": us, "TBps": nbytes(w) / (us * 1e-6) / 1e12})
        skinny.TILES.pop(key, None)
        ok = sorted((f for f in found if "us" in f), key=lambda f: f["us"])
        default = next((f for f in ok if f["tile"] == skinny.DEFAULT_TILE), None)
        best = ok[0] if ok else None
        rows.append(
            {
                "gemm": name,
                "key": list(key),
                "rows": m,
                "best_tile": best and best["tile"],
                "best_us": best and best["us"],
                "best_TBps": best and best["TBps"],
                "default_us": default and default["us"],
                "top5": ok[:5],
                "errors": sum("error" in f for f in found),
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "top5"}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument(
        "--max-rows", type=int, default=64, help="rows up to which the fused kernels are timed"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_skinny needs CUDA")
    device = torch.device("cuda")
    skinny.MAX_ROWS = args.max_rows  # (the engine's default may keep them off)
    layer = make_layer(args.preset, device)
    result = {"env": env_info(), "preset": args.preset, "max_rows": skinny.MAX_ROWS}
    result["parts"] = time_parts(layer, args.rows, args.iters, device)
    print_table(
        result["parts"],
        [
            "rows",
            "part",
            "weight_MB",
            "eager_us",
            "inductor_us",
            "fused_us",
            "fused_TBps",
            "max_abs_diff",
        ],
    )
    if args.sweep:
        result["sweep"] = [r for m in args.sweep_rows for r in sweep(layer, m, args.iters, device)]
    write_json(args.out, result)


if __name__ == "__main__":
    main()
