"""Every Triton kernel boundgen defines can be copied by Inductor when a compiled forward traces it:
Inductor writes the kernel's source into a (non-raw) string literal of its generated module, so a
backslash escape in the source (an inline-asm "\\n") becomes a real line break there and the module
does not import (the layer kernel's L2 prefetch did, fifty-fifth session's H100 call)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.jit import KernelInterface  # noqa: E402

import boundgen  # noqa: E402


def boundgen_kernels() -> dict[str, str]:
    """Each `@triton.jit` function's name → its source (compiled or, as conftest.py sets it,
    interpreted: a `KernelInterface` either way)."""
    found = {}
    for info in pkgutil.walk_packages(boundgen.__path__, "boundgen."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an extra this environment lacks (the server's, Ray's)
            continue
        for name, value in vars(module).items():
            fn = value
            while isinstance(fn, KernelInterface):  # through any autotuner to the Python function
                fn = fn.fn
            if fn is not value and fn.__module__ == info.name:
                found[f"{info.name}.{name}"] = inspect.getsource(fn)
    return found


def test_no_kernel_source_holds_a_backslash():
    kernels = boundgen_kernels()
    assert "boundgen.models.layer_kernel._prefetch" in kernels  # the walk finds the kernels
    assert [name for name, src in kernels.items() if "\\" in src] == []
