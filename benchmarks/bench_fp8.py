"""Selective FP8 on CUDA: GEMM-level and full-model W1/W2 throughput, bf16 vs each policy, the gate.

    python benchmarks/bench_fp8.py --out $OUT/fp8.json            # default sections, one process
    # under a 10-minute limit per command, split it (each part still writes its JSON as it goes):
    python benchmarks/bench_fp8.py --sections env,gemm,quant,mlp --out $OUT/fp8_kernels.json
    python benchmarks/bench_fp8.py --sections env,model,gate --out $OUT/fp8_model.json
    python benchmarks/bench_fp8.py --sections env,compiled --out $OUT/fp8_compiled.json
    # `selective` against bf16, same process, through aoti+graphs, with the per-kernel tables:
    python benchmarks/bench_fp8.py --sections env,compiled --compiled-backend aoti+graphs \
        --policies none selective --profile --out $OUT/fp8_selective.json
    python benchmarks/bench_fp8.py --sections env,compiled --compiled-backend aoti+graphs \
        --policies none --bucket-gated 0 1 --compiled-buckets plan --out $OUT/w1_gated.json
    python benchmarks/bench_fp8.py --dry-run-cpu --out /tmp/fp8.json  # code paths on CPU, untimed

Kernel-level sections (gemm, quant, mlp, the quantize tiles) time the device work alone: calls
captured in a CUDA graph, the replay timed (`cuda_time_ms`). The model and compiled sections time
whole calls on the wall clock, as a user meets them. `--compiled-buckets plan` compiles the
buckets the planner picks for the run's own W1 and W2 instead of the two fixed ones.

`--policies` takes any policy `boundgen.quant.policy` parses (presets or selective ones such as
`mlp:layers=1-22`, `mlp:skip=0,-1`, `gate_up_proj`); the first should be `none` (speed-ups are
against it). Sections (each isolated: a failure is recorded under "errors" and the others still
run; the JSON is rewritten after every section, so a timeout keeps what finished):
- env:    torch/GPU, fp8_supported, Triton quantizer self-test.
- gemm:   every projection of the real preset shapes (0.5B, 0.6B, 1B) at M tokens: bf16 F.linear,
          FP8 `_scaled_mm` alone (pre-quantized input; fast_accum off/on), and the full Fp8Linear
          (per-token quantize + GEMM) with the torch quantizer, the Triton one, and under
          torch.compile.
- quant:  the activation quantizer alone (torch eager / Triton / torch.compile) on [M, K].
- mlp:    one compiled MLP block (RMSNorm -> gate_up -> SiLU*mul -> down, Inductor fuses the
          quantize into its producer) bf16 vs FP8, per preset shape.
- model:  the engine (eager, bf16 weights of the seeded synthetic qwen2.5-0.5b checkpoint) on W1
          (256 prompts, 64-256 tokens, 2 labels: tok/s) and W2 (prefix 256 + 100 x 16: ms) for each
          policy (`mlp` also with the torch quantizer); bf16 again at the end to show drift.
- compiled (not in the default list; run alone, each policy compiles the model per bucket): W1/W2
          through boundgen.compile's `--compiled-backend` (torch.compile by default), each policy;
          with `--profile`, the per-kernel table of one W1 and one W2 call.
- gate:   the fidelity gate of `boundgen quant-check` (its eval set, task metrics where the
          checkpoint ships labels, and the bf16-vs-fp32 noise floor on the same set) for each
          policy with real FP8, and emulated-vs-real agreement. Per-projection sensitivity and the
          choice of `selective`: benchmarks/fp8_sensitivity.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import common
import numpy as np
import torch
import torch.nn.functional as F
from common import kernel_table

from boundgen.compile.backends import allow_recompiles
from boundgen.models import bucket_gated
from boundgen.quant import fp8_modules, fp8_swapped, select_modules
from boundgen.quant.fp8 import Fp8Linear, fp8_supported
from boundgen.quant.rowwise import quantize_rowwise, quantize_weight
from boundgen.quant.triton_quant import PIECES

SECTIONS = ("env", "gemm", "quant", "mlp", "model", "gate")
# --dry-run-cpu: every policy emulated (exercises the model/gate code paths on CPU)
EMULATE_ALL = False


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3, reps: int = 5) -> float:
    """Median milliseconds per call of the GPU work alone (wall clock on CPU dry runs): `iters`
    calls captured in one CUDA graph, the replay timed `reps` times by CUDA events. Timing each
    call between events measured its host launch instead whenever the launch took longer than the
    kernel (the fused quantize read ~0.25 ms that way at W1's rows, ~0.07 ms in the model's
    graphs). A call that cannot be captured is timed as `iters` calls back to back."""
    if not torch.cuda.is_available():
        return wall_time_s(fn, iters=3, warmup=1) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run = graph.replay
    except Exception:  # e.g. a host sync inside `fn`
        torch.cuda.synchronize()

        def run():
            for _ in range(iters):
                fn()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    del graph
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_time_s(fn, iters: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def preset_shapes(presets: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """preset -> projection -> (K, N) from boundgen.checkpoints.PRESETS."""
    from boundgen.checkpoints import PRESETS

    out = {}
    for name in presets:
        p = PRESETS[name]
        h, inter, hd = p["hidden_size"], p["intermediate_size"], p["head_dim"]
        q, kv = p["num_attention_heads"] * hd, p["num_key_value_heads"] * hd
        out[name] = {
            "qkv_proj": (h, q + 2 * kv),
            "o_proj": (q, h),
            "gate_up_proj": (h, 2 * inter),
            "down_proj": (inter, h),
        }
    return out


# -------------------------------------------------------------------------------------------------


def section_env(res: dict, args) -> None:
    from boundgen.quant import triton_quant

    ok, reason = fp8_supported("cuda")
    res["env"] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "fp8_supported": ok,
        "fp8_reason": reason,
        "triton": triton_quant.AVAILABLE,
        "triton_self_test": triton_quant.self_test(0) if triton_quant.AVAILABLE else "no triton",
    }
    print(json.dumps(res["env"], indent=1), flush=True)
    if not ok:
        raise RuntimeError(f"FP8 is not supported here: {reason}")


def section_gemm(res: dict, args) -> None:
    out = res.setdefault("gemm", [])
    dev = torch.device(args.device)
    for preset, projs in preset_shapes(args.presets).items():
        for m in args.tokens:
            for proj, (k, n) in projs.items():
                row = {"preset": preset, "proj": proj, "M": m, "K": k, "N": n}
                flops = 2.0 * m * n * k
                try:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
                    w = lin.weight
                    row["bf16_ms"] = cuda_time_ms(lambda: F.linear(x, w))
                    a8, sa = quantize_rowwise(x)
                    w8, sw = quantize_weight(w)
                    for fast in (False, True):
                        row[f"scaled_mm{'_fast' if fast else ''}_ms"] = cuda_time_ms(
                            lambda: torch._scaled_mm(
                                a8,
                                w8.t(),
                                scale_a=sa,
                                scale_b=sw,
                                out_dtype=torch.bfloat16,
                                use_fast_accum=fast,
                            )
                        )
                    for aq in ("torch", "triton"):
                        try:
                            layer = Fp8Linear.from_linear(lin, act_quant=aq)
                            row[f"fp8_{aq}_ms"] = cuda_time_ms(lambda: layer(x))
                        except Exception as exc:
                            row[f"fp8_{aq}_error"] = repr(exc)[:300]
                    if not args.no_compile and m in args.compile_tokens:
                        try:
                            layer = Fp8Linear.from_linear(lin, act_quant="torch")
                            cl = torch.compile(layer, dynamic=False)
                            row["fp8_compiled_ms"] = cuda_time_ms(lambda: cl(x))
                            cb = torch.compile(lin, dynamic=False)
                            row["bf16_compiled_ms"] = cuda_time_ms(lambda: cb(x))
                        except Exception as exc:
                            row["compiled_error"] = repr(exc)[:300]
                    for key in [k_ for k_ in row if k_.endswith("_ms")]:
                        row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
                    best_fp8 = min(
                        v for k_, v in row.items() if k_.startswith("fp8_") and k_.endswith("_ms")
                    )
                    row["speedup_best_fp8_vs_bf16"] = row["bf16_ms"] / best_fp8
                except Exception as exc:
                    row["error"] = repr(exc)[:300]
                out.append(row)
                print(
                    f"gemm {preset:13s} {proj:12s} M={m:6d}: "
                    + ", ".join(f"{k_}={v:.3f}" for k_, v in row.items() if k_.endswith("_ms")),
                    flush=True,
                )
    # per-layer totals (sum of that layer's projections) for each policy
    totals = res.setdefault("gemm_layer", [])
    for preset in args.presets:
        for m in args.tokens:
            rows = {
                r["proj"]: r
                for r in out
                if r["preset"] == preset and r["M"] == m and "bf16_ms" in r
            }
            if len(rows) < 4:
                continue
            bf16 = sum(r["bf16_ms"] for r in rows.values())
            entry = {"preset": preset, "M": m, "bf16_ms": bf16}
            for variant in ("fp8_torch", "fp8_triton", "fp8_compiled", "scaled_mm"):
                if all(f"{variant}_ms" in r for r in rows.values()):
                    for policy, projs in (
                        ("mlp", ("gate_up_proj", "down_proj")),
                        ("mlp+attn-proj", tuple(rows)),
                    ):
                        t = sum(
                            rows[p][f"{variant}_ms"] if p in projs else rows[p]["bf16_ms"]
                            for p in rows
                        )
                        entry[f"{policy}[{variant}]_ms"] = t
                        entry[f"{policy}[{variant}]_ratio"] = t / bf16
            totals.append(entry)


def section_quant(res: dict, args) -> None:
    from boundgen.quant import triton_quant

    out = res.setdefault("quant", [])
    compiled = None if args.no_compile else torch.compile(quantize_rowwise, dynamic=False)
    for m in args.tokens:
        use_compiled = compiled is not None and m in args.compile_tokens
        for k in sorted(
            {k_ for projs in preset_shapes(args.presets).values() for k_, _ in projs.values()}
        ):
            x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
            row = {"M": m, "K": k, "torch_ms": cuda_time_ms(lambda: quantize_rowwise(x))}
            if triton_quant.AVAILABLE and x.is_cuda:
                row["triton_ms"] = cuda_time_ms(lambda: triton_quant.quantize_rowwise_triton(x))
            if use_compiled:
                try:
                    row["compiled_ms"] = cuda_time_ms(lambda: compiled(x))
                except Exception as exc:
                    row["compiled_error"] = repr(exc)[:300]
            # read bf16 + write e4m3: 3 bytes per element at best
            row["ideal_ms_at_4.2TBs"] = 3.0 * m * k / 4.2e12 * 1e3
            out.append(row)
            print("quant", row, flush=True)
    _silu_mul_quant_rows(res, args)


def _silu_mul_quant_rows(res: dict, args) -> None:
    """The MLP's SiLU·mul + down_proj input quantize at each preset's intermediate size: eager ops,
    Inductor's fusion of them (torch.compile, its default heuristics) and the one Triton kernel."""
    from boundgen.quant import triton_quant

    out = res.setdefault("silu_mul_quant", [])
    ref = triton_quant.silu_mul_quant_reference
    compiled = None if args.no_compile else torch.compile(ref, dynamic=False)
    inters = sorted({projs["down_proj"][0] for projs in preset_shapes(args.presets).values()})
    for m in args.tokens:
        for k in inters:
            gate_up = torch.randn(m, 2 * k, device=args.device, dtype=torch.bfloat16)
            row = {"M": m, "K": k, "eager_ms": cuda_time_ms(lambda: ref(gate_up))}
            if compiled is not None and m in args.compile_tokens:
                try:
                    row["inductor_ms"] = cuda_time_ms(lambda: compiled(gate_up))
                except Exception as exc:
                    row["inductor_error"] = repr(exc)[:300]
            if triton_quant.AVAILABLE and gate_up.is_cuda:
                op = torch.ops.boundgen.silu_mul_quant
                row["triton_ms"] = cuda_time_ms(lambda: op(gate_up))
                row["tiles"] = _silu_mul_quant_tiles(triton_quant, gate_up)
            # read 2K bf16 + write K e4m3: 5 bytes per output element at best
            row["ideal_ms_at_4.2TBs"] = 5.0 * m * k / 4.2e12 * 1e3
            out.append(row)
            print("silu_mul_quant", row, flush=True)


