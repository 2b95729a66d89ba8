"""A decoder layer's linear parts at few rows: the fused kernels (`models/skinny.py`) against the
unfused ops eagerly (cuBLAS + torch's elementwise kernels) and compiled by Inductor, on the GPU.

    # H200 (a minute; --sweep: tiles of the fused kernels per GEMM shape, a few minutes):
    python benchmarks/bench_skinny.py --out $OUT/skinny.json [--sweep --tiles-out $OUT/tiles.json]
    # then the engine with the swept tiles (an A/B in the same call):
    BOUNDGEN_SKINNY_MAX_ROWS=64 BOUNDGEN_SKINNY_TILES=$OUT/tiles.json python benchmarks/...

Random bf16 decoder layers of the preset's shape (Qwen2.5-0.5B: hidden 896, intermediate 4,864,
qkv 1,152 wide), `--layers` of them called in turn, as a forward calls its layers: one layer's
~30 MB of weights would stay in the H200's 60 MB L2 across replays and time a read no forward
makes. Per row count M (a beam step's B·W rows, a W3 prompt's 64 tokens) and per part —
`attention_input`'s norm + qkv + the q/k rotation (fused: in the kernel's epilogue),
`attention_output`'s o_proj + residual, `mlp_block`'s norm + gate_up + SiLU·mul + down +
residual — the device µs of one layer's call, replayed from a CUDA graph (`common.graph_us`), and
the weights' bytes over that time (the parts stream their weights: the bandwidth says how far
from the floor a part is).

`--sweep` times tiles per GEMM at `--sweep-rows`: first every column width × split of K (the
programs a call runs) at BLOCK_K 128, 4 warps, 3 stages; then BLOCK_K, warps and stages around
the best of those. The fastest per (K, N, gated, BLOCK_M) go to `--tiles-out` (the format
`skinny_tiles.load_tiles` reads) and belong in `skinny_tiles.TILES` once they win in the engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, graph_us, print_table, write_json

from boundgen.checkpoints import hf_config
from boundgen.config import ModelConfig
from boundgen.models import skinny, skinny_tiles
from boundgen.models.decoder import DecoderLayer
from boundgen.models.layers import apply_rope

PARTS = ("attention_input", "attention_output", "mlp_block")
# The sweep's first stage: programs a call runs (column tiles × splits of K) near these counts
PROGRAM_TARGETS = (0, 132, 264, 528)  # 0: K whole (no split)


def make_layers(preset: str, count: int, device) -> list[DecoderLayer]:
    cfg = ModelConfig.from_hf(hf_config(preset))
    layers = []
    for _ in range(count):
        layer = DecoderLayer(cfg).to(device, torch.bfloat16).requires_grad_(False)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
        layers.append(layer)
    return layers


def part_call(layers: list[DecoderLayer], part: str, m: int, device):
    """One part at m rows as a call of one layer (`one(layer)`), and one layer's weights (what
    it streams)."""
    layer = layers[0]
    attn = layer.self_attn
    g = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, layer.input_layernorm.weight.shape[0], device=device, generator=g)
    x = x.to(torch.bfloat16)
    counts = skinny.counters(x, layer)  # (as a forward shares them; None unfused)
    if part == "attention_input":
        d = attn.head_dim
        cos = torch.ones(m, 1, d // 2, device=device, dtype=torch.bfloat16)
        sin = 0 * cos
        return (lambda la: la.attention_input(x, cos, sin, counts=counts)), attn.qkv_proj.weight
    if part == "attention_output":
        o = torch.randn(m, attn.num_heads * attn.head_dim, device=device, generator=g)
        o = o.to(torch.bfloat16)
        return (lambda la: la.attention_output(x, o, counts)), attn.o_proj.weight
    weights = (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
    return (lambda la: la.mlp_block(x, counts)), weights


def over(layers, one):
    """A call of `one` on every layer in turn (as a forward calls its layers) → the outputs."""
    return lambda: [one(la) for la in layers]


def nbytes(weights) -> int:
    weights = weights if isinstance(weights, tuple) else (weights,)
    return sum(w.numel() * w.element_size() for w in weights)


def _flat(out):
    return [t for o in out for t in (o if isinstance(o, tuple) else (o,))]


def time_parts(layers, rows: list[int], iters: int, device) -> list[dict]:
    out = []
    for m, part in itertools.product(rows, PARTS):
        one, weights = part_call(layers, part, m, device)
        fn = over(layers, one)
        row = {"rows": m, "part": part, "weight_MB": nbytes(weights) / 1e6}
        per_layer = 1 / len(layers)
        with torch.inference_mode():
            with skinny.rows_up_to(0):  # the unfused path
                row["eager_us"] = graph_us(fn, iters) * per_layer
                # one compile for all layers (their weights are the compiled call's inputs)
                compiled = torch.compile(one, fullgraph=True, dynamic=False)
                row["inductor_us"] = graph_us(over(layers, compiled), iters) * per_layer
                want = _flat(fn())
            if m <= skinny.MAX_ROWS:
                row["fused_us"] = graph_us(fn, iters) * per_layer
                got = _flat(fn())
                row["max_abs_diff"] = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(got, want, strict=True)
                )
        for k in ("eager_us", "inductor_us", "fused_us"):
            if k in row:
                row[k.replace("_us", "_TBps")] = nbytes(weights) / (row[k] * 1e-6) / 1e12
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        out.append(row)
    return out


def gemm_calls(layers, m: int, device) -> dict:
    """Each of the layer's four GEMM kernels alone at m rows over every layer (qkv with its q
    and k rotated, as the layer calls it): name → (call returning the first layer's output,
    what the eager layer gives there, one layer's weight, gated)."""
    layer = layers[0]
    hidden = layer.input_layernorm.weight.shape[0]
    x = torch.randn(m, hidden, device=device).to(torch.bfloat16)
    h = torch.randn(m, layer.mlp.down_proj.weight.shape[1], device=device).to(torch.bfloat16)
    o = torch.randn(m, layer.self_attn.o_proj.weight.shape[1], device=device).to(torch.bfloat16)
    # the calls share one counter buffer, as a forward's do (its one zero fill: `zeros_us`)
    counts = skinny.counters(x, layer)
    # qkv as the layer calls it: q and k rotated in the epilogue
    attn = layer.self_attn
    angle = torch.rand(m, attn.head_dim // 2, device=device) * 6.3
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    rotated = attn.rotated_columns

    def qkv(la):
        lin, norm = la.self_attn.qkv_proj, la.input_layernorm
        return skinny.norm_linear(
            x, norm.weight, norm.eps, lin.weight, lin.bias, counts, cos, sin, rotated
        )

    def o_proj(la):
        return skinny.linear_residual(o, la.self_attn.o_proj.weight, x, counts)

    def gate_up(la):
        norm = la.post_attention_layernorm
        return skinny.norm_gated(x, norm.weight, norm.eps, la.mlp.gate_up_proj.weight, counts)

    def down(la):
        return skinny.linear_residual(h, la.mlp.down_proj.weight, x, counts)

    lin, norm, norm2 = (
        layer.self_attn.qkv_proj,
        layer.input_layernorm,
        layer.post_attention_layernorm,
    )
    plain = skinny.reference_norm_linear(x, norm.weight, norm.eps, lin.weight, lin.bias)
    qk = plain[:, :rotated].float().view(m, -1, attn.head_dim)
    qk = apply_rope(qk, cos.float()[:, None], sin.float()[:, None]).reshape(m, -1)
    wants = {
        "qkv": torch.cat([qk.to(plain.dtype), plain[:, rotated:]], 1),
        "o_proj": skinny.reference_linear_residual(o, layer.self_attn.o_proj.weight, x),
        "gate_up": skinny.reference_norm_gated(
            x, norm2.weight, norm2.eps, layer.mlp.gate_up_proj.weight
        ),
        "down": skinny.reference_linear_residual(h, layer.mlp.down_proj.weight, x),
    }

    def over_layers(part):
        def call():
            outs = [part(la) for la in layers]  # every layer in turn: the first one's checked
            return outs[0]

        return call

    return {
        "qkv": (over_layers(qkv), wants["qkv"], lin.weight, False),
        "o_proj": (over_layers(o_proj), wants["o_proj"], layer.self_attn.o_proj.weight, False),
        "gate_up": (over_layers(gate_up), wants["gate_up"], layer.mlp.gate_up_proj.weight, True),
        "down": (over_layers(down), wants["down"], layer.mlp.down_proj.weight, False),
    }


def rel_off(got: torch.Tensor, want: torch.Tensor) -> float:
    """The root-mean-square difference over the root-mean-square of the eager layer's output."""
    diff = (got.float() - want.float()).pow(2).mean().sqrt()
    return (diff / want.float().pow(2).mean().sqrt()).item()


# A tile further off the eager layer is wrong, not rounded otherwise: bf16 roundings put the
# fused kernels 0.4-1.6 % off (the tiny preset in the interpreter; SiLU·mul the most), a split's
# partial sum left out puts a tile ~1/sqrt(splits) off (16 % at 38 splits)
MAX_REL_OFF = 0.05


def first_stage(k: int, n: int, m: int, block_ms: int) -> list[tuple]:
    """Column widths × splits of K near `PROGRAM_TARGETS` programs, BLOCK_K 128, 4 warps, 3
    stages (distinct splits only, after `k_split` rounds them to whole BLOCK_K steps)."""
    tiles = []
    m_tiles = -(-m // block_ms)
    block_k = skinny_tiles.block_k_for(k, 128)  # (as the launcher takes it)
    for block_n in (32, 64, 128):
        column_tiles = -(-n // block_n) * m_tiles
        splits = set()
        for target in PROGRAM_TARGETS:
            want = max(1, round(target / column_tiles)) if target else 1
            splits.add(skinny_tiles.k_split(k, block_k, want)[1])
        tiles += [(block_n, block_k, s, 4, 3) for s in sorted(splits)]
    return tiles


def second_stage(best: tuple, k: int) -> list[tuple]:
    """BLOCK_K × warps around the first stage's best at 3 stages, then 2 and 4 stages at the
    best's BLOCK_K and warps (each with about the best's K a program: the split recomputed)."""
    block_n, block_k, split, warps, _ = best
    per = skinny_tiles.k_split(k, block_k, split)[0]
    tiles = []
    for bk, w, st in [*itertools.product((64, 128, 256), (4, 8), (3,)), (block_k, warps, 2)]:
        if skinny_tiles.block_k_for(k, bk) == bk:  # (a wider step than K takes is not timed)
            tiles.append((block_n, bk, max(1, -(-k // max(per, bk))), w, st))
    tiles.append((block_n, block_k, split, warps, 4))
    return [t for t in dict.fromkeys(tiles) if t != best]


def time_tile(fn, want, key, tile, iters: int, per_layer: float, weight) -> dict:
    skinny_tiles.TILES[key] = tile
    try:
        off = rel_off(fn(), want)
        us = graph_us(fn, iters) * per_layer
    except Exception as exc:  # a tile that does not fit (shared memory, registers)
        return {"tile": tile, "error": str(exc)[:120]}
    if not off <= MAX_REL_OFF:  # (NaN too)
        return {"tile": tile, "error": f"{off:.3f} off the eager layer (rms)", "us_wrong": us}
    return {"tile": tile, "us": us, "TBps": nbytes(weight) / (us * 1e-6) / 1e12, "off": off}


def sweep(layers, m: int, iters: int, device) -> list[dict]:
    """Tiles per GEMM at m rows, in two stages; the fastest first per GEMM."""
    rows = []
    block_m = skinny_tiles.block_m_for(m)
    per_layer = 1 / len(layers)
    with torch.inference_mode():
        for name, (fn, want, w, gated) in gemm_calls(layers, m, device).items():
            k = w.shape[1]
            n = w.shape[0] // 2 if gated else w.shape[0]
            key = (k, n, gated, block_m)
            before = skinny_tiles.TILES.pop(key, None)
            default = skinny_tiles.default_tile(k, n, gated, block_m, -(-m // block_m))
            found = [time_tile(fn, want, key, default, iters, per_layer, w)]
            for tile in first_stage(k, n, m, block_m):
                if tile != default:
                    found.append(time_tile(fn, want, key, tile, iters, per_layer, w))
            ok = sorted((f for f in found if "us" in f), key=lambda f: f["us"])
            if ok:
                for tile in second_stage(ok[0]["tile"], k):
                    found.append(time_tile(fn, want, key, tile, iters, per_layer, w))
            skinny_tiles.TILES.pop(key, None)
            if before is not None:
                skinny_tiles.TILES[key] = before
            ok = sorted((f for f in found if "us" in f), key=lambda f: f["us"])
            best = ok[0] if ok else None
            rows.append(
                {
                    "gemm": name,
                    "key": [k, n, gated, block_m],
                    "rows": m,
                    "best_tile": best and list(best["tile"]),
                    "best_us": best and best["us"],
                    "best_TBps": best and best["TBps"],
                    "default_tile": list(default),
                    "default_us": found[0].get("us"),
                    # a forward's one zero fill of its counters (`skinny.counters`) alone, which
                    # the timed calls share and a forward pays once for all its GEMMs
                    "zeros_us": zeros_us(best["tile"], layers[0], m, iters) if best else None,
                    "tiles_timed": len(found),
                    "top5": ok[:5],
                    "errors": sum("error" in f for f in found),
                }
            )
            print({k: v for k, v in rows[-1].items() if k != "top5"}, flush=True)
    return rows


def zeros_us(tile: tuple, layer, m: int, iters: int) -> float | None:
    """Device µs of a forward's zeroed counters (`skinny.counters` at m rows) alone in a graph;
    None for a tile that does not split K (no counters)."""
    if tile[2] == 1:
        return None
    x = torch.zeros(m, layer.input_layernorm.weight.shape[0], device="cuda", dtype=torch.bfloat16)
    return graph_us(lambda: skinny.counters(x, layer), iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--layers", type=int, default=8, help="layers called in turn (their weights past the L2)"
    )
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tiles-out", default=None, help="the sweep's fastest tiles (JSON)")
    ap.add_argument(
        "--max-rows", type=int, default=64, help="rows up to which the fused kernels are timed"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_skinny needs CUDA")
    device = torch.device("cuda")
    skinny.MAX_ROWS = args.max_rows  # (the engine's default may keep them off)
    layers = make_layers(args.preset, args.layers, device)
    result = {
        "env": env_info(),
        "preset": args.preset,
        "max_rows": skinny.MAX_ROWS,
        "layers": args.layers,
        "tiles_loaded": [[list(k), list(v)] for k, v in skinny_tiles.TILES.items()],
    }
    if args.sweep:
        result["sweep"] = [r for m in args.sweep_rows for r in sweep(layers, m, args.iters, device)]
        swept = [
            {"key": r["key"], "tile": r["best_tile"]} for r in result["sweep"] if r["best_tile"]
        ]
        if args.tiles_out:
            Path(args.tiles_out).write_text(json.dumps(swept, indent=1))
        write_json(args.out, result)  # (kept should the parts below be cut by a time budget)
        # the parts below then run with the swept tiles
        skinny_tiles.TILES.update({tuple(r["key"]): tuple(r["tile"]) for r in swept})
    result["parts"] = time_parts(layers, args.rows, args.iters, device)
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
        print_table(
            result["sweep"],
            ["gemm", "rows", "best_tile", "best_us", "best_TBps", "default_us", "zeros_us"],
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
