"""Which FP8 policies pass the fidelity gate on a checkpoint, and why the others do not: the gate's
controls (not FP8 at all), one projection of one layer at a time, the candidates for `selective`
ordered by FP8 GEMM FLOPs, and the input outliers and output error of each projection.

    python benchmarks/fp8_sensitivity.py                # the demo model, emulated FP8, on CPU
    python benchmarks/fp8_sensitivity.py --model DIR --device cuda  # real FP8 on an sm_89+ GPU

The eval set, task metrics and noise floor are `boundgen quant-check`'s ("small" scale on CPU, plus
the demo checkpoint's held-out set and labels). Prints markdown tables (docs/fp8.md quotes them)
and writes everything to --out as JSON. `selective` (boundgen.quant.policy.ALIASES) is the first
candidate that passes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from boundgen.commands.quant_check import (
    EXACT,
    collect_variant,
    control_reports,
    demo_task,
    load_reference_engine,
)
from boundgen.quant.evalset import gate_eval_set
from boundgen.quant.fidelity import GateReport, GateThresholds, gate_engine
from boundgen.quant.noise import measure_noise_floor
from boundgen.quant.outputs import collect_outputs, engine_callables
from boundgen.quant.policy import PROJECTIONS, parse_policy, select_modules
from boundgen.quant.rowwise import quantize_rowwise

# Candidates for `selective`: projection sets x layer choices that mean the same on any depth
# (every layer, or all but the first and/or the last).
CANDIDATE_PROJECTIONS = (
    "mlp+attn-proj",
    "mlp+qkv_proj",
    "mlp+o_proj",
    "gate_up_proj+attn-proj",
    "mlp",
    "gate_up_proj",
    "attn-proj",
    "down_proj",
)
CANDIDATE_LAYERS = ("", ":skip=0", ":skip=-1", ":skip=0,-1")


def flop_share(model, policy: str) -> float:
    """The policy's share of the projections' GEMM FLOPs (per token: in x out of each module)."""

    def flops(p: str) -> int:
        return sum(
            model.get_submodule(n).in_features * model.get_submodule(n).out_features
            for n in select_modules(model, p)
        )

    return flops(policy) / flops("mlp+attn-proj")


def gate_row(label: str, share: float, report: GateReport) -> dict:
    row = {"policy": label, "FP8 FLOPs": share}
    for s in report.sets:
        if s.decided:
            row[f"pairs {s.name}"] = s.agreement
    row["beams"] = report.beam_top1
    for m in report.tasks:
        row[f"Δ {m.name}"] = -m.loss
    row["verdict"] = "PASS" if report.passed else "FAIL"
    row["headroom"] = report.headroom
    return row


def print_markdown(title: str, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v) -> str:
        return f"{v:.4f}" if isinstance(v, float) else "-" if v is None else str(v)

    print(f"\n### {title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    sys.stdout.flush()


def section_controls(args, eval_set, task, ref, exact, floor, thresholds) -> list[dict]:
    reports = control_reports(
        args.model, args.device, eval_set, task, ref, exact, floor, thresholds, args.dtype
    )
    rows = []
    for label, report in reports.items():
        rows.append(gate_row(label, 0.0, report))
        print(report.format())
    print_markdown("Controls: not FP8 at all, judged by the gate", rows)
    return rows


def _gate(engine, args, eval_set, task, ref, floor, thresholds, policies) -> list[dict]:
    reports = gate_engine(
        engine,
        policies,
        eval_set,
        floor=floor,
        reference_outputs=ref,
        task=task,
        emulate=args.emulate,
        thresholds=thresholds,
        log=lambda text: print(text, flush=True),
    )
    return [gate_row(p, flop_share(engine.model, p), r) for p, r in reports.items()]


def section_single(engine, *gate_args) -> list[dict]:
    n_layers = len(engine.model.layers)
    policies = [f"{p}:layers={i}" for i in range(n_layers) for p in PROJECTIONS]
    rows = _gate(engine, *gate_args, policies)
    print_markdown("One projection of one layer in FP8", rows)
    return rows


def section_candidates(engine, *gate_args) -> dict:
    """Every candidate, most FP8 GEMM FLOPs first; `selective` is the first that passes."""
    names = {
        parse_policy(p + layers).name
        for p, layers in itertools.product(CANDIDATE_PROJECTIONS, CANDIDATE_LAYERS)
    }
    order = sorted(names, key=lambda p: (-flop_share(engine.model, p), p))
    rows = _gate(engine, *gate_args, order)
    print_markdown("Candidates for `selective`, most FP8 GEMM FLOPs first", rows)
    best = next((r["policy"] for r in rows if r["verdict"] == "PASS"), None)
    print(f"\nmost FP8 GEMM FLOPs that pass: {best}")
    return {"rows": rows, "best": best}


def section_outliers(engine, eval_set) -> list[dict]:
    """Per projection: how peaked its inputs are, and its output error under e4m3 rounding with
    per-token / per-channel scales (the kernel's), and with per-group-of-32 scales (finer)."""
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in engine.model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:

            def keep(mod, args_, out, name=name):
                inputs.setdefault(name, []).append(args_[0].detach().reshape(-1, mod.in_features))

            hooks.append(module.register_forward_hook(keep))
    score_only = type(eval_set)(eval_set.name, eval_set.score_cases, [])
    collect_outputs(engine_callables(engine), score_only)
    for h in hooks:
        h.remove()

    def rowwise(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
        """e4m3 round trip with one scale per row (or per `group` consecutive elements of a row)."""
        rows = x if group is None else x.reshape(-1, group)
        q, scale = quantize_rowwise(rows)
        return (q.float() * scale).reshape(x.shape)

    table = []
    for name, parts in inputs.items():
        x = torch.cat(parts).float()  # [tokens, K], bf16 values
        w = engine.model.get_submodule(name).weight.float()  # [N, K]
        y = x @ w.t()

        def err(y2: torch.Tensor) -> float:
            return float((y2 - y).norm() / y.norm())

        channel_max = x.abs().amax(0)
        token_peak = x.abs().amax(1) / x.abs().median(1).values.clamp_min(1e-30)
        group = 32 if x.shape[1] % 32 == 0 else 16
        wq = rowwise(w)
        table.append(
            {
                "projection": name,
                "tokens": x.shape[0],
                "channel max/median": float(channel_max.max() / channel_max.median()),
                "token max/median": float(token_peak.median()),
                "err bf16 output": err(y.bfloat16().float()),
                "err w e4m3": err(x @ wq.t()),
                "err a e4m3": err(rowwise(x) @ w.t()),
                "err w+a (kernel)": err(rowwise(x) @ wq.t()),
                f"err w+a, groups of {group}": err(rowwise(x, group) @ rowwise(w, group).t()),
            }
        )
    print_markdown(
        "Inputs of each projection on the eval set's score prompts, and relative output error "
        "‖ŷ − y‖/‖y‖",
        table,
    )
    return table


SECTIONS = ("controls", "single", "candidates", "outliers")


def main(argv=None) -> int:
    from boundgen.demo import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="reference precision")
    ap.add_argument("--scale", default=None, choices=["full", "small", "ci"])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)
    args.model = args.model or str(default_model_path())
    args.emulate = torch.device(args.device).type != "cuda"
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    t0 = time.perf_counter()
    thresholds = GateThresholds()
    engine = load_reference_engine(args.model, args.device, args.dtype)
    eval_set = gate_eval_set(engine, args.model, scale=args.scale)
    task = demo_task(args.model)
    print(
        f"{args.model} on {engine.device} ({engine.dtype}), FP8 "
        f"{'emulated' if args.emulate else 'scaled_mm'}; eval set {eval_set.name}: "
        f"{len(eval_set.score_cases)} score groups, {len(eval_set.beam_cases)} beam prompts; "
        f"task metrics: {'yes' if task else 'none'}"
    )
    result: dict = {"args": vars(args), "device": str(engine.device), "eval_set": eval_set.name}
    with torch.inference_mode():
        ref = collect_outputs(engine_callables(engine, task), eval_set)
        dtype, overrides = EXACT
        exact = collect_variant(args.model, args.device, eval_set, task, dtype, **overrides)
        floor = measure_noise_floor(ref, exact, eval_set, thresholds.quantile)
        print(floor.format())
        result["noise_floor"] = floor
        gate_args = (args, eval_set, task, ref, floor, thresholds)
        if "controls" in sections:
            result["controls"] = section_controls(
                args, eval_set, task, ref, exact, floor, thresholds
            )
        if "single" in sections:
            result["single"] = section_single(engine, *gate_args)
        if "candidates" in sections:
            result["candidates"] = section_candidates(engine, *gate_args)
        if "outliers" in sections:
            result["outliers"] = section_outliers(engine, eval_set)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=vars))
    return 0


if __name__ == "__main__":
    sys.exit(main())
