"""Issues 15 and 16 on one GPU, in one process: W1–W4 (DESIGN §9) through boundgen's backends next
to HF transformers eager (and HF + torch.compile for W1/W3), with a torch.profiler view of one call
each (wall, GPU busy %, kernels per call, the top kernels).

    python benchmarks/bench_gpu.py --out $OUT/gpu.json                 # H200, ≈ 8 min
    python benchmarks/bench_gpu.py --preset tiny --device cpu --sections hf,eager,beam --items 300

Sections (each under the global budget; one failure is recorded and the others still run):
- hf:    HF eager W1/W2/W3, HF + torch.compile W1 and W3
- eager: boundgen `eager+graphs` (no compile) W1/W2/W3
- aoti:  the AOTInductor buckets W1–W3 use (chunked against the default ladder, W2's cascade bucket
         planned), built in parallel worker processes first, then `aoti+graphs` W1/W2/W3 and the
         padding the chunker gave each
- beam:  W4 (prompt 128, W=16, S=4, batch 1 and 8, free and with a 100K-item depth-4 trie): the
         plain per-request path, the whole search as one CUDA graph with eager layers, and with
         the prefill and decode layers through torch.compile; HF generate (b1, b8 free; b1 trie)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from bench_beam import hf_prefix_fn, make_items

from boundgen import Engine, Trie
from boundgen.checkpoints import ensure_model
from boundgen.compile.buckets import BucketSet, default_buckets
from boundgen.compile.chunking import chunk, predicted_stats
from boundgen.compile.planner import plan, profile_entries
from boundgen.text.packing import SequenceGroup

LABELS = [514, 371]


class Run:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.results: dict = {"env": common.env_info(), "sections": {}, "errors": {}}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def guard(self, name: str, fn, need_s: float = 5.0):
        if self.left() < need_s:
            self.results["errors"][name] = f"skipped: {self.left():.0f}s left"
            print(f"[skip] {name}", flush=True)
            return None
        t = time.perf_counter()
        try:
            out = fn()
            print(f"[done] {name} in {time.perf_counter() - t:.1f}s", flush=True)
            return out
        except Exception as exc:
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            return None

    def save(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.results, indent=1, default=str))


def profile(fn, device) -> dict:
    """One call under torch.profiler (`common.kernel_table`: wall, launches, GPU busy and idle,
    the top kernels); nothing off CUDA."""
    return common.kernel_table(fn, top=15) if device.type == "cuda" else {}


def workloads(vocab: int, args) -> dict:
    w1 = common.w1_prompts(vocab, n=args.w1_prompts)
    query, items = common.w2_request(vocab)
    w3 = common.w1_prompts(vocab, n=1, lo=64, hi=64, seed=3)
    return {
        "W1": {"query": [], "items": w1, "tokens": sum(map(len, w1))},
        "W2": {"query": query, "items": items, "tokens": len(query) + sum(map(len, items))},
        "W3": {"query": [], "items": w3, "tokens": 64},
    }


def time_engine(run: Run, name: str, engine, work: dict, ref: dict, dev) -> dict:
    out = {}
    for w, spec in work.items():
        # the label-softmax head (label columns only), as measured since 2026-11; compared with the
        # softmax of HF's label logits
        call = lambda s=spec: engine.score(s["query"], s["items"], LABELS, apply_softmax=True)
        got = torch.tensor(call())
        t = common.timed(
            call, dev, warmup=2, iters=run.args.iters, budget_s=run.args.variant_budget_s
        )
        t["tok_per_s"] = spec["tokens"] / (t["median_ms"] / 1e3)
        if w in ref:
            t["max_abs_diff_vs_hf"] = float((got - ref[w]).abs().max())
        t["profile"] = profile(call, dev)
        out[w] = t
        print(
            f"  {name} {w}: {t['median_ms']:.2f} ms ({t['tok_per_s'] / 1e3:.0f}K tok/s)", flush=True
        )
    return out


def section_hf(run: Run, path, dev, dtype, work: dict):
    res, ref = {}, {}
    hf = common.hf_model(path, dev, dtype)
    for w, spec in work.items():
        seqs = [spec["query"] + it for it in spec["items"]]
        call = lambda s=seqs, m=hf: common.hf_last_logits(m, s, dev, columns=LABELS)
        ref[w] = call().cpu().softmax(-1)
        t = common.timed(
            call, dev, warmup=1, iters=run.args.iters, budget_s=run.args.variant_budget_s
        )
        t["tok_per_s"] = spec["tokens"] / (t["median_ms"] / 1e3)
        res[f"{w} hf-eager"] = t
    del hf
    return res, ref


def section_hf_compile(run: Run, path, dev, dtype, work: dict) -> dict:
    """HF + torch.compile: W1 (default mode) and W3 (reduce-overhead: CUDA graphs)."""
    res = {}
    if dev.type == "cuda":
        for w, mode in (("W1", "default"), ("W3", "reduce-overhead")):
            model = common.hf_model(path, dev, dtype, compile_mode=mode)
            spec = work[w]
            seqs = [spec["query"] + it for it in spec["items"]]
            call = lambda s=seqs, m=model: common.hf_last_logits(m, s, dev, columns=LABELS)
            t0 = time.perf_counter()
            call()
            first = time.perf_counter() - t0
            t = common.timed(
                call, dev, warmup=2, iters=run.args.iters, budget_s=run.args.variant_budget_s
            )
            t["first_call_s"] = first
            t["tok_per_s"] = spec["tokens"] / (t["median_ms"] / 1e3)
            res[f"{w} hf-compile-{mode}"] = t
            del model
    return res


def section_hf_generate(run: Run, hf, dev, items, prompt_len: int) -> dict:
    out = {}
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(7)
    for batch, constrained in ((1, False), (8, False), (1, True)):
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=g).to(dev)
        kw = dict(
            num_beams=run.args.width,
            num_return_sequences=run.args.width,
            max_new_tokens=run.args.steps,
            min_new_tokens=run.args.steps,
            do_sample=False,
            length_penalty=0.0,
            early_stopping=False,
        )
        if constrained:
            kw["prefix_allowed_tokens_fn"] = hf_prefix_fn(items, prompt_len)
        call = lambda ids=prompts, kw=kw: hf.generate(ids, **kw)
        out[f"b{batch} {'trie' if constrained else 'free'}"] = common.timed(
            call, dev, warmup=1, iters=5, budget_s=run.args.variant_budget_s
        )
    return out


def aoti_buckets(work: dict, max_tokens: int) -> tuple[list, dict]:
    """The buckets W1–W3 use: the default ladder for the plain ones (what the chunker picks) and a
    cascade bucket planned for W2."""
    ladder = default_buckets(8192)
    entries = profile_entries(
        [{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16}]
    )
    cascade = [b for b in plan(entries, max_tokens).buckets if b.cascade]
    used, predicted = set(), {}
    for w, spec in work.items():
        groups = [SequenceGroup(spec["query"], spec["items"])]
        candidates = BucketSet(ladder + cascade)
        pieces = chunk(groups, max_tokens, candidates)
        used |= {p.bucket for p in pieces if p.bucket is not None}
        predicted[w] = predicted_stats(pieces).as_dict()
    return sorted(used, key=lambda b: b.tokens), predicted


def section_aoti(run: Run, path, dev, dtype_name, work, ref) -> dict:
    from boundgen.compile.cache import ArtifactCache
    from boundgen.compile.parallel import ParallelBuild

    buckets, predicted = aoti_buckets(work, 32768)
    print("  aoti buckets:", [b.name for b in buckets], flush=True)
    t0 = time.perf_counter()
    built = ParallelBuild(
        path, "cuda", dtype_name, "auto", buckets, ArtifactCache(None).root, jobs=run.args.jobs
    ).results(timeout_s=max(60.0, run.left() - 120))
    res = {
        "buckets": [b.name for b in buckets],
        "build": built,
        "build_wall_s": time.perf_counter() - t0,
        "predicted_padding": predicted,
    }
    ok = [b.name for b, info in zip(buckets, built) if info.get("path")]
    engine = Engine.from_pretrained(
        path, device="cuda", dtype=dtype_name, backend="aoti+graphs", compile_buckets=",".join(ok)
    )
    res["timings"] = time_engine(run, "aoti+graphs", engine, work, ref, dev)
    res["runner"] = engine.runner.stats()
    engine.close()
    return res


def section_beam(run: Run, path, dev, dtype_name, items: torch.Tensor, prompt_len: int) -> dict:
    from boundgen.compile.aoti import export_attention
    from boundgen.compile.decode import SearchGraphs

    engine = Engine.from_pretrained(path, device=str(dev), dtype=dtype_name, backend="eager")
    model, runner = engine.model, engine.runner
    vocab = min(engine.tokenizer.vocab_size, engine.config.vocab_size)
    t0 = time.perf_counter()
    trie = Trie.from_sequences(items.numpy()).to(dev)
    res = {
        "trie": {"items": trie.num_items, "depth": trie.depth, "build_s": time.perf_counter() - t0}
    }
    eos = tuple(engine.eos_token_ids())
    g = torch.Generator().manual_seed(7)
    use_graphs = dev.type == "cuda"
    variants = {"plain": None}
    variants["graph"] = SearchGraphs(model, dev, model.backend, use_graphs=use_graphs)
    variants["graph+compile"] = SearchGraphs(
        model, dev, export_attention(model, dev), compile_layers=True, use_graphs=use_graphs
    )
    w, s = run.args.width, run.args.steps
    for batch in (1, 8):
        prompts = [
            torch.randint(100, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)
        ]
        for constrained in (False, True):
            t_ = trie if constrained else None
            key = f"b{batch} {'trie' if constrained else 'free'}"
            row = res.setdefault(key, {})
            with torch.inference_mode():
                want = runner.beam_search(prompts, w, s, t_, eos)
            for name, sg in variants.items():
                if run.left() < 20:
                    row[name] = {"skipped": "budget"}
                    continue
                if sg is None:
                    call = lambda p=prompts, t_=t_: runner.beam_search(p, w, s, t_, eos)
                else:
                    call = lambda p=prompts, t_=t_, sg=sg: sg.run(p, w, s, t_, eos)
                try:
                    with torch.inference_mode():
                        t1 = time.perf_counter()
                        got = call()
                        first_s = time.perf_counter() - t1
                        tm = common.timed(
                            call,
                            dev,
                            warmup=2,
                            iters=run.args.iters,
                            budget_s=run.args.variant_budget_s,
                        )
                        tm["first_call_s"] = first_s
                        tm["top1_equal"] = bool(torch.equal(got[0][:, 0], want[0][:, 0]))
                        same = sum(
                            len(
                                set(map(tuple, got[0][i].tolist()))
                                & set(map(tuple, want[0][i].tolist()))
                            )
                            for i in range(batch)
                        )
                        tm["overlap"] = same / (batch * w)
                        if batch == 1 and not constrained:
                            tm["profile"] = profile(call, dev)
                    row[name] = tm
                    print(f"  W4 {key} {name}: {tm['median_ms']:.2f} ms", flush=True)
                except Exception as exc:
                    row[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                    traceback.print_exc()
    engine.close()
    if "hf" in run.args.beam_hf:
        hf = common.hf_model(path, dev, getattr(torch, dtype_name))
        res["hf-generate"] = section_hf_generate(run, hf, dev, items, prompt_len)
        del hf
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--root", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", default="hf,eager,aoti,beam,hf-compile")
    ap.add_argument(
        "--beam-hf",
        nargs="*",
        default=["hf"],
        help="beam: also HF generate (the default); the flag with nothing after it leaves HF out",
    )
    ap.add_argument("--w1-prompts", type=int, default=256)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--variant-budget-s", type=float, default=10.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run = Run(args)
    dev = torch.device(args.device)
    dtype_name = "bfloat16" if dev.type == "cuda" else "float32"
    path = ensure_model(args.preset, dtype=dtype_name, root=args.root, progress=False)
    run.results["model"] = str(path)
    sections = args.sections.split(",")
    from boundgen.config import ModelConfig

    vocab = ModelConfig.from_dir(path).vocab_size
    work = workloads(min(vocab, 8000), args)
    items = make_items(args.items, vocab_lo=1000)
    ref: dict = {}
    res = run.results["sections"]
    if "hf" in sections:
        out = run.guard(
            "hf", lambda: section_hf(run, path, dev, getattr(torch, dtype_name), work), 30
        )
        if out:
            res["hf"], ref = out
        run.save()
    if "eager" in sections:

        def eager():
            backend = "eager+graphs" if dev.type == "cuda" else "eager"
            engine = Engine.from_pretrained(
                path, device=str(dev), dtype=dtype_name, backend=backend
            )
            out = {
                "timings": time_engine(run, backend, engine, work, ref, dev),
                "runner": engine.runner.stats(),
            }
            engine.close()
            return out

        res["eager"] = run.guard("eager", eager, 30)
        run.save()
    if "aoti" in sections and dev.type == "cuda":
        res["aoti"] = run.guard(
            "aoti", lambda: section_aoti(run, path, dev, dtype_name, work, ref), 200
        )
        run.save()
    if "beam" in sections:
        res["beam"] = run.guard(
            "beam", lambda: section_beam(run, path, dev, dtype_name, items, args.prompt_len), 60
        )
        run.save()
    if "hf-compile" in sections:
        res["hf-compile"] = run.guard(
            "hf-compile",
            lambda: section_hf_compile(run, path, dev, getattr(torch, dtype_name), work),
            60,
        )
        run.save()
    run.results["wall_s"] = time.perf_counter() - run.t0
    run.save()
    print(summary(run.results), flush=True)
    return 0


def summary(r: dict) -> str:
    """The numbers as one markdown table (what BENCHMARKS.md quotes)."""
    rows = [
        "| run | variant | median ms | tok/s | GPU busy % | kernels | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    s = r["sections"]

    def add(run_, variant, t, note=""):
        if not isinstance(t, dict) or "median_ms" not in t:
            why = t.get("error", t.get("skipped", "")) if isinstance(t, dict) else ""
            rows.append(f"| {run_} | {variant} | – | – | – | – | {why} |")
            return
        p = t.get("profile") or {}
        tok = f"{t['tok_per_s'] / 1e3:.0f}K" if "tok_per_s" in t else ""
        busy = f"{100 * p['gpu_busy_ms'] / p['wall_ms']:.0f}" if p.get("wall_ms") else ""
        kern = str(p.get("launches", "")) if p else ""
        rows.append(
            f"| {run_} | {variant} | {t['median_ms']:.2f} | {tok} | {busy} | {kern} | {note} |"
        )

    for sec in ("hf", "hf-compile"):
        for k, t in (s.get(sec) or {}).items():
            add(k.split()[0], k.split(" ", 1)[1], t)
    for k, t in ((s.get("beam") or {}).get("hf-generate") or {}).items():
        add(f"W4 {k}", "hf-generate", t)
    for sec, name in (("eager", "eager+graphs"), ("aoti", "aoti+graphs")):
        for w, t in ((s.get(sec) or {}).get("timings") or {}).items():
            add(w, name, t, f"Δ vs HF {t.get('max_abs_diff_vs_hf', float('nan')):.3f}")
    for k, row in (s.get("beam") or {}).items():
        if k in ("trie", "hf-generate"):
            continue
        for name, t in row.items():
            note = (
                f"top1 {t.get('top1_equal')} overlap {t.get('overlap', 0):.2f}"
                if isinstance(t, dict) and "overlap" in t
                else ""
            )
            add(f"W4 {k}", name, t, note)
    return "\n".join(rows)


if __name__ == "__main__":
    from boundgen.compile.preload import cli_startup

    cli_startup()  # AOTInductor packages may need the libstdc++ preload: re-exec as the CLI does
    sys.exit(main())
