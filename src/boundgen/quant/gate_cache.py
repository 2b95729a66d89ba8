"""A small JSON store of fidelity-gate results, keyed by checkpoint content hash + FP8 policy.

Location: `$BOUNDGEN_FP8_GATE_CACHE` (a file path), else `$XDG_CACHE_HOME/boundgen/fp8_gate.json`,
else `~/.cache/boundgen/fp8_gate.json`. Checkpoint hashes are memoized by (path, size, mtime) so a
1 GB checkpoint is read once, not on every engine start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

# Files that define a checkpoint's numerics (tokenizer files do not change the model's outputs).
_HASHED_SUFFIXES = (".safetensors", ".bin", ".pt")
_HASHED_NAMES = ("config.json",)


def cache_path() -> Path:
    explicit = os.environ.get("BOUNDGEN_FP8_GATE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "boundgen" / "fp8_gate.json"


def _load() -> dict:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"results": {}, "hashes": {}}
    data.setdefault("results", {})
    data.setdefault("hashes", {})
    return data


def _save(data: dict) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fp8_gate.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = [
        p
        for p in sorted(model_dir.iterdir())
        if p.is_file() and (p.name in _HASHED_NAMES or p.suffix in _HASHED_SUFFIXES)
    ]
    if not any(p.suffix in _HASHED_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files (*.safetensors) in {model_dir}")
    return files


def checkpoint_hash(model_dir: str | Path) -> str:
    """sha256 over config.json and the weight files (names + bytes), memoized by size/mtime."""
    model_dir = Path(model_dir).resolve()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    files = _checkpoint_files(model_dir)
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    data = _load()
    memo = data["hashes"].get(str(model_dir))
    if memo and memo.get("stamp") == stamp:
        return memo["sha256"]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    digest = h.hexdigest()
    data = _load()
    data["hashes"][str(model_dir)] = {"stamp": stamp, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash
        _save(data)
    return digest


def _key(digest: str, policy: str) -> str:
    return f"{digest}:{policy}"


def record_gate_result(model_dir: str | Path, policy: str, report: dict) -> dict:
    """Store a gate report (a `GateReport.to_dict()`) for this checkpoint + policy; returns the
    record."""
    digest = checkpoint_hash(model_dir)
    record = dict(report)
    record.update(
        policy=policy,
        checkpoint_sha256=digest,
        model_dir=str(Path(model_dir).resolve()),
        checked_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    data = _load()
    data["results"][_key(digest, policy)] = record
    _save(data)
    return record


def lookup_gate_result(
    model_dir: str | Path, policy: str, digest: str | None = None
) -> dict | None:
    digest = digest or checkpoint_hash(model_dir)
    return _load()["results"].get(_key(digest, policy))
