"""Shared pieces of the CLI commands: engine flags (from `EngineConfig`) and loading."""

from __future__ import annotations

import argparse

from boundgen.config import EngineConfig
from boundgen.settings import add_flags, from_args

# `--model`'s default where a command runs on the built-in model, as `boundgen serve` does
DEMO_MODEL = "the built-in demo model"


def add_engine_args(
    parser: argparse.ArgumentParser, model_required: bool = True, model_default: str | None = None
) -> None:
    """`--model` (required, unless the command says what it uses without one) and every engine
    flag."""
    help_ = "HF model directory" + (f" (default: {model_default})" if model_default else "")
    parser.add_argument("--model", required=model_required and not model_default, help=help_)
    add_flags(parser.add_argument_group("engine"), EngineConfig)


def load_engine(args: argparse.Namespace):
    """The engine over `--model`, or over the built-in demo model when none is given."""
    from boundgen import Engine
    from boundgen.demo import default_model_path

    model = args.model or default_model_path()
    return Engine.from_pretrained(model, config=from_args(EngineConfig, args))


def parse_labels(engine, labels: list[str]) -> list[int]:
    """Label tokens given as ids ("9454") or as text that must be exactly one token (" yes")."""
    ids = []
    for label in labels:
        if label.lstrip("-").isdigit():
            ids.append(int(label))
            continue
        tokens = engine.tokenizer.encode(label)
        if len(tokens) != 1:
            raise ValueError(
                f"label {label!r} is {len(tokens)} tokens {tokens}; give a single-token text or an "
                "id"
            )
        ids.append(tokens[0])
    return ids
