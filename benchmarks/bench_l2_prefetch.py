"""Issues 24 and 25: a few-row decoder layer's weights fetched into L2 ahead of its GEMMs
(`models/l2_prefetch.py`), on the GPU.

    python benchmarks/bench_l2_prefetch.py --out $OUT/l2_prefetch.json     # H100/H200, ~1 min

The chain of one few-row layer's kernels as the compiled layers run them at ≤ 128 rows (qkv +
rotation, o_proj and `down` streamed into float32 partials, gate_up + SiLU·mul; the partials'
sum, the residual and an RMSNorm in torch as stand-ins for the compiled layer's other kernels),
over `--layers` layers' own weights (Qwen2.5-0.5B's: 29.7 MB a layer, past the L2 after two), replayed from one
CUDA graph a side, the sides alternated round by round (median µs a layer):

- `none`: as the engine runs today;
- `mlp`: a prefetch kernel at the layer's start fetches its gate_up and `down` (26 MB) while
  qkv and o_proj run, on the layer's stream;
- `side`: the same kernel on a second stream forked at the layer's start and joined at its end
  (the fetch beside qkv and o_proj instead of before them);
- `side+next`: that, fetching the next layer's qkv and o_proj too;
- `warm` (a bound, not a variant): every layer reads layer 0's weights, held in L2.

`--chunks` sweeps the bytes a thread prefetches. The profile of one replay a side (`--profile`)
gives each kernel's µs a layer: where the prefetch's time goes and which GEMMs it speeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import capture_graph, env_info, kernel_table, write_json

from boundgen.models import l2_prefetch, stream, stream_gated, stream_qkv

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_D = 896, 4864, 14, 2, 64
QKV = (HEADS + 2 * KV_HEADS) * HEAD_D
ROTATED = (HEADS + KV_HEADS) * HEAD_D


SIDES = ("none", "warm", "mlp", "side", "side+next")


def layer_weights(layers: int, device) -> list[dict]:
    """Each layer's own weights (random, scaled as a trained layer's ~N(0, 0.02))."""
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(torch.bfloat16)

    return [
        dict(
            qkv=w(QKV, HIDDEN),
            qkv_bias=w(QKV),
            o=w(HIDDEN, HIDDEN),
            gate_up=w(2 * INTER, HIDDEN),
            down=w(HIDDEN, INTER),
        )
        for _ in range(layers)
    ]


def inputs(rows: int, device) -> tuple[torch.Tensor, ...]:
    """The layer's input and the rotation's cos, sin (one draw for every side)."""
    g = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device=device, generator=g).to(torch.bfloat16)
    cos, sin = torch.rand(2, rows, HEAD_D // 2, device=device, generator=g).to(torch.bfloat16)
    return x, cos, sin


def normed(h: torch.Tensor) -> torch.Tensor:
    """The residual + RMSNorm kernels' stand-in (keeps the chain's numbers finite)."""
    return torch.nn.functional.rms_norm(h, (h.shape[-1],)).to(torch.bfloat16)


def chain(weights: list[dict], xs: tuple, side: str, chunk: int):
    """The side's forward over every layer: a function of no arguments (graph-capturable)."""
    x, cos, sin = xs
    layers = len(weights)
    aside = torch.cuda.Stream() if side.startswith("side") else None

    def prefetch(i: int) -> None:
        w = weights[i]
        spans = [w["gate_up"], w["down"]]
        if side == "side+next" and i + 1 < layers:
            spans += [weights[i + 1]["qkv"], weights[i + 1]["o"]]
        if aside is None:
            l2_prefetch.launch(spans, chunk)
            return
        aside.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(aside):
            l2_prefetch.launch(spans, chunk)

    def run():
        h = x
        for i in range(layers):
            w = weights[0] if side == "warm" else weights[i]
            if side not in ("none", "warm"):
                prefetch(i)
            q = stream_qkv.launch(h, w["qkv"], w["qkv_bias"], cos, sin, ROTATED)
            a = q[:, :HIDDEN]  # the attention's output in its place (same shape)
            h = normed(stream.launch(a, w["o"], stream.split_k(HIDDEN)).sum(0) + h)
            g = stream_gated.launch(h, w["gate_up"])
            h = normed(stream.launch(g, w["down"], stream.split_k(INTER)).sum(0) + h)
            if aside is not None:  # joined every layer: one layer's fetch ahead at most
                torch.cuda.current_stream().wait_stream(aside)
        return h

    return run


def time_sides(graphs: dict, rounds: int, replays: int, layers: int) -> dict:
    """Median µs a layer of each side's graph, the sides alternated every round."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays / layers)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--sides", nargs="+", default=["mlp", "side", "side+next"], choices=SIDES[2:])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="a kernel table a side (64 rows)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda")
    weights = layer_weights(args.layers, device)
    mb = sum(t.numel() * t.element_size() for t in weights[0].values()) / 1e6
    print(f"{args.layers} layers, {mb:.1f} MB a layer")
    results = {"env": env_info(), "layer_mb": mb, "rows": {}}
    for rows in args.rows:
        sides = {"none": ("none", 0), "warm": ("warm", 0)}
        for kind in args.sides:
            for chunk in args.chunks:
                sides[f"{kind}/{chunk // 1024}K"] = (kind, chunk)
        xs = inputs(rows, device)
        fns = {name: chain(weights, xs, side, c) for name, (side, c) in sides.items()}
        outs = {name: fn() for name, fn in fns.items()}
        again = fns["none"]()
        torch.cuda.synchronize()
        # the prefetch is a hint: every side but `warm` computes the same numbers
        diffs = {
            name: (out.float() - outs["none"].float()).abs().max().item()
            for name, out in [("none again", again), *outs.items()]
            if name != "warm"
        }
        print(f"rows {rows}: max |diff| against none: {diffs}")
        graphs = {name: capture_graph(fn) for name, fn in fns.items()}
        us = time_sides(graphs, args.rounds, args.replays, args.layers)
        print(f"rows {rows}: " + ", ".join(f"{k} {v}" for k, v in us.items()))
        results["rows"][rows] = {"us_a_layer": us}
        if args.profile and rows == 64:
            best = min((k for k in us if k not in ("none", "warm")), key=us.get)
            results["rows"][rows]["kernels"] = {
                name: kernel_table(graphs[name].replay, top=10) for name in ("none", best)
            }
            for name, table in results["rows"][rows]["kernels"].items():
                print(f"-- {name}: busy {table['gpu_busy_ms']} ms, {table['launches']} launches")
                for row in table["kernels"]:
                    print(f"   {row}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
