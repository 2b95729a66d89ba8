"""Model backends on W1–W4 (DESIGN §9): eager vs torch.compile vs AOTInductor (± CUDA graphs) vs HF
eager.

    # H200, ≤ 10 min:
    python benchmarks/bench_backends.py --device cuda --out $OUT/backends.json
    # CPU smoke run:
    python benchmarks/bench_backends.py --preset tiny --device cpu --variants eager compile aoti \\
        --buckets t64 t256-s16-m64-g2-p64-q128 --budget-s 300

Order (so one device call is enough and numbers are honest):
1. model (random weights, cached), eager engine;
2. AOTInductor buckets: cache hits are verified, misses built in `--jobs` processes *before* any
   timing (so compiles never share the machine with a timed run); compile time per bucket is
   reported, for hits the time recorded when the artifact was built;
3. libstdc++ guard: a probe load in a child process; if loading needs the preload, the benchmark
   re-execs itself with it (the time budget is absolute, so the re-exec does not extend it);
4. per workload: HF eager baseline, then every variant: max |Δ| of its scores vs boundgen eager,
   median / p90 latency of the end-to-end call, host time per call (time until the call returns, no
   device sync), throughput; padding per bucket; W4 = one beam decode step (W=16) eager vs CUDA
   graph, + full beam.
Every variant is guarded: one failure is recorded as {"error": ...} and the rest still run. The
JSON is rewritten after every phase, so a timeout still leaves the numbers measured so far.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine
from boundgen.checkpoints import ensure_model
from boundgen.compile.backends import CompiledForwards, CompileOptions, aoti_slots
from boundgen.compile.buckets import parse_buckets
from boundgen.compile.cache import ArtifactCache, ArtifactError, platform_info
from boundgen.runner import ModelRunner, make_runner
from boundgen.workloads.score import ScoreRequest, prepare_score

# W3 prompt, W2 request (prefix 256 + 100 x 16), W1 chunks (≤ 8192 tokens) and W1's remainder
DEFAULT_BUCKETS = [
    "t64-s4-m64",
    "t2048-s128-m512-g2-p320-q1728",
    "t1024-s32-m512",
    "t8192-s256-m512",
]
_DEADLINE = "BOUNDGEN_BENCH_DEADLINE"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None, help="existing model dir (default: make the preset)")
    ap.add_argument("--root", default=None, help="where synthetic models are cached")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument(
        "--variants", nargs="+", default=["eager", "eager+graphs", "compile", "aoti", "aoti+graphs"]
    )
    ap.add_argument("--hf", nargs="*", default=["eager"], help="HF baselines (eager, compile)")
    ap.add_argument("--workloads", nargs="+", default=["w3", "w2", "w1", "w4"])
    ap.add_argument(
        "--buckets", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_BUCKETS)}"
    )
    ap.add_argument(
        "--graph-max-tokens", type=int, default=None, help="default: the engine's, per backend"
    )
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--jobs", type=int, default=4, help="parallel AOTInductor builds")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variant-budget-s", type=float, default=8.0, help="timing budget per variant")
    ap.add_argument("--budget-s", type=float, default=540.0, help="total time budget (absolute)")
    ap.add_argument(
        "--reserve-s",
        type=float,
        default=240.0,
        help="time kept for measurements when AOTInductor builds run long",
    )
    ap.add_argument("--w1-prompts", type=int, default=256)
    ap.add_argument(
        "--attention",
        default="auto",
        help="attention backend (auto | varlen | segments | segments-cascade | reference)",
    )
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


class Run:
    def __init__(self, args) -> None:
        self.args = args
        deadline = os.environ.get(_DEADLINE)
        self.deadline = float(deadline) if deadline else time.time() + args.budget_s
        os.environ[_DEADLINE] = str(self.deadline)  # survives the preload re-exec
        self.results: dict = {
            "env": common.env_info(),
            "budget_s": args.budget_s,
            "variants": {},
            "workloads": {},
            "skipped": [],
        }
        self.rows: list[dict] = []

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        common.write_json(self.args.out, self.results)

    def guard(self, where: str, fn, need_s: float = 5.0):
        if self.left() < need_s:
            self.results["skipped"].append(f"{where}: {self.left():.0f}s left of the budget")
            print(f"skip {where} (budget)")
            return None
        try:
            return fn()
        except Exception as exc:
            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {exc}"[:800]}


def host_and_latency(fn, device, iters: int, budget_s: float) -> dict:
    """Latency (call + sync) and host time (until the call returns, device idle before each
    call)."""
    fn()
    common.sync(device)
    host, lat = [], []
    start = time.perf_counter()
    for _ in range(iters):
        common.sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        common.sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        lat.append((t2 - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(lat) >= 3:
            break
    lat.sort()
    return {
        "median_ms": statistics.median(lat),
        "p90_ms": lat[int(0.9 * (len(lat) - 1))],
        "min_ms": lat[0],
        "host_ms": statistics.median(host),
        "iters": len(lat),
    }


def build_aoti_buckets(run: Run, engine, buckets, path) -> dict:
    """Verify cache hits in process; build the misses in worker processes; returns per-bucket
    info."""
    from boundgen.compile.parallel import ParallelBuild

    cache = ArtifactCache(run.args.cache_dir)
    plat = platform_info(engine.device)
    info, todo = {}, []
    for b, slot in zip(buckets, aoti_slots(engine.model, engine.device, buckets, "none")):
        try:
            entry = cache.lookup(slot, plat)
            info[b.name] = {
                "event": "hit",
                "export_s": entry.meta.get("export_s"),
                "compile_s": entry.meta.get("compile_s"),
                "path": str(entry.path),
            }
        except ArtifactError as exc:
            info[b.name] = {"event": exc.kind}
            todo.append(b)
    if todo:
        t0 = time.perf_counter()
        cfg = engine.engine_config
        # keep time for the measurements: builds get what is left minus a reserve
        timeout = max(30.0, run.left() - run.args.reserve_s)
        run.results["aoti_build_timeout_s"] = timeout
        build = ParallelBuild(
            path,
            str(engine.device),
            cfg.dtype,
            cfg.attention,
            todo,
            cache.root,
            jobs=min(run.args.jobs, len(todo)),
        )
        for r in build.results(timeout_s=timeout):
            info[r["bucket"]] = r
            print(
                f"  built {r['bucket']}: {r.get('event')} export {r.get('export_s')} compile "
                f"{r.get('compile_s')} {r.get('error', '')}"
            )
        run.results["aoti_build_wall_s"] = time.perf_counter() - t0
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    dev = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    path = (
        Path(args.model)
        if args.model
        else ensure_model(args.preset, dtype=dtype_name, root=args.root, progress=False)
    )
    engine = Engine.from_pretrained(
        path, device=args.device, dtype=dtype_name, backend="eager", attention=args.attention
    )
    run.results.update(
        model=str(path), preset=args.preset, dtype=dtype_name, attention=engine.model.backend.name
    )
    buckets = parse_buckets(args.buckets or DEFAULT_BUCKETS)
    run.results["buckets"] = [b.name for b in buckets]
    cfg = engine.config
    vocab = min(engine.tokenizer.vocab_size, cfg.vocab_size)
    labels = [514, 371]

    # -- 2/3. AOTInductor builds first, then the load guard (may re-exec this process)
    # ----------------
    if any(v.startswith("aoti") for v in args.variants):
        res = run.guard(
            "aoti build", lambda: build_aoti_buckets(run, engine, buckets, path), need_s=60
        )
        run.results["aoti_buckets"] = res
        run.save()
        paths = [r["path"] for r in (res or {}).values() if isinstance(r, dict) and r.get("path")]
        if paths:
            from boundgen.compile.preload import AOTIUnsafe, ensure_loadable

            try:
                run.results["aoti_load"] = ensure_loadable(
                    paths[0], ArtifactCache(args.cache_dir).root, allow_reexec=True
                )
            except AOTIUnsafe as exc:
                run.results["aoti_load"] = {"status": "unsafe", "detail": str(exc)}
            run.results["aoti_load"]["ld_preload"] = os.environ.get("LD_PRELOAD", "")
            run.save()

    # -- baselines: HF eager (and compile) and boundgen eager, per workload
    # ------------------------------
    hf = {}
    for mode in args.hf:
        got = run.guard(
            f"load hf-{mode}",
            lambda mode=mode: common.hf_model(
                path, dev, getattr(torch, dtype_name), None if mode == "eager" else "default"
            ),
            need_s=20,
        )
        if got is not None and not isinstance(got, dict):
            hf[mode] = got
    work = {}  # name → (query, items, hf_seqs, hf_batch, real_tokens, groups, eager scores)
    for w in args.workloads:
        if w == "w3":
            prompt = common.w1_prompts(vocab, n=1, lo=64, hi=64, seed=3)
            work["W3"] = ([], prompt, prompt, 1, 64)
        elif w == "w2":
            query, cands = common.w2_request(vocab)
            work["W2"] = (
                query,
                cands,
                [query + c for c in cands],
                len(cands),
                len(query) + sum(map(len, cands)),
            )
        elif w == "w1":
            prompts = common.w1_prompts(vocab, n=args.w1_prompts)
            work["W1"] = ([], prompts, prompts, 64, sum(map(len, prompts)))
    refs, groups_of = {}, {}
    for name, (query, items, hf_seqs, hf_batch, _) in work.items():
        entry = run.results["workloads"].setdefault(name, {})
        groups_of[name] = prepare_score(
            ScoreRequest(query, items, labels), engine.tokenizer, engine.limits
        )
        refs[name] = torch.tensor(engine.score(query, items, labels, apply_softmax=True))
        for mode, model in hf.items():
            entry[f"hf-{mode}"] = run.guard(
                f"{name} hf-{mode}",
                lambda model=model, s=hf_seqs, b=hf_batch: host_and_latency(
                    lambda: common.hf_last_logits(model, s, dev, b, labels),
                    dev,
                    args.iters,
                    args.variant_budget_s,
                ),
            )
        run.save()
    if (
        "w4" in args.workloads and "eager" in hf
    ):  # HF beam search (W=16, S=4) in the same run as ours
        hf_w4 = run.results["workloads"].setdefault("W4-hf", {})
        for b in (1, 8):
            ids = torch.tensor(common.w1_prompts(vocab, n=b, lo=128, hi=128, seed=4), device=dev)
            kw = dict(
                num_beams=16,
                num_return_sequences=16,
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                length_penalty=0.0,
                early_stopping=False,
            )
            hf_w4[f"batch{b}"] = run.guard(
                f"W4 b{b} hf-eager",
                lambda ids=ids, kw=kw, m=hf["eager"]: host_and_latency(
                    lambda: m.generate(ids, **kw), dev, 10, args.variant_budget_s
                ),
            )
        run.save()
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "w4" in args.workloads:
        run.results["workloads"]["W4"] = run.guard(
            "W4", lambda: bench_decode(run, engine, vocab), need_s=20
        )
        run.save()

    def measure(name, e):
        query, items, _, _, real_tokens = work[name]
        out = torch.tensor(e.score(query, items, labels, apply_softmax=True))
        t = host_and_latency(
            lambda: e.score(query, items, labels, apply_softmax=True),
            dev,
            args.iters,
            args.variant_budget_s,
        )
        fwd = host_and_latency(
            lambda: e.runner.rows(groups_of[name]),
            dev,
            args.iters,
            args.variant_budget_s / 2,
        )
        t.update(
            max_abs_diff_vs_eager=float((out - refs[name]).abs().max()),
            forward_host_ms=fwd["host_ms"],
            forward_ms=fwd["median_ms"],
            tok_per_s=real_tokens / (t["median_ms"] / 1e3),
            items_per_s=len(items) / (t["median_ms"] / 1e3),
        )
        if hasattr(e.runner, "stats"):
            t["buckets"] = e.runner.stats()
        base = (run.results["workloads"][name].get("hf-eager") or {}).get("median_ms")
        if base:
            t["speedup_vs_hf_eager"] = base / t["median_ms"]
        return t

    # -- variants, cheapest set-up first, so the budget only ever cuts the last ones
    # ------------------
    order = {
        "eager": 0,
        "eager+graphs": 1,
        "aoti": 2,
        "aoti+graphs": 3,
        "compile": 4,
        "compile+graphs": 5,
    }
    for variant in sorted(args.variants, key=lambda v: order.get(v, 9)):

        def make(variant=variant):
            if variant == "eager":
                return engine, {"setup_s": 0.0}
            setup = []
            t0 = time.perf_counter()
            use = buckets
            if variant.startswith(
                "aoti"
            ):  # only the buckets that built: one failure must not lose all
                built = run.results.get("aoti_buckets") or {}
                use = [
                    b
                    for b in buckets
                    if isinstance(built.get(b.name), dict) and built[b.name].get("path")
                ]
                if not use:
                    raise RuntimeError("no AOTInductor bucket was built")
            opts = CompileOptions(
                buckets=use,
                cache_dir=args.cache_dir,
                rebuild=False,
                graph_max_tokens=args.graph_max_tokens,
                warmup=False,
            )
            cfg = engine.engine_config
            runner = None
            if variant.startswith("compile"):  # first call per bucket = torch.compile time
                runner = make_runner(
                    engine.model,
                    dev,
                    engine.engine_config.max_batch_tokens,
                    engine.engine_config.share_prefix,
                    "compile",
                    opts,
                )
                warmed = []
                with torch.inference_mode():
                    for b in sorted(
                        buckets, key=lambda b: b.tokens
                    ):  # stop when the budget runs low
                        if run.left() < args.reserve_s / 4:
                            setup.append({"bucket": b.name, "skipped": "budget"})
                            continue
                        t1 = time.perf_counter()
                        runner.forwards.fns[b](b.example(dev))
                        common.sync(dev)
                        setup.append({"bucket": b.name, "compile_s": time.perf_counter() - t1})
                        warmed.append(b)
                if not warmed:
                    raise RuntimeError("no bucket compiled within the budget")
                # only warmed buckets: a cold one would compile inside a timed call
                fns = {b: runner.forwards.fns[b] for b in warmed}
                runner = ModelRunner(
                    engine.model,
                    dev,
                    CompiledForwards("compile", warmed, fns, True),
                    cfg.max_batch_tokens,
                    cfg.share_prefix,
                )
            if variant != "compile":
                runner = make_runner(
                    engine.model, dev, cfg.max_batch_tokens, cfg.share_prefix, variant, opts
                )
            e = engine.with_runner(runner)
            return e, {"setup_s": time.perf_counter() - t0, "per_bucket": setup}

        made = run.guard(
            f"setup {variant}", make, need_s=60 if variant.startswith("compile") else 20
        )
        if not isinstance(made, tuple):
            run.results["variants"][variant] = made
            run.save()
            continue
        e, run.results["variants"][variant] = made
        print(f"variant {variant}: {run.results['variants'][variant]}")
        for name in work:
            t = run.guard(f"{name} {variant}", lambda name=name, e=e: measure(name, e))
            run.results["workloads"][name][variant] = t
            run.save()
        decode = e.runner.forwards.decode if e.runner.forwards else None
        if "w4" in args.workloads and decode is not None:
            w4 = run.results["workloads"].setdefault("W4", {}) or {}
            for b in (
                1,
                8,
            ):  # full beam search; decode steps graphed once beam.py uses decode_graphs
                prompts = common.w1_prompts(vocab, n=b, lo=128, hi=128, seed=4)
                w4.setdefault(f"batch{b}", {})[f"beam_search_{variant}"] = run.guard(
                    f"W4 b{b} {variant}",
                    lambda e=e, prompts=prompts: host_and_latency(
                        lambda: e.beam_search_batch(prompts, 16, 4),
                        dev,
                        10,
                        args.variant_budget_s / 2,
                    ),
                )
            run.results["workloads"]["W4"] = w4
            run.save()
        e.close()
        del e

    for name in work:
        for variant, t in run.results["workloads"][name].items():
            if isinstance(t, dict) and "median_ms" in t:
                run.rows.append({"workload": name, "variant": variant, **t})
    common.print_table(
        run.rows,
        [
            "workload",
            "variant",
            "median_ms",
            "p90_ms",
            "host_ms",
            "forward_host_ms",
            "forward_ms",
            "tok_per_s",
            "max_abs_diff_vs_eager",
            "speedup_vs_hf_eager",
        ],
    )
    for w, v in (run.results["workloads"].get("W4") or {}).items():
        print("W4", w, v)
    for w, v in (run.results["workloads"].get("W4-hf") or {}).items():
        print("W4 HF eager generate", w, v)
    run.results["elapsed_s"] = args.budget_s - run.left()
    run.save()
    return 0


@torch.inference_mode()
def bench_decode(run: Run, engine, vocab: int) -> dict:
    """One beam decode step (prompt 128, W=16, S=4), eager vs CUDA graph; then the full beam
    search."""
    from boundgen.kv import BeamKV, DecodeKV, PromptKV
    from boundgen.text.packing import SequenceGroup, pack

    dev, model, cfg, args = engine.device, engine.model, engine.config, run.args
    out = {}
    for b in (1, 8):
        w, steps = 16, 4
        n = b * w
        prompts = common.w1_prompts(vocab, n=b, lo=128, hi=128, seed=4)
        batch = pack([SequenceGroup([], prompts)], share_prefix=False).to(dev)
        dtype = model.embed_tokens.weight.dtype
        pkv = PromptKV(cfg.num_layers, batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
        model(batch.input_ids, batch.positions, batch.attn, pkv)
        state = DecodeKV(
            pkv,
            batch.attn.cu_seqlens,
            batch.attn.max_seqlen,
            BeamKV(cfg.num_layers, n, steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev),
            torch.arange(0, n + 1, w, dtype=torch.int32, device=dev),
            w,
            cfg.gqa,
        )
        state.step = 1
        tok = torch.randint(100, vocab, (n,), device=dev)
        pos = torch.full((n,), 129, device=dev)
        step = lambda t, p: model.head(model(t, p, None, state))
        entry = {"rows": n}
        entry["eager"] = run.guard(
            f"W4 b{b} eager",
            lambda: host_and_latency(lambda: step(tok, pos), dev, 50, args.variant_budget_s / 2),
        )
        if dev.type == "cuda":

            def graphed():
                from boundgen.compile.graphs import StaticGraph

                t0 = time.perf_counter()
                g = StaticGraph(step, [tok.clone(), pos.clone()])
                capture_s = time.perf_counter() - t0
                diff = float((g(tok, pos).float() - step(tok, pos).float()).abs().max())
                t = host_and_latency(lambda: g(tok, pos), dev, 50, args.variant_budget_s / 2)
                return {**t, "capture_s": capture_s, "max_abs_diff_vs_eager": diff}

            entry["graphs"] = run.guard(f"W4 b{b} graphs", graphed)
        entry["beam_search_eager"] = run.guard(
            f"W4 b{b} beam",
            lambda prompts=prompts: host_and_latency(
                lambda: engine.beam_search_batch(prompts, w, steps),
                dev,
                10,
                args.variant_budget_s / 2,
            ),
        )
        out[f"batch{b}"] = entry
    return out


if __name__ == "__main__":
    sys.exit(main())
