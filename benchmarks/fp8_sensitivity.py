"""Why an FP8 policy fails the fidelity gate on a checkpoint: the gate per projection, per layer and
for cumulative sets, next to controls that are not FP8 at all; then input outliers and the error of
each projection under per-token and per-group scales, and how close the reference's own ties are.

    python benchmarks/fp8_sensitivity.py                # the demo model, emulated FP8, on CPU
    python benchmarks/fp8_sensitivity.py --model DIR --device cuda  # real FP8 on an sm_89+ GPU

`--fp32-head` computes the label logits in fp32 instead of rounding them to bf16 (an experiment:
how much of the failure is the reference's own bf16 ties). The eval set is the one `boundgen
quant-check` uses (`fidelity.gate_eval_set`: "small" scale on
CPU, plus the demo checkpoint's held-out set). Prints markdown tables (docs/fp8.md quotes them) and
writes everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from boundgen.commands.quant_check import load_reference_engine
from boundgen.quant.fidelity import (
    GateReport,
    collect_outputs,
    compare_outputs,
    engine_callables,
    gate_engine,
    gate_eval_set,
)
from boundgen.quant.fp8 import fp8_swapped
from boundgen.quant.policy import PROJECTIONS, select_modules
from boundgen.quant.rowwise import quantize_rowwise


def load_engine(args, dtype: str, **overrides):
    engine = load_reference_engine(args.model, args.device, dtype, **overrides)
    if args.fp32_head:
        engine.model.head = types.MethodType(_fp32_head, engine.model)
    return engine


def _fp32_head(self, rows: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """`DecoderModel.head` in fp32: rows [N, H] -> logits [N, C], not rounded to bf16."""
    w = self.head_weight if columns is None else self.head_weight.index_select(0, columns)
    return F.linear(rows.float(), w.float())


def margin(report: GateReport) -> float:
    """How far the worst gate criterion is above its threshold (negative: failed by that much)."""
    t = report.thresholds
    gaps = [report.beam_top1 - t.beam_top1] if report.beam_top1 is not None else []
    for s in report.sets:
        if s.spearman_mean is not None:
            gaps += [s.spearman_mean - t.spearman, s.topk_mean - t.topk_overlap]
    return min(gaps)


def gate_row(label: str, modules: int, report: GateReport) -> dict:
    row = {"policy": label, "modules": modules}
    for s in report.sets:
        if s.spearman_mean is not None:
            row[f"ρ {s.name}"] = s.spearman_mean
    row["top-10 min"] = min(s.topk_mean for s in report.sets if s.topk_mean is not None)
    row["beam top-1"] = report.beam_top1
    row["verdict"] = "PASS" if report.passed else "FAIL"
    row["margin"] = margin(report)
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


def section_gate(engine, args, eval_set, ref) -> dict:
    """Controls, one projection at a time, per kind, per layer, presets, cumulative sets."""
    model = engine.model
    n_layers = len(model.layers)
    out: dict[str, list[dict]] = {}

    controls = []
    for label, dtype, overrides in (
        ("bf16, share_prefix off (same math, other order)", args.dtype, {"share_prefix": False}),
        ("fp32, reference attention (noise floor)", "float32", {"attention": "reference"}),
    ):
        other = load_engine(args, dtype, **overrides)
        cand = collect_outputs(engine_callables(other), eval_set)
        controls.append(gate_row(label, 0, compare_outputs(ref, cand, eval_set, label)))
        del other
    out["controls"] = controls
    print_markdown("Controls: not FP8 at all, compared with the bf16 reference", controls)

    def run(policies: list[str]) -> list[dict]:
        reports = gate_engine(
            engine, policies, eval_set, emulate=args.emulate, reference_outputs=ref
        )
        return [gate_row(p, len(select_modules(model, p)), r) for p, r in reports.items()]

    singles = run([f"{p}:layers={i}" for i in range(n_layers) for p in PROJECTIONS])
    out["single"] = singles
    print_markdown("One projection of one layer in FP8", singles)
    groups = run([*PROJECTIONS, *(f"mlp:layers={i}" for i in range(n_layers))])
    groups += run(["mlp", "mlp:skip=0,-1", "mlp+attn-proj"])
    out["groups"] = groups
    print_markdown("One kind in every layer, one layer's MLP, presets", groups)

    # Cumulative: the least harmful single projections first, one more per row.
    order = sorted(singles, key=lambda r: -r["margin"])
    names: list[str] = []
    cumulative = []
    for row in order:
        names += select_modules(model, row["policy"])
        with fp8_swapped(model, names, emulate=args.emulate):
            cand = collect_outputs(engine_callables(engine), eval_set)
        label = f"+ {row['policy']}"
        cumulative.append(gate_row(label, len(names), compare_outputs(ref, cand, eval_set, label)))
    out["cumulative"] = cumulative
    print_markdown("Cumulative: least harmful projections first", cumulative)
    return out


def section_outliers(engine, args, eval_set) -> list[dict]:
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


def section_ties(engine, args, eval_set, ref) -> dict:
    """How much of the `mlp` failure is the reference's own ties: flipped pairs by reference gap,
    and beam mismatches by the reference's top-1/top-2 log-prob margin."""
    model = engine.model
    with fp8_swapped(model, select_modules(model, "mlp"), emulate=args.emulate):
        cand = collect_outputs(engine_callables(engine), eval_set)
        beams_fp8 = _beams(engine, eval_set)
    beams_ref = _beams(engine, eval_set)
    tied = total = 0
    gaps = []
    for case, r, c in zip(eval_set.score_cases, ref.scores, cand.scores):
        r, c = np.asarray(r), np.asarray(c)
        total += len(r)
        tied += len(r) - len(np.unique(r))
        if case.set_name == "demo-pooled":
            continue
        i, j = np.triu_indices(len(r), 1)
        flipped = np.sign(r[i] - r[j]) != np.sign(c[i] - c[j])
        gaps += np.abs(r[i] - r[j])[flipped].tolist()
    margins = [
        float(ref_b[0][1] - ref_b[1][1])
        for ref_b, fp8_b in zip(beams_ref, beams_fp8)
        if list(ref_b[0][0]) != list(fp8_b[0][0])
    ]
    gaps_np, margins_np = np.asarray(gaps), np.asarray(margins)
    out = {
        "ranking values tied with another item of their group (bf16 reference)": f"{tied} of "
        f"{total}",
        "pairs flipped by mlp (groups, not pooled)": len(gaps),
        "... of which tied in the reference": int((gaps_np == 0).sum()),
        "... of which reference gap < 0.1 (log-prob)": int((gaps_np < 0.1).sum()),
        "beam top-1 changed by mlp": len(margins),
        "... reference top-1/top-2 margin = 0": int((margins_np == 0).sum()),
        "... reference margin < 0.05": int((margins_np < 0.05).sum()),
        "median reference margin, all beam prompts": float(
            np.median([b[0][1] - b[1][1] for b in beams_ref])
        ),
    }
    print("\n### What `mlp` flips\n")
    for k, v in out.items():
        print(f"- {k}: {v}")
    return out


