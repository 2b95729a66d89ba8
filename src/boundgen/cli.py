"""`boundgen` command line: one subcommand per module in `boundgen.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`, so
adding a command touches one file. Modules are imported lazily only to build the parser, never at
package import.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from boundgen import commands

EXTRAS = {
    "fastapi": "server",
    "uvicorn": "server",
    "httpx": "server",
    "prometheus_client": "server",
    "pydantic": "server",
    "yaml": "server",
    "ray": "ray",
    "matplotlib": "bench",
    "transformers": "bench",
}


def _missing_dependency(name: str, exc: ImportError):
    """A command whose optional dependency is not installed: listed, and says how to get it when
    run."""
    extra = EXTRAS.get((exc.name or "").split(".")[0], "dev")

    def run(_args) -> int:
        print(
            f"boundgen {name}: needs the '{exc.name}' package: pip install 'boundgen[{extra}]'",
            file=sys.stderr,
        )
        return 1

    return run


def _command_modules() -> dict[str, object]:
    found = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = info.name.replace("_", "-")
        try:
            found[name] = importlib.import_module(f"boundgen.commands.{info.name}")
        except ImportError as exc:
            found[name] = exc
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="boundgen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _command_modules().items():
        if isinstance(module, ImportError):
            p = sub.add_parser(name, help=f"(needs: pip install 'boundgen[...]': {module.name})")
            p.set_defaults(_run=_missing_dependency(name, module), _missing=True)
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.set_defaults(_parser=p)
        try:
            module.add_arguments(p)
        except ImportError as exc:  # flags built from an optional package's types
            p.set_defaults(_run=_missing_dependency(name, exc), _missing=True)
            continue
        p.set_defaults(_run=module.run)
    return parser


# commands that load AOTInductor packages: a stored load-check verdict re-execs them with the
# libstdc++ preload before anything is imported (building the parser imports torch: ~5 s)
_REEXEC_EARLY = ("serve", "compile")


def main(argv: list[str] | None = None) -> int:
    first = (sys.argv[1:] if argv is None else argv)[:1]
    if argv is None and first and first[0] in _REEXEC_EARLY:
        from boundgen.compile.preload import cli_startup

        cli_startup()
        if first[0] == "serve":
            from boundgen import startup_profile

            startup_profile.start_from_env()  # written when the server says ready
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "_missing", False):
        # the command's own usage, not the top level's: the flag is unknown to that command
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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