# (chunk, num_warps) tried for `triton_quant.TILES`: the whole row in one program (chunk 0) with
# more or fewer warps, the whole row as power-of-two pieces ending at K (`PIECES`), and the row by
# fixed-size pieces (a second read of each piece, from L2)
SILU_MUL_TILES = (
    [(0, 4), (0, 8), (0, 16)]
    + [(PIECES, w) for w in (4, 8, 16)]
    + [(c, w) for c in (512, 1024, 2048) for w in (2, 4, 8)]
)


def _set_fastest_tiles(k: int, rows: int) -> dict:
    """Sweep `silu_mul_quant`'s tiles at [rows, 2k] and put the fastest bit-equal one in
    `triton_quant.TILES` for this process (the compiled rows after it use it; the tile is part of
    their cache key). What to write into `TILES` for good, measured where it runs."""
    from boundgen.quant import triton_quant

    if not (triton_quant.AVAILABLE and torch.cuda.is_available()):
        return {"skipped": "needs CUDA and triton"}
    gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
    tiles = _silu_mul_quant_tiles(triton_quant, gate_up)
    best = next((t for t in tiles if t.get("same_bits")), None)
    if best is not None:
        triton_quant.TILES[k] = (best["chunk"], best["num_warps"])
    print("silu_mul_quant tiles", k, tiles[:4], flush=True)
    return {"K": k, "rows": rows, "chosen": best, "tiles": tiles}


