"""Host-side cost of preparing one forward (CPU only): `pack` and bucket padding before and after
vectorization, the bucket chunker; the padding W1/W2/W3 (DESIGN §9) get from the old cut (token
budget, then the largest bucket) and from `compile.chunking`; buckets planned for varied W2 traffic.

    python benchmarks/bench_host.py [--before ae374ee] [--ids-before 3554611]
                                    [--lead-before 93e3eff] [--repeats 50] [--json $OUT/host.json]

`--before REV`: the git revision whose `text/packing.py` and `compile/buckets.py` are the baseline
(ae374ee: the last one before vectorization). `--ids-before REV`: the revision whose
`workloads/inputs.to_ids` (checking a request's token ids) is the baseline (3554611: the last one
with a generator of isinstance calls). `--lead-before REV`: the revision whose staged fill (pack,
pad, then `StagedInputs.fill`) and `many_ids` are the baseline (93e3eff: before they were
written straight into the buffer and ranged in numpy). Times are the best of `--repeats` short
rounds (the least disturbed by other processes on the machine), in µs per forward.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen.compile.buckets import BucketSet, default_buckets, parse_buckets
from boundgen.compile.chunking import chunk
from boundgen.compile.planner import plan, predict, profile_entries, traffic_entries
from boundgen.compile.staging import StagedInputs
from boundgen.text.packing import SequenceGroup, pack, pack_arrays

BUDGET = 32768  # EngineConfig.max_batch_tokens
W2_BUCKET = "t2048-s128-m512-g2-p320-q1728"  # the W2 bucket of the H200 runs (bench_backends.py)
H200_BUCKETS = ["t64-s4-m64", W2_BUCKET, "t1024-s32-m512", "t8192-s256-m512"]


def workloads() -> dict[str, list[SequenceGroup]]:
    vocab = 151936
    query, items = common.w2_request(vocab)
    return {
        "W1": [SequenceGroup([], common.w1_prompts(vocab))],
        "W2": [SequenceGroup(query, items)],
        "W3": [SequenceGroup([], common.w1_prompts(vocab, n=1, lo=64, hi=64, seed=3))],
    }


def varied_w2(seed: int, forwards: int) -> list:
    """Logged-shape entries of W2-like forwards that vary around the nominal shape."""
    rng = random.Random(seed)
    lines = []
    for _ in range(forwards):
        groups = [
            [rng.randint(200, 300), [rng.randint(12, 20) for _ in range(rng.randint(80, 120))]]
            for _ in range(rng.randint(1, 4))
        ]
        lines.append(json.dumps({"groups": groups, "kind": "score"}))
    return traffic_entries(lines)


def old_module(rev: str, name: str) -> types.ModuleType:
    """`boundgen.<name>` as of git revision `rev` (a module built from that file's text)."""
    root = Path(__file__).resolve().parent.parent
    path = f"src/boundgen/{name.replace('.', '/')}.py"
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(f"{name}_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def best_us(fn, repeats: int, round_s: float = 0.005) -> float:
    """Best over `repeats` rounds of the mean time of one call; short rounds (about `round_s`,
    under a scheduler time slice) so that some run undisturbed on a busy machine."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(3, int(round_s / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def old_cut(groups: list[SequenceGroup], buckets: BucketSet) -> list[list[SequenceGroup]]:
    """The cut of `BucketedRunner.pack_chunk` at ae374ee: token-budget chunks, each cut at the
    largest bucket's size when every piece then fits a bucket."""
    out = []
    for budget_chunk in chunk(groups, BUDGET):  # = ModelRunner.split
        parts = [budget_chunk.groups]
        if budget_chunk.footprint.tokens > buckets.largest:
            cut = [p.groups for p in chunk(budget_chunk.groups, buckets.largest)]
            if all(buckets.choose(pack(p)) is not None for p in cut):
                parts = cut
        out += parts
    return out


def padding(pieces: list[list[SequenceGroup]], buckets: list) -> dict:
    measured = BucketSet(buckets)
    for groups in pieces:
        measured.pad(pack(groups))
    return {"forwards": len(pieces), **measured.stats.as_dict()}


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in cols]]
    for r in rows:
        cells.append([f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k, _ in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def host_times(work, rev: str, buckets: BucketSet, repeats: int) -> list[dict]:
    """Before: `rev`'s pack and pad over the old cut's pieces; after: chunk, pack and pad."""
    old_pack = old_module(rev, "text.packing").pack
    old_buckets = old_module(rev, "compile.buckets")
    old_set = old_buckets.BucketSet([old_buckets.Bucket.parse(b.name) for b in buckets])
    rows = []
    for name, groups in work.items():
        packed = [pack(p.groups) for p in chunk(groups, BUDGET, buckets)]
        old_pieces = old_cut(groups, buckets)
        row = {
            "workload": name,
            "tokens": sum(g.num_tokens for g in groups),
            "pack before": best_us(lambda g=groups: old_pack(g), repeats),
            "pack after": best_us(lambda g=groups: pack(g), repeats),
            "chunk": best_us(lambda g=groups: chunk(g, BUDGET, buckets), repeats),
            "pad before": best_us(lambda p=packed: [old_set.pad(b) for b in p], repeats),
            "pad after": best_us(lambda p=packed: [buckets.pad(b) for b in p], repeats),
            "all before": best_us(
                lambda: [old_set.pad(old_pack(g)) for g in old_pieces],
                repeats,
            ),
            "all after": best_us(
                lambda g=groups: [buckets.pad(pack(p.groups)) for p in chunk(g, BUDGET, buckets)],
                repeats,
            ),
        }
        rows.append(row)
    return rows


def paddings(work, cuts) -> list[dict]:
    rows = []
    for name, groups in work.items():
        for label, cut, buckets in cuts:
            row = {"workload": name, "cut": label, **padding(cut(groups), list(buckets))}
            rows.append({**row, "padding %": 100 * row["padding_fraction"]})
    return rows


def varied_w2_plans() -> list[dict]:
    """Buckets planned for the nominal W2 shape vs from the varied traffic itself."""
    varied = varied_w2(seed=0, forwards=300)
    nominal = [{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, "count": 4}]
    nominal_buckets = plan(profile_entries(nominal), BUDGET).buckets
    plans = [("the nominal W2 profile", predict(varied, nominal_buckets, BUDGET))]
    for limit in (4, 8, 16):
        plans.append((f"the traffic, ≤ {limit} cascade", plan(varied, BUDGET, 8192, limit)))
    rows = []
    for label, p in plans:
        row = {"planned from": label, "buckets": len(p.buckets), **p.overall.as_dict()}
        rows.append({**row, "padding %": 100 * row["padding_fraction"]})
    return rows


def id_check_times(rev: str, repeats: int) -> list[dict]:
    """µs to check a W2 request's token ids (the query and 100 items, as `prepare_score` does) and
    one 1,856-id list, with `to_ids` as of `rev` and now."""
    from boundgen.workloads.inputs import Limits, to_ids

    old = old_module(rev, "workloads.inputs").to_ids
    query, items = common.w2_request(151936)
    limits = Limits(vocab_size=151936, max_seq_len=32768, max_items=1024)
    flat = [t for ids in [query, *items] for t in ids]
    rows = []
    for what, lists in (("W2 request (query + 100 items)", [query, *items]), ("one list", [flat])):
        row = {"ids": what, "tokens": sum(map(len, lists))}
        for name, fn in (("before", old), ("after", to_ids)):
            row[name] = round(
                best_us(lambda fn=fn: [fn(x, None, limits, "x") for x in lists], repeats), 1
            )
        rows.append(row)
    return rows


# the bucket each workload's pieces are staged into (W1: the chunker's largest H200 bucket)
STAGED = {"W1": "t8192-s256-m512", "W2": "t1920-s104-m512-g2-p320-q1600", "W3": "t64-s4-m64"}


def staged_times(work, rev: str, repeats: int) -> list[dict]:
    """µs from a forward's groups to its staged buckets' host buffers (issue 25: the host lead
    before a small request's replay): chunk, `pack`, `BucketSet.pad` and `StagedInputs.fill` of
    the padded tensors as of `rev`, against chunk, `pack_arrays` and `fill` (`write_padded`)
    now."""
    old_staging = old_module(rev, "compile.staging")
    rows = []
    for name, groups in work.items():
        buckets = BucketSet(parse_buckets([STAGED[name]]))
        old = {b: old_staging.StagedInputs(b, "cpu") for b in buckets}
        new = {b: StagedInputs(b, "cpu") for b in buckets}

        def before(g=groups, buckets=buckets, old=old):
            for piece in chunk(g, BUDGET, buckets):
                old[piece.bucket].fill(buckets.pad(pack(piece.groups))[1])

        def after(g=groups, buckets=buckets, new=new):
            for piece in chunk(g, BUDGET, buckets):
                new[piece.bucket].fill(pack_arrays(piece.groups))

        pieces = chunk(groups, BUDGET, buckets)
        assert all(p.bucket is not None for p in pieces), name
        row = {"workload": name, "bucket": STAGED[name], "pieces": len(pieces)}
        row.update(before=best_us(before, repeats), after=best_us(after, repeats))
        rows.append(row)
    return rows


def many_ids_times(rev: str, repeats: int) -> dict:
    """µs for `many_ids` (the one-pass check of a request's token-id items) over W2's 100 items,
    as of `rev` and now."""
    from boundgen.workloads.inputs import Limits, many_ids

    old = old_module(rev, "workloads.inputs").many_ids
    _, items = common.w2_request(151936)
    limits = Limits(vocab_size=151936, max_seq_len=32768, max_items=1024)
    return {
        name: best_us(lambda fn=fn: fn(items, None, limits, "items"), repeats)
        for name, fn in (("before", old), ("after", many_ids))
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="ae374ee", help="git revision of the baseline `pack`")
    ap.add_argument("--ids-before", default="3554611", help="git revision of the baseline `to_ids`")
    ap.add_argument(
        "--lead-before", default="93e3eff", help="revision of the old staged fill and many_ids"
    )
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    work = workloads()
    ladder = BucketSet([*default_buckets(8192), *parse_buckets(W2_BUCKET)])
    timings = host_times(work, args.before, ladder, args.repeats)
    print(f"host time per forward, µs (best of {args.repeats}; before = {args.before}: old cut,")
    print("pack and pad; after: chunk, pack, pad; pad = every piece of the forward)")
    print(table(timings, [(c, c) for c in timings[0]]))

    w1_lens = [len(s) for s in work["W1"][0].suffixes]
    profile = [
        {"kind": "classify", "texts": w1_lens},
        {"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16},
        {"kind": "embed", "texts": [64]},
    ]
    planned = plan(profile_entries(profile), BUDGET).buckets
    h200 = parse_buckets(H200_BUCKETS)
    cuts = [
        ("old cut, H200 buckets", lambda g: old_cut(g, BucketSet(h200)), h200),
        ("chunking, H200 buckets", lambda g: [p.groups for p in chunk(g, BUDGET, h200)], h200),
        ("chunking, ladder + W2", lambda g: [p.groups for p in chunk(g, BUDGET, ladder)], ladder),
        ("chunking, planned", lambda g: [p.groups for p in chunk(g, BUDGET, planned)], planned),
    ]
    pads = paddings(work, cuts)
    print("\npadding per workload (one request each)")
    cols = ["workload", "cut", "forwards", "real_tokens", "padded_tokens", "padding %", "misses"]
    print(table(pads, [(c, c.replace("_tokens", "")) for c in cols]))

    varied = varied_w2_plans()
    print("\nvaried W2-like traffic: 300 forwards of 1-4 requests, prefix 200-300 tokens,")
    print("80-120 items of 12-20 tokens")
    cols = ["planned from", "buckets", "padding %", "misses"]
    print(table(varied, [(c, c) for c in cols]))
    print(f"\nladder: {', '.join(b.name for b in ladder)}")
    print(f"planned: {', '.join(b.name for b in planned)}")
    ids = id_check_times(args.ids_before, args.repeats)
    print(f"\nchecking token ids, µs (best of {args.repeats}; before = {args.ids_before})")
    print(table(ids, [(c, c) for c in ids[0]]))
    staged = staged_times(work, args.lead_before, args.repeats)
    print(
        f"\ngroups → a staged bucket's host buffer, µs (best of {args.repeats}; before = "
        f"{args.lead_before}: pack, pad, fill)"
    )
    print(table(staged, [(c, c) for c in staged[0]]))
    many = many_ids_times(args.lead_before, args.repeats)
    print(
        f"W2's 100 items through `many_ids`, µs: before {many['before']:.1f}, "
        f"after {many['after']:.1f}"
    )
    if args.json:
        results = {"host_us": timings, "padding": pads, "varied_w2": varied, "ids_us": ids}
        results.update(staged_us=staged, many_ids_us=many)
        Path(args.json).write_text(json.dumps({"env": common.env_info(), **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
