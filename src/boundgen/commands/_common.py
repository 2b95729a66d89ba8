"""Shared pieces of the CLI commands: engine flags (from `EngineConfig`) and loading."""

from __future__ import annotations

import argparse

from boundgen.config import EngineConfig
from boundgen.settings import add_flags, from_args


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    parser.add_argument("--model", required=model_required, help="HF model directory")
    add_flags(parser.add_argument_group("engine"), EngineConfig)


def load_engine(args: argparse.Namespace):
    from boundgen import Engine

    return Engine.from_pretrained(args.model, config=from_args(EngineConfig, args))


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
