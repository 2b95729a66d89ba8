"""Where compiled artifacts live, without importing torch (a CLI reads it before its imports)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$BOUNDGEN_CACHE/compiled` (default `~/.cache/boundgen/compiled`)."""
    base = os.environ.get("BOUNDGEN_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "boundgen") / "compiled"
