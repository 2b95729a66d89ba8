"""`torch.compile` results kept beside the AOTInductor artifacts, so they travel with them.

The beam search's layers are compiled by `torch.compile` where they run (`compile/decode.py`):
~14 s on the H200 the first time (BENCHMARKS.md, 2026-12-02), paid in the warm-up before a server
is ready. Inductor's own caches (under /tmp) make a later start on the same machine faster, but a
new machine — a fresh GPU node, a copied cache — compiles again. PyTorch's portable cache
(`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`: the FX-graph, AOTAutograd,
autotuning and Triton kernel caches as one blob) is written here after a warm-up that compiled,
and loaded before the next warm-up:

    <root>/torch-compile-<platform>.bin     one blob per torch / CUDA / GPU (/ `BOUNDGEN_PDL`)

`load(root)` and `save(root)` never raise: a cache that cannot be read or written only costs the
compile it would have saved (logged).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from boundgen import grid_dependency

log = logging.getLogger("boundgen.compile")


def _platform() -> str:
    parts = [torch.__version__, str(torch.version.cuda)]
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(), str(torch.cuda.get_device_capability())]
    # the searches' layers whose kernels wait for the ones before (`BOUNDGEN_PDL=1`): a
    # constexpr, not an op of the graph, so kept apart from the blob of kernels that do not
    if grid_dependency.in_searches():
        parts.append("pdl")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def path_for(root: str | Path) -> Path:
    return Path(root) / f"torch-compile-{_platform()}.bin"


def load(root: str | Path) -> int:
    """Bytes of compiled results loaded from `root` into this process's caches (0: none)."""
    path = path_for(root)
    if not path.is_file() or not hasattr(torch.compiler, "load_cache_artifacts"):
        return 0
    try:
        blob = path.read_bytes()
        torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # a stale or damaged blob: compile instead
        log.warning("torch.compile cache %s not loaded (%s): compiling instead", path, exc)
        return 0
    log.info("torch.compile cache: %d bytes loaded from %s", len(blob), path)
    return len(blob)


def save(root: str | Path) -> int:
    """Bytes of this process's compiled results written to `root` (0: nothing to write)."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return 0
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return 0
        blob = saved[0]
        path = path_for(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except Exception as exc:
        log.warning("torch.compile cache not saved to %s: %s", root, exc)
        return 0
    log.info("torch.compile cache: %d bytes saved to %s", len(blob), path)
    return len(blob)
