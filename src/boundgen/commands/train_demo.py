"""boundgen train-demo: rebuild the built-in demo model (catalog, tokenizer, tiny Qwen2), CPU."""

from __future__ import annotations

from pathlib import Path

from boundgen.cliargs import add_dataclass_args, from_args
from boundgen.demo.train import TrainConfig, train

HELP = (
    "train the built-in demo model on the synthetic catalog (CPU, minutes); writes an HF checkpoint"
)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="boundgen-demo-model", help="output checkpoint directory")
    add_dataclass_args(
        parser.add_argument_group("training (defaults: the shipped model)"), TrainConfig
    )


def run(args) -> int:
    train(from_args(TrainConfig, args), Path(args.out))
    return 0
