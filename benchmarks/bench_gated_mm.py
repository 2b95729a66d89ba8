"""The MLP's first half at prefill row counts: RMSNorm + gate_up + SiLU·mul as one Triton kernel
(`models/gated_mm.py`) against what the engine runs today, on the GPU.

    # H200 (a minute; --sweep: every tile of `gated_mm.SWEEP` at each row count, a few minutes)
    python benchmarks/bench_gated_mm.py --out $OUT/gated_mm.json [--sweep]

Per row count M (W5's smallest and largest planned buckets, a W1 piece) the device µs of one call
replayed from a CUDA graph (`common.graph_us`): `eager` (RMSNorm, the gate_up GEMM, SiLU, the
product: what the eager layer launches), `inductor` (the same function through torch.compile:
cuBLAS for the GEMM and Inductor's fused elementwise kernels, as the compiled buckets run it) and
`fused` (the kernel with `TILES`' tile, or the fastest of the sweep), with the GEMM's TFLOPS at
each time and the fused kernel's largest difference from eager. The fused kernel pays where its
time is below `inductor`'s; the fastest tile per shape belongs in `gated_mm.TILES`, and
`BOUNDGEN_GATED_MM_MIN_ROWS` then turns it on for the engine (an end-to-end A/B).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, graph_us, print_table, write_json

from boundgen.checkpoints import hf_config
from boundgen.config import ModelConfig
from boundgen.models import gated_mm, skinny


def _time(fn, iters: int) -> float | str:
    try:
        return graph_us(fn, iters)
    except Exception as exc:  # a tile the compiler refuses (too many registers, shared memory)
        return f"{type(exc).__name__}: {exc}"[:200]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1920, 8192, 14912])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    cfg = ModelConfig.from_hf(hf_config(args.preset))
    k, n, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(k, generator=g, **bf16) + 0.5
    weight = torch.randn(2 * n, k, generator=g, **bf16) * k**-0.5
    reference = skinny.reference_norm_gated
    compiled = torch.compile(reference, dynamic=False)
    res = {"env": env_info(), "preset": args.preset, "K": k, "I": n, "rows": []}
    for m in args.rows:
        x = torch.randn(m, k, generator=g, **bf16) * 3
        want = reference(x, norm, eps, weight)
        row = {"M": m}
        row["eager_us"] = _time(lambda: reference(x, norm, eps, weight), args.iters)
        row["inductor_us"] = _time(lambda: compiled(x, norm, eps, weight), args.iters)
        tiles = (
            gated_mm.SWEEP if args.sweep else [gated_mm.TILES.get((k, n), gated_mm.DEFAULT_TILE)]
        )
        swept = []
        for tile in tiles:
            call = lambda t=tile: gated_mm.launch_norm_gated_mm(x, norm, eps, weight, t)
            try:
                diff = float((call().float() - want.float()).abs().max())
            except Exception as exc:
                swept.append({"tile": tile, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            swept.append({"tile": tile, "us": _time(call, args.iters), "max_abs_diff": diff})
        timed = sorted((t for t in swept if isinstance(t.get("us"), float)), key=lambda t: t["us"])
        if timed:
            row.update(fused_us=timed[0]["us"], tile=timed[0]["tile"])
            row["max_abs_diff"] = timed[0]["max_abs_diff"]
        flops = 2.0 * m * k * 2 * n
        for name in ("eager", "inductor", "fused"):
            t = row.get(f"{name}_us")
            if isinstance(t, float):
                row[f"{name}_tflops"] = flops / (t * 1e-6) / 1e12
        row["sweep"] = swept
        res["rows"].append(row)
        print({key: v for key, v in row.items() if key != "sweep"}, flush=True)
        write_json(args.out, res)
    print_table(
        res["rows"],
        ["M", "eager_us", "inductor_us", "fused_us", "inductor_tflops", "fused_tflops", "tile"],
    )
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
