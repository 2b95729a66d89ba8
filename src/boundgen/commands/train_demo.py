"""boundgen train-demo: rebuild the built-in demo model (catalog, tokenizer, tiny Qwen2), CPU."""

from __future__ import annotations

from pathlib import Path

from boundgen.demo.train import TrainConfig, train
from boundgen.settings import add_flags, from_args

HELP = (
    "train the built-in demo model on the synthetic catalog (CPU, minutes); writes an HF checkpoint"
)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="boundgen-demo-model", help="output checkpoint directory")
    add_flags(parser.add_argument_group("training (defaults: the shipped model)"), TrainConfig)


def run(args) -> int:
    train(from_args(TrainConfig, args), Path(args.out))
    return 0
