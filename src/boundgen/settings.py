"""Settings as frozen dataclasses: one definition per knob, read from flags and from config files.

`option(default, help)` declares a field. `add_flags` turns a dataclass's fields into
`--field-name` flags (booleans become `--flag/--no-flag`; a field with `flag=False` lives in
config files only) and `from_args` builds the dataclass back, keeping defaults for flags not
given. `from_dict` builds one from a config-file section and `read_file` reads a YAML
(.yaml/.yml) or TOML (.toml) file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, *, flag: bool = True, **meta: Any) -> Any:
    """A settings field: its help text, whether it is a command-line flag, and e.g. `choices`."""
    info = {"help": help, "flag": flag, **meta}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=info)
    return dataclasses.field(default=default, metadata=info)


def env_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """A process-wide switch read from the environment variable `name` (an A/B of how we
    compile): `value` when it is one of `choices`, else an error naming the variable."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


@contextlib.contextmanager
def switched(namespace: dict[str, Any], name: str, value: Any):
    """Inside: the process-wide switch `name` of a module (its `globals()`) set to `value`,
    restored after — an A/B's sides in one process, a test's reference path (the kernels read
    their switches as a layer traces, compiles or is captured)."""
    before = namespace[name]
    namespace[name] = value
    try:
        yield
    finally:
        namespace[name] = before


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and args:
        return args[0]
    return tp


def add_flags(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """`--field-name` for every field of `cls` whose `flag` is not False."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("flag") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        help_ = _with_default(f.metadata.get("help", ""), _default(f))
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


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _with_default(help_: str, default: Any) -> str:
    """The help with the field's default, so `--help` shows what a flag not given means (the flags
    themselves default to None: only the flags given override a config file). Help that already
    names its default, and fields without one, are left as they are."""
    if default is None or default in ("", (), []) or "default:" in help_:
        return help_
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, (tuple, list)):
        shown = " ".join(map(str, default))
    else:
        shown = str(default)
    return f"{help_} (default: {shown.replace('%', '%%')})"


def from_args(cls: type[T], args: argparse.Namespace, base: T | None = None) -> T:
    """`base` (e.g. loaded from a config file) overridden by the flags that were given."""
    base = base if base is not None else cls()
    hints = typing.get_type_hints(cls)
    changes = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            if typing.get_origin(_base_type(hints[f.name])) is tuple:
                value = tuple(value)
            changes[f.name] = value
    return dataclasses.replace(base, **changes)


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """`cls(**data)` with `-` in keys read as `_`, lists as tuples where the field is a tuple, and
    unknown keys refused by name."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
    values = {}
    for key, value in data.items():
        if key == "tries" and isinstance(value, dict):  # `tries: {name: path}` is also accepted
            value = tuple(f"{k}={v}" for k, v in value.items())
        elif isinstance(known[key].default, tuple) and isinstance(value, list):
            value = tuple(value)
        values[key] = value
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"{source}: {exc}") from None


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML (.yaml/.yml) or TOML (.toml) file."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        raise ValueError(f"config file must end in .yaml, .yml or .toml: {path}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def load_sections(data: dict[str, Any], sections: dict[str, type], source: str) -> dict[str, Any]:
    """Build one dataclass per section: `{name: cls}` read from `name:` sections of `data`, where
    keys at the top level belong to the first class that has a field of that name."""
    data = dict(data)
    parts: dict[str, dict[str, Any]] = {name: dict(data.pop(name, None) or {}) for name in sections}
    for key, value in data.items():
        field = str(key).replace("-", "_")
        owner = next(
            (
                n
                for n, cls in sections.items()
                if field in {f.name for f in dataclasses.fields(cls)}
            ),
            next(iter(sections)),
        )
        parts[owner][key] = value
    return {
        name: from_dict(cls, parts[name], f"{source} ({name})") for name, cls in sections.items()
    }
