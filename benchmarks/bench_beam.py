"""W4 (DESIGN §9): bounded beam search, prompt 128, W=16, S=4, batch 1 and 8, with and without a
trie of 100K item IDs, against HF `generate` in the same run.

The trie: 3 levels × 256 semantic codes plus a 4th disambiguation code (TIGER-style), so item IDs
are 4 tokens long and match S=4. HF's constrained baseline uses `prefix_allowed_tokens_fn` over
the same items (a Python dict trie), the way a user of HF would constrain it.

    python benchmarks/bench_beam.py --preset qwen2.5-0.5b --device cuda --out $OUT/beam.json
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

from boundgen import Engine, Trie
from boundgen.checkpoints import ensure_model


def make_items(num_items: int, vocab_lo: int, seed: int = 0) -> torch.Tensor:
    """[items, 4] unique token ids: 3 semantic codes (distinct 3-code prefixes) + a
    disambiguation code; each level uses its own 256-token range starting at `vocab_lo`."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(256**3, generator=g)[:num_items]
    codes = torch.stack([flat // 65536, (flat // 256) % 256, flat % 256], 1)
    fourth = torch.randint(0, 256, (num_items, 1), generator=g)
    return torch.cat([codes, fourth], 1) + torch.tensor([0, 256, 512, 768]) + vocab_lo


def hf_prefix_fn(items: torch.Tensor, prompt_len: int):
    children: dict[tuple, list[int]] = {}
    for row in items.tolist():
        for d in range(len(row)):
            children.setdefault(tuple(row[:d]), set()).add(row[d])
    children = {k: sorted(v) for k, v in children.items()}

    def allowed(batch_id, ids):
        return children.get(tuple(ids[prompt_len:].tolist()), [])

    return allowed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--root", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--hf", nargs="*", default=["eager"])
    ap.add_argument("--backends", nargs="+", default=["eager"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype_name = "bfloat16" if dev.type == "cuda" else "float32"
    path = (
        Path(args.model)
        if args.model
        else ensure_model(args.preset, dtype=dtype_name, root=args.root)
    )
    engines = {}
    for backend in args.backends:
        kwargs = {} if backend == "eager" else {"backend": backend}
        try:
            engines[backend] = Engine.from_pretrained(
                path, device=args.device, dtype=dtype_name, **kwargs
            )
        except Exception:
            traceback.print_exc()
    engine = next(iter(engines.values()))
    vocab = min(engine.tokenizer.vocab_size, engine.config.vocab_size)
    t0 = time.perf_counter()
    items = make_items(args.items, vocab_lo=1000)
    trie = Trie.from_sequences(items.numpy()).to(dev)
    build_s = time.perf_counter() - t0
    hf = {
        m: common.hf_model(
            path, dev, getattr(torch, dtype_name), None if m == "eager" else "default"
        )
        for m in args.hf
    }
    results = {
        "env": common.env_info(),
        "model": str(path),
        "trie": {
            "items": trie.num_items,
            "depth": trie.depth,
            "build_s": build_s,
            "nbytes": trie.nbytes,
        },
        "runs": {},
    }
    rows = []
    g = torch.Generator().manual_seed(7)
    for batch in args.batches:
        prompts = [
            torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(batch)
        ]
        for constrained in (False, True):
            name = f"W4 b{batch} {'trie' if constrained else 'free'}"
            entry = results["runs"].setdefault(name, {})
            ref = None
            for mode, model in hf.items():
                ids = torch.tensor(prompts, device=dev)
                kw = dict(
                    num_beams=args.width,
                    num_return_sequences=args.width,
                    max_new_tokens=args.steps,
                    min_new_tokens=args.steps,
                    do_sample=False,
                    length_penalty=0.0,
                    early_stopping=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                if constrained:
                    kw["prefix_allowed_tokens_fn"] = hf_prefix_fn(items, args.prompt_len)
                try:
                    call = lambda: model.generate(ids, **kw)
                    out = call()
                    ref = out.sequences[:, args.prompt_len :].view(batch, args.width, -1).tolist()
                    t = common.timed(call, dev, warmup=1, iters=args.iters, budget_s=args.budget_s)
                    entry[f"hf-{mode}"] = t
                    rows.append({"run": name, "variant": f"hf-{mode}", **t})
                except Exception as exc:
                    entry[f"hf-{mode}"] = {"error": repr(exc)}
                    traceback.print_exc()
            for backend, eng in engines.items():
                try:
                    call = lambda: eng.beam_search_batch(
                        prompts,
                        args.width,
                        args.steps,
                        trie=trie if constrained else None,
                    )
                    ours = call()
                    t = common.timed(call, dev, warmup=2, iters=args.iters, budget_s=args.budget_s)
                    if ref is not None:
                        same_top1 = sum(o[0][0] == r[0] for o, r in zip(ours, ref)) / batch
                        overlap = (
                            sum(
                                len({tuple(x[0]) for x in o} & {tuple(x) for x in r}) / args.width
                                for o, r in zip(ours, ref)
                            )
                            / batch
                        )
                        t.update(top1_agreement_vs_hf=same_top1, set_overlap_vs_hf=overlap)
                    if constrained:
                        t["invalid_ids"] = sum(not trie.contains(x[0]) for o in ours for x in o)
                    base = entry.get("hf-eager", {}).get("median_ms")
                    if base:
                        t["speedup_vs_hf_eager"] = base / t["median_ms"]
                    entry[f"boundgen-{backend}"] = t
                    rows.append({"run": name, "variant": f"boundgen-{backend}", **t})
                except Exception as exc:
                    entry[f"boundgen-{backend}"] = {"error": repr(exc)}
                    traceback.print_exc()
    print(
        f"trie: {trie.num_items} items, depth {trie.depth}, built in {build_s:.2f}s, "
        f"{trie.nbytes / 1e6:.1f} MB"
    )
    common.print_table(
        rows,
        [
            "run",
            "variant",
            "median_ms",
            "p90_ms",
            "speedup_vs_hf_eager",
            "top1_agreement_vs_hf",
            "set_overlap_vs_hf",
            "invalid_ids",
        ],
    )
    common.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
