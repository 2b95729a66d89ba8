"""CLI subcommands, discovered by `boundgen.cli` (one module per command)."""