def _silu_mul_quant_tiles(triton_quant, gate_up: torch.Tensor) -> list[dict]:
    """Each tile choice of `silu_mul_quant` timed on `gate_up`, checked bit-equal to the default
    (a tile that changed a value would be a bug, not a speed-up); the fastest first."""
    want_q, want_s = triton_quant.launch_silu_mul_quant(gate_up)
    rows = []
    for chunk, warps in SILU_MUL_TILES:
        try:
            q, s = triton_quant.launch_silu_mul_quant(gate_up, chunk, warps)
            same = torch.equal(s, want_s) and torch.equal(
                q.view(torch.uint8), want_q.view(torch.uint8)
            )
            ms = cuda_time_ms(
                lambda c=chunk, w=warps: triton_quant.launch_silu_mul_quant(gate_up, c, w)
            )
            rows.append({"chunk": chunk, "num_warps": warps, "ms": ms, "same_bits": same})
        except Exception as exc:  # a tile the compiler refuses (e.g. too many registers)
            rows.append({"chunk": chunk, "num_warps": warps, "error": repr(exc)[:200]})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


class _MLPBlock(torch.nn.Module):
    def __init__(self, h: int, inter: int, dev):
        super().__init__()
        self.norm = torch.nn.RMSNorm(h, device=dev, dtype=torch.bfloat16)
        self.gate_up_proj = torch.nn.Linear(
            h, 2 * inter, bias=False, device=dev, dtype=torch.bfloat16
        )
        self.down_proj = torch.nn.Linear(inter, h, bias=False, device=dev, dtype=torch.bfloat16)
        torch.nn.init.normal_(self.gate_up_proj.weight, std=0.02)
        torch.nn.init.normal_(self.down_proj.weight, std=0.02)

    def branch(self, x):
        g, u = self.gate_up_proj(self.norm(x)).chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)

    def forward(self, x):
        return x + self.branch(x)


