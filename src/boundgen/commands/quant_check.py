"""`boundgen quant-check`: run the FP8 fidelity gate for a checkpoint and store the verdict."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = (
    "check an FP8 policy against bf16 (score Spearman, top-10 overlap, beam top-1) and record the "
    "result"
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
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument(
        "--fp8",
        default="mlp",
        type=_policy_arg,
        metavar="POLICY",
        help="policy to check: none | mlp | mlp+attn-proj | a selective one such as "
        "mlp:layers=1-2, mlp:skip=0,-1, gate_up_proj (docs/fp8.md); 'all': every preset except "
        "none; default mlp",
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
        "--noise-floor",
        action="store_true",
        help="also compare bf16 with fp32 on the same set (context for the thresholds)",
    )
    parser.add_argument(
        "--labels", type=int, nargs="+", default=None, help="label token ids to score"
    )
    parser.add_argument("--seed", type=int, default=0, help="eval-set seed (default 0)")
    parser.add_argument(
        "--attention", default="auto", help="attention backend (auto | reference | varlen)"
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


def run(args: argparse.Namespace) -> int:
    import torch

    from boundgen.quant.fidelity import (
        collect_outputs,
        compare_outputs,
        engine_callables,
        gate_engine,
        gate_eval_set,
    )
    from boundgen.quant.fp8 import fp8_supported
    from boundgen.quant.gate_cache import cache_path, record_gate_result
    from boundgen.quant.policy import PRESETS

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.emulate:
        ok, reason = fp8_supported(device)
        if not ok:
            raise RuntimeError(f"real FP8 is not available: {reason}")
    policies = [p for p in PRESETS if p != "none"] if args.fp8 == "all" else [args.fp8]
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
    print(
        f"model {args.model} on {engine.device} ({engine.dtype}); eval set {eval_set.name}: "
        f"{sum(len(c.items) for c in eval_set.score_cases)} scored items in "
        f"{len(eval_set.score_cases)} groups, {len(eval_set.beam_cases)} beam prompts",
        flush=True,
    )
    ref = collect_outputs(engine_callables(engine), eval_set)
    reports = gate_engine(
        engine,
        policies,
        eval_set,
        emulate=args.emulate,
        log=lambda line: print(line, flush=True),
        reference_outputs=ref,
    )
    if args.noise_floor:
        # How close two "exact" runs get: bf16 (the reference above) against fp32 with SDPA
        # attention.
        del engine
        engine32 = load_reference_engine(args.model, device, "float32", attention="reference")
        floor = compare_outputs(
            collect_outputs(engine_callables(engine32), eval_set),
            ref,
            eval_set,
            "bf16 vs fp32 (noise floor, not recorded)",
        )
        print(floor.format(), flush=True)
    if not args.no_record:
        for policy, report in reports.items():
            if policy != "none":
                record_gate_result(args.model, policy, report.to_dict())
        print(f"recorded in {cache_path()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({p: r.to_dict() for p, r in reports.items()}, indent=1)
        )
    failed = [p for p, r in reports.items() if not r.passed]
    if failed:
        print(
            f"policy {', '.join(failed)} FAILED the gate; the engine will refuse it unless forced",
            file=sys.stderr,
        )
        return 3
    return 0
