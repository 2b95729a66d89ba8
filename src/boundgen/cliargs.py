"""Build argparse flags from config dataclasses, so a flag and a config-file key are one definition.

A field becomes `--field-name`; its type, default and `metadata["help"]` drive the flag. Booleans
become
`--flag/--no-flag`. `from_args` builds the dataclass back, keeping defaults for flags not given.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if (
        typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None))
        and args
    ):
        return args[0]
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        help_ = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        elif typing.get_origin(tp) in (list, tuple):
            item = typing.get_args(tp)[0] if typing.get_args(tp) else str
            parser.add_argument(flag, type=item, nargs="+", default=None, help=help_)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, type=tp, default=None, choices=choices, help=help_)


def from_args(cls: type[T], args: argparse.Namespace, base: T | None = None, prefix: str = "") -> T:
    """`base` (e.g. loaded from a config file) overridden by the flags that were given."""
    base = base if base is not None else cls()
    changes = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, (prefix + f.name).replace("-", "_"), None)
        if value is not None:
            hint = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(_base_type(hint)) is tuple:
                value = tuple(value)
            changes[f.name] = value
    return dataclasses.replace(base, **changes)
