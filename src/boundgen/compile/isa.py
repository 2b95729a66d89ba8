"""Inductor's CPU vector-ISA check, paid once per machine instead of once per process.

Compiling an AOTInductor package asks Inductor which CPU vector ISA the machine has
(`pick_vec_isa`: the package's metadata records it, and `aoti_load_package` compares it with the
loading machine's). Inductor answers by building a tiny C++ library per candidate ISA and loading
it in a child `python`; in torch 2.11 every child imports torch, and a Sapphire Rapids host runs up
to 11 of them (AVX2, AVX512 and its bf16, VNNI, AMX and its fp16 variants). On the H200 image that
is 57 s, paid again by every process: each compile worker, the load check's child, and the
server's first package load (BENCHMARKS.md, 2026-12-02).

The answer depends only on the CPU, the C++ compiler and torch, so `remember_isa_checks(root)`
keeps each check's verdict in `root/isa-checks.json` (the compile cache: it travels with the
artifacts to machines of the same image). A check still unknown runs under a file lock, so the
processes of one `boundgen compile` (its parent starts the checks at once, the workers reach
theirs ~50 s later) run each check once between them. Loading a package never asks
(`compile.aoti.open_package` skips the comparison: the cache's platform key already vouches for
the machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

VERDICTS = "isa-checks.json"


def _machine_key() -> str:
    """What a verdict depends on: torch, the CPU's feature flags, the C++ compiler."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    try:
        stamp = f"{os.path.realpath(compiler)}:{os.stat(compiler).st_mtime_ns}"
    except OSError:
        stamp = compiler
    parts = [torch.__version__, sys.platform, platform.machine(), flags, stamp]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: Path, what: str = ""):
    """An exclusive lock between processes (and threads): `what` names one check's lock, "" the
    verdict file's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = f".{what}" if what else ""
    with open(path.with_name(f".{path.name}{suffix}.lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, key: str, ok: bool) -> None:
    with _locked(path):  # checks finish in parallel: no verdict may overwrite another's
        data = _read(path)
        data[key] = ok
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)


def remember_isa_checks(root: str | Path) -> bool:
    """Keep Inductor's ISA check verdicts in `root` for this process (idempotent). False when this
    torch has no such check (nothing to do)."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - a torch without Inductor
        return False
    cls = getattr(cpu_vec_isa, "VecISA", None)
    original = getattr(cls, "check_build", None)
    if original is None:
        return False
    path = Path(root) / VERDICTS
    if getattr(original, "_boundgen_verdicts", None) == path:
        return True
    original = getattr(original, "_boundgen_original", original)
    machine = _machine_key()

    def check_build(self, code: str) -> bool:
        # NOTE: the AVX512 and AMX checks widen `_arch_flags` for a moment: it is part of the key
        raw = f"{machine}\n{type(self).__name__}\n{self._arch_flags}\n{code}"
        key = hashlib.sha256(raw.encode()).hexdigest()[:24]
        known = _read(path).get(key)
        if isinstance(known, bool):
            return known
        with _locked(path, key):  # another process may be running this very check: wait for it
            known = _read(path).get(key)
            if isinstance(known, bool):
                return known
            ok = bool(original(self, code))
            _write(path, key, ok)
            return ok

    check_build._boundgen_verdicts = path
    check_build._boundgen_original = original
    cls.check_build = check_build
    return True


def warm_isa_checks(root: str | Path) -> None:
    """Every check Inductor's `pick_vec_isa` may ask for on this CPU, run now and stored in `root`:
    one thread per candidate ISA. Each ISA's own checks are a chain (AMX: its base build, AVX512's
    bf16, VNNI, AMX, AMX-fp16) but the chains are independent, so the ~11 probe children of an AMX
    host overlap instead of following each other (~57 s on the H200 host, one after another)."""
    if not remember_isa_checks(root):
        return
    from torch._inductor import cpu_vec_isa

    candidates = list(getattr(cpu_vec_isa, "supported_vec_isa_list", []))
    checker = getattr(cpu_vec_isa, "x86_isa_checker", None)
    if platform.machine() in ("x86_64", "AMD64") and checker is not None:
        flags = checker()
        candidates = [i for i in candidates if all(f in flags for f in str(i).split())]
    else:
        candidates = []  # other architectures have one or two cheap candidates: let torch pick
    threads = [
        threading.Thread(target=bool, args=(isa,), name=f"isa-{isa}", daemon=True)
        for isa in candidates
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu_vec_isa.pick_vec_isa()
