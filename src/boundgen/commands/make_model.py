"""`boundgen make-model`: write a synthetic HuggingFace checkpoint (real shapes, random weights)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HELP = "write a synthetic HF checkpoint (tiny, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b)"

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """`1000000`, `500MB`, `2GB`, `64MiB` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or e.g. 500MB, 2GB, 64MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from boundgen.checkpoints import ARCHS, DTYPES, PRESETS

    parser.add_argument("--preset", required=True, choices=list(PRESETS), help="model shape")
    parser.add_argument(
        "--arch",
        choices=list(ARCHS),
        default=None,
        help="model family (default: the preset's own; tiny: qwen2)",
    )
    parser.add_argument(
        "--seq-cls",
        type=int,
        default=None,
        metavar="N",
        help="write *ForSequenceClassification with N labels, not a causal LM",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: a directory under $BOUNDGEN_CACHE or "
        "~/.cache/boundgen named after the arguments)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weight dtype (default: float32 for tiny, bfloat16 otherwise)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="BYTES",
        help="split weights into shards of at most this size (e.g. 500MB)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model files in a non-empty output directory",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )


def run(args: argparse.Namespace) -> int:
    from boundgen.checkpoints import default_model_dir, make_model, model_name, param_count

    out = args.out
    if out is None:
        out = default_model_dir() / model_name(
            args.preset, args.arch, args.seq_cls, args.seed, args.dtype
        )
    try:
        path = make_model(
            args.preset,
            out,
            arch=args.arch,
            seq_cls=args.seq_cls,
            seed=args.seed,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            progress=args.progress,
            overwrite=args.overwrite,
        )
    except FileExistsError as exc:
        print(f"boundgen make-model: error: {exc}", file=sys.stderr)
        return 1
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("model*.safetensors"))
    size = sum(p.stat().st_size for p in weights)
    print(path)
    print(
        f"{config['architectures'][0]}: {param_count(config):,} params, "
        f"{config['dtype']}, {size / 2**20:.1f} MiB in {len(weights)} file(s), "
        f"vocab {config['vocab_size']}, seed {args.seed}"
    )
    return 0
