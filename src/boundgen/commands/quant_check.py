"""`boundgen quant-check`: run the FP8 fidelity gate for a checkpoint and store the verdict."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HELP = (
    "check an FP8 policy against bf16 beyond bf16's own noise (decided pairs, decided beams, task "
    "metrics) and record the result"
)


def _policy_arg(text: str) -> str:
    """argparse type: 'all' or a policy's canonical name (a bad one is a usage error)."""
    from boundgen.quant.policy import parse_policy

    if text.strip().lower() == "all":
        return "all"
    try:
        return parse_policy(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from boundgen.quant.policy import ALIASES

    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument(
        "--fp8",
        # the recommended policy: what a user asks about first
        default="selective",
        type=_policy_arg,
        metavar="POLICY",
        help=f"policy to check: none | mlp | mlp+attn-proj | selective (= {ALIASES['selective']}: "
        "of the policies tried, the most FP8 GEMM FLOPs that pass the gate on the demo model) | "
        "a selective one such as mlp:layers=1-2, mlp:skip=0,-1, gate_up_proj (docs/fp8.md); "
        "'all': every named one except none; default selective",
    )
    parser.add_argument(
        "--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", help="reference precision (default bfloat16)"
    )
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="quantize->dequantize FP8 numerics (any device; no FP8 hardware needed)",
    )
    parser.add_argument(
        "--scale",
        choices=["full", "small", "ci"],
        default=None,
        help="eval-set size: full = DESIGN §9 shapes (default on cuda), small (default on cpu), "
        "ci (seconds)",
    )
    parser.add_argument(
        "--eval-set",
        action="append",
        default=[],
        metavar="JSON",
        help="extra held-out eval set (EvalSet.to_json format); may repeat",
    )
    parser.add_argument(
        "--no-demo-set",
        action="store_true",
        help="skip the held-out set a demo checkpoint ships (eval.json), used by default",
    )
    parser.add_argument(
        "--controls",
        action="store_true",
        help="also judge two configurations that are not FP8 (fp32; bf16 with share_prefix off) "
        "by the gate: both must pass, else exit 3 (not recorded)",
    )
    parser.add_argument(
        "--labels", type=int, nargs="+", default=None, help="label token ids to score"
    )
    parser.add_argument("--seed", type=int, default=0, help="eval-set seed (default 0)")
    parser.add_argument(
        "--attention",
        default="auto",
        help="attention backend (auto | reference | varlen | segments | segments-cascade)",
    )
    parser.add_argument(
        "--json", default=None, metavar="OUT", help="also write the reports as JSON"
    )
    parser.add_argument(
        "--no-record", action="store_true", help="do not store the verdict in the gate cache"
    )


def load_reference_engine(model_dir, device, dtype="bfloat16", **overrides):
    """The engine in plain precision (FP8 off, whatever the engine's default policy) on the eager
    runner: the gate swaps projections in place, which captured CUDA graphs and compiled buckets
    would not see (they would replay the bf16 kernels)."""
    from boundgen.engine import Engine

    overrides = {"fp8": "none", "backend": "eager", **overrides}
    return Engine.from_pretrained(model_dir, device=device, dtype=dtype, **overrides)


# The exact-math variant whose distance from the bf16 reference is the gate's noise floor (flash
# varlen attention has no fp32 kernel: SDPA), and the controls: configurations that are not FP8,
# which the gate must pass.
EXACT = ("float32", {"attention": "reference"})
CONTROLS = {
    "fp32, SDPA attention (the floor's own run)": EXACT,
    "bf16, share_prefix off (same math, other order)": (None, {"share_prefix": False}),
}


def demo_task(model_dir):
    """`task(engine) -> {name: TaskMetric}` for a checkpoint that ships held-out labels and its
    catalog trie (`boundgen train-demo`), else None."""
    from boundgen.demo.evaluate import DemoAssets, gate_task_metrics
    from boundgen.workloads.trie import Trie

    model_dir = Path(model_dir)
    needed = ("eval.json", "demo.json", "catalog.json")
    if not all((model_dir / name).is_file() for name in needed):
        return None
    assets = DemoAssets.load(model_dir)
    if not assets.trie_path.is_file():
        return None
    trie = Trie.from_file(assets.trie_path)
    return lambda engine: gate_task_metrics(engine, assets, trie)


