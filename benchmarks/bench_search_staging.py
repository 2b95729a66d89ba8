"""Issue 24: the host time before a whole-search graph's replay — its prompts into the slot's
buffers — as `SearchGraphs` stages them (`compile.staging.StagedInputs`: the layout written padded
through numpy views into one pinned buffer, one H2D copy) against the path before the
thirty-ninth session (the prompts packed into a batch, padded into the bucket by `BucketSet.pad`,
five copies from pageable memory into the slot's tensors).

    python benchmarks/bench_search_staging.py --out $OUT/search_staging.json   # CPU or CUDA, ~10 s

W4's prompts (128 tokens each) at 1 and 8 prompts a search, each in the bucket a search of that
many prompts takes. The two sides run call by call in turn; each call's host µs (until it
returns, as a search then replays its graph) and its µs until the copies have run (synchronized),
median over `--iters`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, write_json

from boundgen.compile.buckets import Bucket, BucketSet
from boundgen.compile.staging import StagedInputs
from boundgen.text.packing import Footprint, SequenceGroup, pack, pack_arrays

# prompts a search → the default bucket `SearchGraphs` pads it into (W4: 128-token prompts)
BUCKETS = {1: "t128", 8: "t1024"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def before(bucket: Bucket, group: SequenceGroup, device: torch.device):
    """The path until the thirty-eighth session: pack, pad, five copies into the slot's tensors.
    → (the call, the slot's device buffers by name)."""
    b = len(group.suffixes)
    example = bucket.example(device)
    slot = {
        "input_ids": example.input_ids.clone(),
        "positions": example.positions.clone(),
        "cu_seqlens": example.attn.cu_seqlens.clone(),
        "rows": torch.zeros(b, dtype=torch.int64, device=device),
        "lengths": torch.ones(b, dtype=torch.int64, device=device),
    }

    def call():
        _, padded = BucketSet([bucket]).pad(pack([group], share_prefix=False))
        ins = (
            padded.input_ids,
            padded.positions,
            padded.attn.cu_seqlens,
            padded.last_index,
            padded.seq_len,
        )
        for dst, src in zip(slot.values(), ins, strict=True):
            dst.copy_(src, non_blocking=True)

    return call, slot


def staged(bucket: Bucket, group: SequenceGroup, device: torch.device):
    """`SearchGraphs._replay`'s staging now: the footprint checked, the layout written padded
    into the slot's pinned buffer, one copy. → (the call, the slot's device buffers by name)."""
    inputs = StagedInputs(bucket, device, rows=len(group.suffixes), lengths=True)

    def call():
        assert bucket.fits(Footprint.of(group, share_prefix=False))
        inputs.fill(pack_arrays([group], share_prefix=False))
        inputs.copy()
        inputs.done()

    return call, inputs.views


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    result = {"env": env_info(), "device": str(device), "searches": {}}
    for b, spec in BUCKETS.items():
        bucket = Bucket.parse(spec)
        prompts = [torch.randint(100, 150_000, (args.prompt_tokens,), generator=g).tolist()]
        group = SequenceGroup([], prompts * b)
        sides = {
            "before": before(bucket, group, device)[0],
            "staged": staged(bucket, group, device)[0],
        }
        host = {name: [] for name in sides}
        done = {name: [] for name in sides}
        for i in range(args.iters + 50):
            for name, call in sides.items():
                _sync(device)
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                _sync(device)
                t2 = time.perf_counter()
                if i >= 50:  # warm-up
                    host[name].append((t1 - t0) * 1e6)
                    done[name].append((t2 - t0) * 1e6)
        row = {
            name: {
                "host_us": round(statistics.median(host[name]), 1),
                "until_copied_us": round(statistics.median(done[name]), 1),
            }
            for name in sides
        }
        result["searches"][f"{b} prompts ({spec})"] = row
        print(f"{b} prompts, {spec}: {row}", flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
