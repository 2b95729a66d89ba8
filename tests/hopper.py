"""Compiling a Triton kernel for sm_90 on a machine without a GPU (Triton's bundled ptxas), in a
child process without `TRITON_INTERPRET` (conftest.py sets it for this one): the interpreter runs
kernels as Python, so what only the compiler checks (loop-carried types, layouts, shared memory,
casts) is checked here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compile_in_child(script: str, *args: str) -> str:
    """Run `script` (which calls `triton.compile` and prints "cubin N") → its stdout; skips the
    test where this Triton has no CUDA compiler API."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600
    )
    if "No module named" in res.stderr or "ImportError" in res.stderr:
        pytest.skip(f"this triton has no CUDA compiler API: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "cubin" in res.stdout
    return res.stdout
