"""Compiling a Triton kernel for sm_90 on a machine without a GPU (Triton's bundled ptxas), in a
child process without `TRITON_INTERPRET` (conftest.py sets it for this one): the interpreter runs
kernels as Python, so what only the compiler checks (loop-carried types, layouts, shared memory,
casts) is checked here."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# What every such script starts and ends with: it defines the kernel `fn`, its signature `sig`,
# its constexprs `const`, the pointer/stride arguments `aligned` (16-byte divisible) and its
# `warps`/`stages` (an attention kernel's scale: `constexprs_with_scale`); this compiles it for
# sm_90 and prints the cubin's size (and what its PTX says of the waits and prefetches).
_HEAD = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def constexprs_with_scale(sig, const, scale_type, value):
    # the attention scale as Inductor hands it over (fp32 or fp64), or as torch 2.11's mutation
    # analysis does (a constexpr); then every constexpr in the signature
    sig["qk_scale"] = scale_type
    if scale_type == "constexpr":
        const["qk_scale"] = value
    sig.update(dict.fromkeys(const, "constexpr"))
"""
_TAIL = """
src = ASTSource(
    fn,
    sig,
    {(fn.arg_names.index(n),): v for n, v in const.items()},
    {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned},
)
kernel = triton.compile(src, GPUTarget("cuda", 90, 32), dict(num_warps=warps, num_stages=stages))
print("cubin", len(kernel.asm["cubin"]))
# whether the kernel's first global access comes after a grid dependency wait (`grid_dependency`)
ptx = kernel.asm["ptx"]
ptx = ptx[ptx.index(".entry"):]
wait = ptx.find("griddepcontrol.wait")
first = min([i for i in (ptx.find(op) for op in ("ld.global", "st.global", "cp.async")) if i >= 0])
print("waits first", 0 <= wait < first)
print("prefetches", ptx.count("prefetch.global.L2"))  # L2 prefetches asked for (layer_kernel)
"""


def compile_in_child(script: str, *args: str) -> str:
    """Run `script` between the common head and tail above (argv: `args`) → its stdout ("cubin
    SIZE", then "waits first True" where the kernel waits for the kernels before it ahead of its
    first global load or store); skips the test where this Triton has no CUDA compiler API."""
    out = run_in_child(_HEAD + script + _TAIL, *args)
    assert "cubin" in out
    return out


def run_in_child(code: str, *args: str) -> str:
    """Run `code` (argv: `args`) in a child without `TRITON_INTERPRET`, from a file (Triton reads
    the source of a kernel the code defines) → its stdout; skips the test where this Triton has
    no CUDA compiler API."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(code)
        res = subprocess.run(
            [sys.executable, str(script), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if "No module named" in res.stderr or "ImportError" in res.stderr:
        pytest.skip(f"this triton has no CUDA compiler API: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
