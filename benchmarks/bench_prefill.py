"""Prefill-only workloads W1–W3 (DESIGN §9): boundgen vs HF transformers eager (+ torch.compile),
one run.

    python benchmarks/bench_prefill.py --preset qwen2.5-0.5b --device cuda --out $OUT/prefill.json
    python benchmarks/bench_prefill.py --preset tiny --device cpu --workloads w2     # CPU, W2-style

Every variant first checks its label logits against HF on the same inputs (max |diff| reported),
then is timed (median of repeated end-to-end calls: packing, H2D, forward, label columns, copy
back).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine
from boundgen.checkpoints import ensure_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None, help="existing model dir (default: make the preset)")
    ap.add_argument("--root", default=None, help="where synthetic models are cached")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--workloads", nargs="+", default=["w1", "w2", "w3"])
    ap.add_argument("--hf", nargs="*", default=["eager", "compile"], help="HF baselines to run")
    ap.add_argument(
        "--backends", nargs="+", default=["eager"], help="boundgen backends (Engine backend=)"
    )
    ap.add_argument("--w2-items", type=int, default=100)
    ap.add_argument("--w1-prompts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=20.0, help="time budget per timed variant")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (both sides)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dev = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    path = (
        Path(args.model)
        if args.model
        else ensure_model(
            args.preset, dtype="bfloat16" if dev.type == "cuda" else "float32", root=args.root
        )
    )
    engines = {}
    for backend in args.backends:
        t0 = time.perf_counter()
        kwargs = {} if backend == "eager" else {"backend": backend}
        try:
            engines[backend] = Engine.from_pretrained(
                path, device=args.device, dtype=dtype_name, **kwargs
            )
        except Exception as exc:
            print(f"backend {backend} failed to load: {exc}")
            traceback.print_exc()
        print(f"loaded boundgen[{backend}] in {time.perf_counter() - t0:.1f}s")
    first = next(iter(engines.values()))
    cfg = first.config
    vocab = min(first.tokenizer.vocab_size, cfg.vocab_size)
    labels = [514, 371]
    hf = {}
    for mode in args.hf:
        t0 = time.perf_counter()
        hf[mode] = common.hf_model(path, dev, dtype, None if mode == "eager" else "default")
        print(f"loaded HF {mode} in {time.perf_counter() - t0:.1f}s")

    results = {
        "env": common.env_info(),
        "model": str(path),
        "preset": args.preset,
        "dtype": dtype_name,
        "workloads": {},
    }
    rows = []

    def run(name, seqs_for_hf, ours_call, flops, real_tokens, items, hf_batch):
        entry = results["workloads"].setdefault(name, {})
        ref = None
        for mode, model in hf.items():
            try:
                t0 = time.perf_counter()
                out = common.hf_last_logits(model, seqs_for_hf, dev, hf_batch, labels)
                first_ms = (time.perf_counter() - t0) * 1e3
                ref = out if ref is None else ref
                t = common.timed(
                    lambda: common.hf_last_logits(model, seqs_for_hf, dev, hf_batch, labels),
                    dev,
                    warmup=1,
                    iters=args.iters,
                    budget_s=args.budget_s,
                )
                t["first_call_ms"] = first_ms
                _record(entry, rows, name, f"hf-{mode}", t, flops, real_tokens, items)
            except Exception as exc:
                entry[f"hf-{mode}"] = {"error": repr(exc)}
                traceback.print_exc()
        for backend, engine in engines.items():
            try:
                t0 = time.perf_counter()
                out = torch.tensor(ours_call(engine))
                first_ms = (time.perf_counter() - t0) * 1e3
                t = common.timed(
                    lambda: ours_call(engine),
                    dev,
                    warmup=2,
                    iters=args.iters,
                    budget_s=args.budget_s,
                )
                t["first_call_ms"] = first_ms
                if ref is not None:
                    # the label softmax of both (engine.score(apply_softmax=True))
                    t["max_abs_diff_vs_hf"] = (out - ref.cpu().softmax(-1)).abs().max().item()
                _record(entry, rows, name, f"boundgen-{backend}", t, flops, real_tokens, items)
            except Exception as exc:
                entry[f"boundgen-{backend}"] = {"error": repr(exc)}
                traceback.print_exc()

    if "w1" in args.workloads:
        prompts = common.w1_prompts(vocab, n=args.w1_prompts)
        lens = [len(p) for p in prompts]
        run(
            "W1",
            prompts,
            lambda e: e.score([], prompts, labels, apply_softmax=True),
            common.prefill_flops(cfg, lens, head_rows=len(prompts), head_cols=len(labels)),
            sum(lens),
            len(prompts),
            64,
        )
    if "w2" in args.workloads:
        query, cands = common.w2_request(vocab, items=args.w2_items)
        run(
            "W2",
            [query + c for c in cands],
            lambda e: e.score(query, cands, labels, apply_softmax=True),
            common.prefill_flops(
                cfg,
                [len(c) for c in cands],
                prefix=len(query),
                head_rows=len(cands),
                head_cols=len(labels),
            ),
            len(query) + sum(map(len, cands)),
            len(cands),
            len(cands),
        )
    if "w3" in args.workloads:
        prompt = common.w1_prompts(vocab, n=1, lo=64, hi=64, seed=3)
        if "compile" in hf:  # the strongest HF peer for one small prompt: CUDA graphs
            hf["compile"] = (
                common.hf_model(path, dev, dtype, "reduce-overhead")
                if dev.type == "cuda"
                else hf["compile"]
            )
        run(
            "W3",
            prompt,
            lambda e: e.score([], prompt, labels, apply_softmax=True),
            common.prefill_flops(cfg, [64], head_rows=1, head_cols=len(labels)),
            64,
            1,
            1,
        )

    common.print_table(
        rows,
        [
            "workload",
            "variant",
            "median_ms",
            "p90_ms",
            "tok_per_s",
            "items_per_s",
            "mfu_spec",
            "first_call_ms",
            "max_abs_diff_vs_hf",
            "speedup_vs_hf_eager",
        ],
    )
    common.write_json(args.out, results)
    return 0


def _record(entry, rows, name, variant, t, flops, real_tokens, items):
    s = t["median_ms"] / 1e3
    t.update(tok_per_s=real_tokens / s, items_per_s=items / s, tflops=flops / s / 1e12)
    t.update({f"mfu_{k}": v for k, v in common.mfu(flops, s).items()})
    base = entry.get("hf-eager", {}).get("median_ms")
    if base:
        t["speedup_vs_hf_eager"] = base / t["median_ms"]
    entry[variant] = t
    rows.append({"workload": name, "variant": variant, **t})


if __name__ == "__main__":
    sys.exit(main())