def section_mlp(res: dict, args) -> None:
    from boundgen.checkpoints import PRESETS

    out = res.setdefault("mlp_block", [])
    for preset in args.presets:
        h, inter = PRESETS[preset]["hidden_size"], PRESETS[preset]["intermediate_size"]
        for m in args.tokens:
            row = {"preset": preset, "M": m}
            try:
                x = torch.randn(m, h, device=args.device, dtype=torch.bfloat16)
                block = _MLPBlock(h, inter, args.device)
                flops = 2.0 * m * h * 3 * inter
                for label, mod in (("bf16", block), ("fp8", None)):
                    if mod is None:
                        mod = _MLPBlock(h, inter, args.device)
                        mod.load_state_dict(block.state_dict())
                        mod.gate_up_proj = Fp8Linear.from_linear(
                            mod.gate_up_proj, act_quant="torch"
                        )
                        mod.down_proj = Fp8Linear.from_linear(mod.down_proj, act_quant="torch")
                        row["fp8_eager_ms"] = cuda_time_ms(lambda: mod(x))
                        ref_branch = block.branch(
                            x
                        ).float()  # the residual add would hide the error
                        row["rel_err"] = float(
                            ((mod.branch(x).float() - ref_branch).norm() / ref_branch.norm()).item()
                        )
                    else:
                        row["bf16_eager_ms"] = cuda_time_ms(lambda: mod(x))
                    if not args.no_compile and m in args.compile_tokens:
                        cm = torch.compile(mod, dynamic=False)
                        row[f"{label}_compiled_ms"] = cuda_time_ms(lambda: cm(x))
                for key in [k for k in row if k.endswith("_ms")]:
                    row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
                if "fp8_compiled_ms" in row:
                    row["compiled_ratio_fp8_over_bf16"] = (
                        row["fp8_compiled_ms"] / row["bf16_compiled_ms"]
                    )
                row["eager_ratio_fp8_over_bf16"] = row["fp8_eager_ms"] / row["bf16_eager_ms"]
            except Exception as exc:
                row["error"] = repr(exc)[:500]
            out.append(row)
            print("mlp_block", row, flush=True)


# -------------------------------------------------------------------------------------------------


def _load_engine(args, dtype="bfloat16", **overrides):
    from boundgen.checkpoints import ensure_model
    from boundgen.commands.quant_check import load_reference_engine

    t0 = time.perf_counter()
    path = ensure_model(args.model_preset, progress=False) if not args.model else Path(args.model)
    engine = load_reference_engine(path, args.device, dtype, **overrides)
    print(f"loaded {path} ({dtype}) in {time.perf_counter() - t0:.1f}s", flush=True)
    return engine, path