def _beams(engine, eval_set) -> list:
    """The full beam lists (tokens, log-prob) of every beam case, grouped by (width, steps)."""
    results: list = [None] * len(eval_set.beam_cases)
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, case in enumerate(eval_set.beam_cases):
        shapes.setdefault((case.beam_width, case.steps), []).append(i)
    for (width, steps), idx in shapes.items():
        prompts = [eval_set.beam_cases[i].prompt for i in idx]
        for i, beams in zip(idx, engine.beam_search_batch(prompts, width, steps)):
            results[i] = beams
    return results


def main(argv=None) -> int:
    from boundgen.demo import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="reference precision")
    ap.add_argument("--scale", default=None, choices=["full", "small", "ci"])
    ap.add_argument(
        "--sections", default="gate,outliers,ties", help="comma list of gate, outliers, ties"
    )
    ap.add_argument("--fp32-head", action="store_true", help="label logits in fp32 (experiment)")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)
    args.model = args.model or str(default_model_path())
    args.emulate = torch.device(args.device).type != "cuda"
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - {"gate", "outliers", "ties"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    t0 = time.perf_counter()
    engine = load_engine(args, args.dtype)
    eval_set = gate_eval_set(engine, args.model, scale=args.scale)
    print(
        f"{args.model} on {engine.device} ({engine.dtype}{', fp32 head' * args.fp32_head}), FP8 "
        f"{'emulated' if args.emulate else 'scaled_mm'}; eval set {eval_set.name}: "
        f"{len(eval_set.score_cases)} score groups, {len(eval_set.beam_cases)} beam prompts"
    )
    result: dict = {"args": vars(args), "device": str(engine.device), "eval_set": eval_set.name}
    with torch.inference_mode():
        ref = collect_outputs(engine_callables(engine), eval_set)
        if "gate" in sections:
            result["gate"] = section_gate(engine, args, eval_set, ref)
        if "outliers" in sections:
            result["outliers"] = section_outliers(engine, args, eval_set)
        if "ties" in sections:
            result["ties"] = section_ties(engine, args, eval_set, ref)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
