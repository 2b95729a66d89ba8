"""`boundgen` command line: one subcommand per module in `boundgen.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`, so adding a
command touches one file. Modules are imported lazily only to build the parser, never at package import.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from boundgen import commands


def _command_modules() -> dict[str, object]:
    found = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        found[info.name.replace("_", "-")] = importlib.import_module(f"boundgen.commands.{info.name}")
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="boundgen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _command_modules().items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError) as exc:
        # User-facing errors: one clear line, no traceback.
        print(f"boundgen {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