def _workloads(vocab: int, seed: int = 0, w1_prompts: int = 256):
    rng = np.random.default_rng(seed)
    w1 = [
        rng.integers(0, vocab, size=int(rng.integers(64, 257))).tolist() for _ in range(w1_prompts)
    ]
    w2 = (
        rng.integers(0, vocab, size=256).tolist(),
        [rng.integers(0, vocab, size=16).tolist() for _ in range(100)],
    )
    labels = [vocab // 3, 2 * vocab // 3]
    return w1, w2, labels


def _time_w1_w2(row, engine, w1, w1_tokens, w2_prefix, w2_items, labels, args) -> None:
    """W1 tok/s and W2 ms into `row`; each workload on its own, so one failing keeps the other."""
    try:
        t = wall_time_s(lambda: engine.score([], w1, labels, apply_softmax=True), iters=args.iters)
        row["w1_s"], row["w1_tok_s"] = t, w1_tokens / t
    except Exception as exc:
        row["w1_error"] = repr(exc)[:500]
    try:
        t = wall_time_s(
            lambda: engine.score(w2_prefix, w2_items, labels, apply_softmax=True),
            iters=max(5, args.iters),
        )
        row["w2_ms"] = t * 1e3
    except Exception as exc:
        row["w2_error"] = repr(exc)[:500]


def _speedups(runs: list[dict]) -> None:
    """Ratios against the first run (bf16, the first `--bucket-gated` value) of the same
    `graph_max_tokens`, for whatever both rows measured."""
    bases: dict = {}
    for row in runs:
        base = bases.setdefault(row.get("graph_max_tokens"), row)
        if "w1_tok_s" in row and "w1_tok_s" in base:
            row["w1_speedup"] = row["w1_tok_s"] / base["w1_tok_s"]
        if "w2_ms" in row and "w2_ms" in base:
            row["w2_speedup"] = base["w2_ms"] / row["w2_ms"]


def _fp8(engine, policy: str, act_quant: str = "auto", emulate: bool = False):
    """`policy` applied in place to engine.model for a `with` block, the bf16 modules back after."""
    model = engine.model
    return fp8_swapped(
        model,
        select_modules(model, policy),
        act_quant=act_quant,
        emulate=emulate or EMULATE_ALL,
    )


def section_model(res: dict, args) -> None:
    engine, path = _load_engine(args)
    w1, (w2_prefix, w2_items), labels = _workloads(
        engine.config.vocab_size, w1_prompts=args.w1_prompts
    )
    w1_tokens = sum(len(p) for p in w1)
    out = res.setdefault("model", {"checkpoint": str(path), "w1_tokens": w1_tokens, "runs": []})
    runs = [("none", "auto")] + [(p, "auto") for p in args.policies if p != "none"]
    if "mlp" in args.policies:
        runs.append(("mlp", "torch"))
    runs.append(("none", "auto"))
    for policy, aq in runs:
        label = policy if aq == "auto" else f"{policy}[{aq}]"
        row = {"policy": label}
        try:
            with _fp8(engine, policy, act_quant=aq):
                mods = fp8_modules(engine.model)
                row["fp8_modules"] = len(mods)
                if mods:
                    row["act_quant"] = engine.model.get_submodule(mods[0]).act_quant
                _time_w1_w2(row, engine, w1, w1_tokens, w2_prefix, w2_items, labels, args)
        except Exception as exc:
            row["error"] = repr(exc)[:500]
        out["runs"].append(row)
        print("model", row, flush=True)
    _speedups(out["runs"])
    del engine
    _empty_cache()


def _planned_buckets(w1, w2_prefix, w2_items, budget: int) -> tuple[str, float]:
    """The buckets `boundgen compile --profile` plans for this run's own W1 and W2 (what a user
    compiles for that traffic), those the two workloads use, and the padding the planner predicts
    for them."""
    from boundgen.compile import planner

    entries = [planner.Entry("W1"), planner.Entry("W2")]
    entries[0].add(planner.Forward(((0, tuple(len(p) for p in w1)),)))
    entries[1].add(planner.Forward(((len(w2_prefix), tuple(len(i) for i in w2_items)),)))
    plan = planner.plan(entries, budget, max_bucket_tokens=budget)
    used = [b.name for b in plan.buckets if plan.overall.batches.get(b.name)]
    padding = plan.overall.padding_fraction
    print(f"planned buckets {used}: padding {padding:.3f}", flush=True)
    return ",".join(used), padding


def section_compiled(res: dict, args) -> None:
    """W1/W2 through a compiled backend (boundgen.compile.backends; torch.compile by default): bf16
    first, then each FP8 policy with each activation quantizer of `--compiled-act-quant` (torch:
    Inductor fuses every quantize into its producer; triton: the MLP's SiLU·mul + quantize is one
    Triton kernel, the other quantizes stay Inductor's). Not in the default sections (each row
    compiles the whole model per bucket): run it alone, `--sections env,compiled`."""
    from boundgen.compile.backends import CompileOptions
    from boundgen.runner import make_runner

    engine, path = _load_engine(args)
    w1, (w2_prefix, w2_items), labels = _workloads(
        engine.config.vocab_size, w1_prompts=args.w1_prompts
    )
    w1_tokens = sum(len(p) for p in w1)
    buckets, planned = args.compiled_buckets, None
    if buckets == "plan":
        buckets, planned = _planned_buckets(w1, w2_prefix, w2_items, args.compiled_budget)
    out = res.setdefault(
        "compiled",
        {
            "checkpoint": str(path),
            "backend": args.compiled_backend,
            "buckets": buckets,
            "planned_padding": planned,
            "budget": args.compiled_budget,
            "w1_tokens": w1_tokens,
            "runs": [],
        },
    )
    variants = [
        (p, aq, g, bg)
        for g in args.graph_max_tokens
        for bg in args.bucket_gated
        for p in args.policies
        for aq in (["-"] if p == "none" else args.act_quants)
    ]
    if args.silu_tiles == "sweep" and "triton" in args.act_quants:
        out["silu_tiles"] = _set_fastest_tiles(
            engine.config.intermediate_size, args.compiled_budget
        )
    for policy, act_quant, graph_max_tokens, gated in variants:
        row = {"policy": policy, "act_quant": act_quant}
        if graph_max_tokens is not None:
            row["graph_max_tokens"] = graph_max_tokens
        if gated is not None:  # read when the buckets trace
            bucket_gated.set_form(gated)
            row["bucket_gated"] = gated
        options = {} if graph_max_tokens is None else {"graph_max_tokens": graph_max_tokens}
        try:
            with _fp8(engine, policy, act_quant=act_quant if act_quant != "-" else "torch"):
                t0 = time.perf_counter()
                runner = make_runner(
                    engine.model,
                    engine.device,
                    max_batch_tokens=args.compiled_budget,
                    share_prefix=True,
                    backend=args.compiled_backend,
                    options=CompileOptions(buckets=buckets, warmup=True, quant=policy, **options),
                )
                row["compile_s"] = time.perf_counter() - t0
                compiled = engine.with_runner(runner)
                try:
                    _time_w1_w2(row, compiled, w1, w1_tokens, w2_prefix, w2_items, labels, args)
                    row["runner_stats"] = runner.stats()
                    if args.profile:  # kernels, and where the GPU idled (lead, gaps, tail)
                        for name, call in (
                            ("w1", lambda: compiled.score([], w1, labels, apply_softmax=True)),
                            ("w2", lambda: compiled.score(w2_prefix, w2_items, labels, True)),
                        ):
                            prof = kernel_table(call)
                            row[f"kernels_{name}"] = prof.pop("kernels")
                            row[f"timeline_{name}"] = prof
                finally:
                    compiled.close()
        except Exception as exc:
            row["error"] = repr(exc)[:800]
        out["runs"].append(row)
        print("compiled", row, flush=True)
        save(res, args)
        torch._dynamo.reset()
    _speedups(out["runs"])
    # HF after the compiled rows: loading the first AOTInductor package may re-execute this
    # process (the libstdc++ preload), which would measure anything before it twice
    if args.hf:  # the same workloads through HF transformers in this process (bf16, eager)
        out["hf"] = _hf_row(path, w1, w1_tokens, w2_prefix, w2_items, labels, args)
        print("compiled hf", out["hf"], flush=True)
        save(res, args)


def _hf_row(path, w1, w1_tokens, w2_prefix, w2_items, labels, args) -> dict:
    """W1 tok/s and W2 ms through HF transformers (eager, SDPA, bf16): left-padded batches of 64,
    the last token's label logits, softmax over the labels (what `engine.score` returns); W2 as
    100 sequences of prefix + item (HF has no shared prefix)."""
    row: dict = {"policy": "hf-eager"}
    try:
        dev = args.device
        model = common.hf_model(path, dev, torch.bfloat16)
        call = lambda seqs, m=model: common.hf_last_logits(m, seqs, dev, 64, labels).softmax(-1)
        t = wall_time_s(lambda: call(w1), iters=args.iters)
        row["w1_s"], row["w1_tok_s"] = t, w1_tokens / t
        w2 = [w2_prefix + item for item in w2_items]
        row["w2_ms"] = wall_time_s(lambda: call(w2), iters=max(5, args.iters)) * 1e3
    except Exception as exc:
        row["error"] = repr(exc)[:500]
    _empty_cache()
    return row


def section_gate(res: dict, args) -> None:
    from boundgen.commands.quant_check import EXACT, collect_variant, demo_task
    from boundgen.quant.evalset import gate_eval_set
    from boundgen.quant.fidelity import compare_outputs, spearman
    from boundgen.quant.noise import measure_noise_floor
    from boundgen.quant.outputs import collect_outputs, engine_callables

    engine, path = _load_engine(args)
    ev = gate_eval_set(engine, path, scale=args.gate_scale)
    task = demo_task(path)
    out = res.setdefault("gate", {"checkpoint": str(path), "eval_set": ev.name, "reports": {}})
    callables = engine_callables(engine, task)
    t0 = time.perf_counter()
    ref = collect_outputs(callables, ev)
    out["bf16_eval_s"] = time.perf_counter() - t0
    print(f"gate: bf16 reference on {ev.name} in {out['bf16_eval_s']:.1f}s", flush=True)
    # the gate's noise floor: fp32 (SDPA attention) on the same eval set
    dtype, overrides = EXACT
    exact = collect_variant(path, args.device, ev, task, dtype, **overrides)
    floor = measure_noise_floor(ref, exact, ev)
    out["noise_floor"] = dataclasses.asdict(floor)
    print(floor.format(), flush=True)
    save(res, args)
    for policy in [p for p in args.policies if p != "none"]:
        try:
            with _fp8(engine, policy):
                t0 = time.perf_counter()
                cand = collect_outputs(callables, ev)
                report = compare_outputs(ref, cand, ev, policy, floor)
                report.notes["eval_seconds"] = f"{time.perf_counter() - t0:.1f}"
            out["reports"][policy] = report.to_dict()
            print(report.format(), flush=True)
        except Exception as exc:
            out["reports"][policy] = {"error": repr(exc)[:500]}
            print(f"gate {policy} failed: {exc!r}", flush=True)
        save(res, args)
    # emulation must reproduce the kernel's numerics: compare emulated and real FP8 on W2-style
    # groups
    try:
        sub = type(ev)(ev.name + "-W2", [c for c in ev.score_cases if c.set_name == "W2"], [])
        with _fp8(engine, "mlp"):
            real = collect_outputs(engine_callables(engine), sub)
        with _fp8(engine, "mlp", emulate=True):
            emu = collect_outputs(engine_callables(engine), sub)
        out["emulation_vs_real"] = {
            "max_abs_diff": max(
                float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(real.scores, emu.scores)
            ),
            "spearman_mean": float(
                np.mean([spearman(a, b) for a, b in zip(real.scores, emu.scores)])
            ),
        }
        print("emulation vs real", out["emulation_vs_real"], flush=True)
    except Exception as exc:
        out["emulation_vs_real"] = {"error": repr(exc)[:500]}


# -------------------------------------------------------------------------------------------------


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save(res: dict, args) -> None:
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    os.replace(tmp, path)


def summary(res: dict) -> str:
    lines = []
    for e in res.get("gemm_layer", []):
        parts = [f"{k}={v:.2f}" for k, v in e.items() if k.endswith("_ratio")]
        lines.append(
            f"layer GEMMs {e['preset']} M={e['M']}: bf16 {e['bf16_ms']:.3f} ms; " + ", ".join(parts)
        )
    for section, label in (("model", "eager"), ("compiled", "compiled")):
        hf = res.get(section, {}).get("hf")
        for r in ([hf] if hf else []) + res.get(section, {}).get("runs", []):
            # ratios: against bf16 of the same graph setting; "HF": against HF in this process
            w1 = f"W1 {r['w1_tok_s'] / 1e3:8.1f}K tok/s" if "w1_tok_s" in r else "W1 -"
            w2 = f"W2 {r['w2_ms']:7.2f} ms" if "w2_ms" in r else "W2 -"
            w1 += f" (x{r['w1_speedup']:.2f})" if "w1_speedup" in r else ""
            w2 += f" (x{r['w2_speedup']:.2f})" if "w2_speedup" in r else ""
            if hf and r is not hf and "w1_tok_s" in r and "w1_tok_s" in hf:
                w2 += f"  HF: W1 x{r['w1_tok_s'] / hf['w1_tok_s']:.2f}"
            if hf and r is not hf and "w2_ms" in r and "w2_ms" in hf:
                w2 += f", W2 x{hf['w2_ms'] / r['w2_ms']:.2f}"
            name = r["policy"] + (f"[{r['act_quant']}]" if r.get("act_quant", "-") != "-" else "")
            name += f" g{r['graph_max_tokens']}" if r.get("graph_max_tokens") is not None else ""
            lines.append(f"{label:<8} {name:<24} {w1}  {w2}")
            for w in ("w1", "w2"):
                t = r.get(f"timeline_{w}")
                if t and "lead_ms" in t:
                    lines.append(
                        f"  {w.upper()} profiled: wall {t['wall_ms']:.2f} ms, GPU busy "
                        f"{t['gpu_busy_ms']:.2f} ms, idle: before {t['lead_ms']:.2f}, between "
                        f"{t['idle_between_ms']:.2f}, after {t['tail_ms']:.2f} ms; longest gaps "
                        + ", ".join(f"{g['ms']:.2f} @ {g['at_ms']:.1f}" for g in t["longest_gaps"])
                    )
    for p, r in res.get("gate", {}).get("reports", {}).items():
        if "passed" in r:
            lines.append(
                f"gate {p}: {'PASS' if r['passed'] else 'FAIL'} " + "; ".join(r["failures"])
            )
    return "\n".join(lines)


def _policy_name(text: str) -> str:
    from boundgen.quant.policy import parse_policy

    try:
        return parse_policy(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8.json")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen3-0.6b,llama3.2-1b")
    ap.add_argument("--tokens", default="2048,8192,32768", help="GEMM M values")
    ap.add_argument(
        "--model-preset", default="qwen2.5-0.5b", help="synthetic checkpoint for model/gate"
    )
    ap.add_argument("--model", default=None, help="use this checkpoint directory instead")
    ap.add_argument("--gate-scale", default="full", choices=["full", "small", "ci"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--w1-prompts", type=int, default=256, help="W1 size (DESIGN §9: 256)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    ap.add_argument(
        "--compile-tokens", default="8192", help="M values that also get torch.compile variants"
    )
    ap.add_argument(
        "--compiled-buckets",
        default="t8192-s96-m256,t2048-s112-m256-g2-p320-q1664",
        help="buckets of the compiled section (W1 chunks, W2's prefix + 100 candidates), or "
        "'plan': the buckets the planner picks for this run's W1 and W2",
    )
    ap.add_argument(
        "--compiled-budget", type=int, default=8192, help="compiled section token budget"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="compiled section: also the per-kernel table of one W1 and one W2 call per policy",
    )
    ap.add_argument(
        "--compiled-backend",
        default="compile",
        help="backend of the compiled section: compile | compile+graphs | aoti | aoti+graphs",
    )
    ap.add_argument(
        "--hf",
        action="store_true",
        help="compiled section: W1/W2 through HF transformers (bf16, eager) in the same process",
    )
    ap.add_argument(
        "--graph-max-tokens",
        nargs="+",
        type=int,
        default=[None],
        help="compiled section: CompileOptions.graph_max_tokens values, each a run of every "
        "policy (default: the backend's own); 8192 replays W1's t8192 pieces as CUDA graphs",
    )
    ap.add_argument(
        "--bucket-gated",
        nargs="+",
        default=[None],
        choices=list(bucket_gated.FORMS),
        help="compiled section: `BOUNDGEN_BUCKET_GATED` forms, each a run of every policy (a "
        "bucket's gate_up + SiLU·mul by cuBLAS + Inductor, or one GEMM, `models/bucket_gated.py`:"
        " pointer-fed 1, persistent TMA-fed persist; default: as the environment says)",
    )
    ap.add_argument(
        "--silu-tiles",
        choices=["table", "sweep"],
        default="table",
        help="compiled section, act_quant triton: the SiLU·mul + quantize tiles of "
        "triton_quant.TILES (table), or the fastest of a sweep at the model's K first (sweep)",
    )
    ap.add_argument(
        "--compiled-act-quant",
        dest="act_quants",
        nargs="+",
        default=["torch", "triton"],
        choices=["torch", "triton"],
        help="compiled section: activation quantizers per FP8 policy — torch (Inductor fuses the "
        "quantize into its producer) and/or triton (the MLP's SiLU·mul + quantize as one kernel)",
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["none", "mlp", "mlp+attn-proj"],
        type=_policy_name,
        help="FP8 policies of the model/compiled/gate sections, e.g. none mlp mlp:skip=0,-1 "
        "(bf16 'none' first: speed-ups are against it)",
    )
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="exercise model+gate on CPU with the tiny preset and emulated FP8 (no timings)",
    )
    args = ap.parse_args(argv)
    args.compile_tokens = [int(float(t)) for t in args.compile_tokens.split(",") if t]
    args.device = "cuda"
    if args.dry_run_cpu:
        global EMULATE_ALL
        EMULATE_ALL = True
        args.device, args.model_preset, args.gate_scale, args.iters = "cpu", "tiny", "ci", 1
        args.presets, args.tokens, args.no_compile, args.w1_prompts = "tiny", "64", True, 16
        args.sections, args.compiled_buckets = "gemm,quant,mlp,model,compiled,gate", "t512-s16-m256"
    args.presets = [p for p in args.presets.split(",") if p]
    args.tokens = [int(float(t)) for t in args.tokens.split(",") if t]
    sections = [s for s in args.sections.split(",") if s]
    res: dict = {"args": dict(vars(args)), "errors": {}, "timings_s": {}}
    if not torch.cuda.is_available() and not args.dry_run_cpu:
        res["errors"]["env"] = "CUDA is not available: this benchmark measures FP8 kernels on a GPU"
        save(res, args)
        print(res["errors"]["env"], file=sys.stderr)
        return 2
    allow_recompiles(512)  # one compile per benchmarked shape
    funcs = {
        "env": section_env,
        "gemm": section_gemm,
        "quant": section_quant,
        "mlp": section_mlp,
        "model": section_model,
        "compiled": section_compiled,
        "gate": section_gate,
    }
    for name in sections:
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():  # no autograd: _scaled_mm has no derivative
                funcs[name](res, args)
        except Exception:
            res["errors"][name] = traceback.format_exc()[-3000:]
            print(f"section {name} failed:\n{res['errors'][name]}", file=sys.stderr, flush=True)
        res["timings_s"][name] = round(time.perf_counter() - t0, 1)
        save(res, args)
        _empty_cache()
    try:
        text = summary(res)
    except Exception as exc:
        text = f"(summary failed: {exc!r}; see the JSON)"
    res["summary"] = text
    save(res, args)
    print("\n" + text)
    print(f"\nwrote {args.out}; section errors: {list(res['errors']) or 'none'}")
    return 0


if __name__ == "__main__":
    from boundgen.compile.preload import cli_startup

    cli_startup()  # AOTInductor packages may need the libstdc++ preload: re-exec as the CLI does
    sys.exit(main())