def collect_variant(model_dir, device, eval_set, task, dtype, **overrides):
    """The outputs of the checkpoint loaded as another configuration (dtype, engine options) on
    `eval_set`; the engine is closed after."""
    from boundgen.quant.outputs import collect_outputs, engine_callables

    engine = load_reference_engine(model_dir, device, dtype, **overrides)
    try:
        return collect_outputs(engine_callables(engine, task), eval_set)
    finally:
        engine.close()


def control_reports(model_dir, device, eval_set, task, ref, exact, floor, thresholds, dtype):
    """The gate's verdict on each of `CONTROLS` against the reference outputs `ref` (the fp32 one
    is `exact`, the floor's own run)."""
    from boundgen.quant.fidelity import compare_outputs

    reports = {}
    for label, (control_dtype, overrides) in CONTROLS.items():
        if (control_dtype, overrides) == EXACT:
            cand = exact
        else:
            cand = collect_variant(
                model_dir, device, eval_set, task, control_dtype or dtype, **overrides
            )
        reports[label] = compare_outputs(ref, cand, eval_set, label, floor, thresholds)
    return reports


def run(args: argparse.Namespace) -> int:
    import torch

    from boundgen.quant.evalset import gate_eval_set
    from boundgen.quant.fidelity import GateThresholds, gate_engine
    from boundgen.quant.fp8 import fp8_supported
    from boundgen.quant.gate_cache import cache_path, record_gate_result
    from boundgen.quant.noise import measure_noise_floor
    from boundgen.quant.outputs import collect_outputs, engine_callables
    from boundgen.quant.policy import PRESETS

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.emulate:
        ok, reason = fp8_supported(device)
        if not ok:
            raise RuntimeError(f"real FP8 is not available: {reason}")
    policies = [p for p in PRESETS if p != "none"] if args.fp8 == "all" else [args.fp8]
    thresholds = GateThresholds()
    engine = load_reference_engine(args.model, device, args.dtype, attention=args.attention)
    eval_set = gate_eval_set(
        engine,
        args.model,
        scale=args.scale,
        seed=args.seed,
        labels=args.labels,
        extra=args.eval_set,
        demo=not args.no_demo_set,
    )
    task = None if args.no_demo_set else demo_task(args.model)
    print(
        f"model {args.model} on {engine.device} ({engine.dtype}); eval set {eval_set.name}: "
        f"{sum(len(c.items) for c in eval_set.score_cases)} scored items in "
        f"{len(eval_set.score_cases)} groups, {len(eval_set.beam_cases)} beam prompts; task "
        f"metrics: {'the held-out labels' if task else 'none (the checkpoint ships no labels)'}",
        flush=True,
    )
    ref = collect_outputs(engine_callables(engine, task), eval_set)
    dtype, overrides = EXACT
    exact = collect_variant(args.model, device, eval_set, task, dtype, **overrides)
    floor = measure_noise_floor(ref, exact, eval_set, thresholds.quantile)
    print(floor.format(), flush=True)
    controls = {}
    if args.controls:
        controls = control_reports(
            args.model, device, eval_set, task, ref, exact, floor, thresholds, args.dtype
        )
        for report in controls.values():
            print(report.format(), flush=True)
    reports = gate_engine(
        engine,
        policies,
        eval_set,
        floor=floor,
        reference_outputs=ref,
        task=task,
        emulate=args.emulate,
        thresholds=thresholds,
        log=lambda line: print(line, flush=True),
    )
    if not args.no_record:
        for policy, report in reports.items():
            if policy != "none":
                record_gate_result(args.model, policy, report.to_dict())
        print(f"recorded in {cache_path()}")
    if args.json:
        result = {
            "noise_floor": dataclasses.asdict(floor),
            "controls": {label: r.to_dict() for label, r in controls.items()},
            "reports": {p: r.to_dict() for p, r in reports.items()},
        }
        Path(args.json).write_text(json.dumps(result, indent=1))
    failed = [p for p, r in reports.items() if not r.passed]
    if failed:
        print(
            f"policy {', '.join(failed)} FAILED the gate; the engine will refuse it unless forced",
            file=sys.stderr,
        )
    failed_controls = [label for label, r in controls.items() if not r.passed]
    if failed_controls:
        print(
            f"control {', '.join(failed_controls)} FAILED the gate: on this eval set it judges "
            f"noise, not FP8",
            file=sys.stderr,
        )
    return 3 if failed or failed_controls else 0
