"""Issue 25 item 4: what W5's merged forwards cost on the GPU. Over HTTP on the H200 (2026-12-02)
W5 saturated at ~178 req/s with the forward node's GPU 99-100 % busy: 7.5-7.9 W2 requests a
forward, the `t16384` cascade bucket, ~44 ms a forward, ~370K padded tokens/s, where W1's `t8192`
chunks run at ~566K padded tokens/s in process. This times the same forwards without the server:
W2 requests (a 256-token prefix + 100 × 16-token items, token ids) merged 1, 2, 4 and 8 at a time
into one `runner.rows` call, as the score workload's forward node makes them; per merge count the
bucket, ms a forward, padded and real tokens/s, and the per-kernel table (GPU busy, launches).

    python benchmarks/profile_w5.py --out $OUT/w5_profile.json   # H200, with the W5 buckets cached
    python benchmarks/profile_w5.py --preset tiny --device cpu --merge 1 2 --iters 2   # smoke test

`--backend` is the engine's (default auto: `aoti+graphs` where `boundgen compile` cached the
buckets, as `run_h200.sh w5-compile` does, else `eager+graphs`); `--attention` likewise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine
from boundgen.checkpoints import ensure_model
from boundgen.text.packing import SequenceGroup

W5_BUCKETS = ",".join(common.w5_buckets())


def w2_groups(vocab: int, n: int, prefix: int, items: int, item_len: int) -> list[SequenceGroup]:
    """`n` W2 requests as the score workload groups them: a distinct prefix each, its items."""
    return [
        SequenceGroup(*common.w2_request(vocab, prefix, items, item_len, seed=100 + i))
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint dir (default: make the preset under --root)")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--root", default="/tmp/boundgen-models")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--buckets", default=W5_BUCKETS, help="compile buckets (compiled backends)")
    ap.add_argument("--merge", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--item-tokens", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    path = args.model or ensure_model(args.preset, dtype=dtype, root=args.root)
    engine = Engine.from_pretrained(
        path,
        device=args.device,
        dtype=dtype,
        backend=args.backend,
        attention=args.attention,
        compile_buckets=args.buckets,
    )
    runner = engine.runner
    print(f"backend {runner.stats().get('backend')}, attention {engine.model.backend.name}")
    vocab = engine.model.config.vocab_size
    rows = []
    for n in args.merge:
        groups = w2_groups(vocab, n, args.prefix, args.items, args.item_tokens)
        real = sum(g.num_tokens for g in groups)
        before = dict(runner.stats().get("batches", {}))
        runner.rows(groups)  # one call: the buckets it runs in (a bucket per piece)
        after = runner.stats().get("batches", {})
        used = {b: c - before.get(b, 0) for b, c in after.items() if c > before.get(b, 0)}
        padded = sum(int(b.split("-")[0][1:]) * n for b, n in used.items()) or real
        t = common.timed(lambda g=groups: runner.rows(g), args.device, iters=args.iters)
        prof = common.kernel_table(lambda g=groups: runner.rows(g), top=20)
        row = {
            "requests": n,
            "real_tokens": real,
            "buckets": used,
            "padded_tokens": padded,
            "forward_ms": t["median_ms"],
            "p90_ms": t["p90_ms"],
            "real_tok_s": real / t["median_ms"] * 1e3,
            "padded_tok_s": padded / t["median_ms"] * 1e3,
            **prof,
        }
        rows.append(row)
        print(
            f"{n} requests: {real} tokens in {', '.join(used) or 'eager (no buckets)'}: "
            f"{t['median_ms']:.2f} ms, {row['real_tok_s'] / 1e3:.0f}K real tok/s, "
            f"{row['padded_tok_s'] / 1e3:.0f}K padded; GPU busy {prof['gpu_busy_ms']:.2f} of "
            f"{prof['wall_ms']:.2f} ms, {prof['launches']} launches; GPU idle before "
            f"{prof.get('lead_ms', 0):.2f}, between {prof.get('idle_between_ms', 0):.2f}, after "
            f"{prof.get('tail_ms', 0):.2f} ms",
            flush=True,
        )
    big = rows[-1]
    print(f"kernels of the {big['requests']}-request forward:")
    for k in big["kernels"]:
        us = k["ms"] * 1e3 / max(k["calls"], 1)
        print(f"  {k['ms']:8.3f} ms {k['calls']:5d} × {us:8.1f} µs  {k['kernel'][:90]}")
    common.write_json(args.out, {"env": common.env_info(), "args": vars(args), "rows": rows})
    engine.close()


if __name__ == "__main__":
    from boundgen.compile.preload import cli_startup

    cli_startup()  # AOTInductor packages may need the libstdc++ preload: re-exec as the CLI does
    main()
