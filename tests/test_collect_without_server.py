"""Issue 27: the GPU image has torch and transformers but not the server's packages. `pytest -m gpu
tests/` must still collect there, every server-only module skipped with a reason, or no GPU test
runs at all (two modules that imported fastapi at the top once stopped the whole run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What the server needs and a torch + transformers image does not bring (transformers brings httpx
# and pyyaml itself).
SERVER_ONLY = (
    "fastapi",
    "starlette",
    "uvicorn",
    "httptools",
    "orjson",
    "prometheus_client",
    "pydantic",
)

# pytest in a fresh interpreter where those packages cannot be imported, as if never installed
WITHOUT_SERVER = f"""
import importlib.abc
import sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, NotInstalled())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_gpu_tests_collect_without_the_server_packages():
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_SERVER, "-m", "gpu", "--collect-only", "-q", "-rs"]
        + ["-p", "no:cacheprovider", str(TESTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ERROR collecting" not in out, out
    assert "test_gpu.py::" in out  # the GPU tests are there to run
    # the server-only modules say why they are skipped
    assert "tests/test_server_metrics.py" in out and "could not import 'fastapi'" in out, out
