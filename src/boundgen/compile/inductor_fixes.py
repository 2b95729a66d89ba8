"""Mends for Inductor bugs that break our AOTInductor builds, applied before a build.

Each mend is idempotent and leaves Inductor's behaviour as its authors meant it; where a torch
already carries the fix upstream, the mend changes nothing.
"""

from __future__ import annotations

import functools


def keep_int_array_targets_alive() -> None:
    """Hold every target that the C++ wrapper writes a size/stride array declaration into for as
    long as the wrapper lives.

    `CppWrapperCpu.codegen_int_array_var` caches a declared `int_array_N` by the `id()` of the
    buffer it was written into, and writes no declaration on a cache hit. The wrapper writes into
    short-lived buffers too; once one is freed, CPython hands its address to the next one, whose
    key then aliases the dead buffer's, and the wrapper uses `int_array_N` without declaring it:
    `error: 'int_array_188' was not declared in this scope` from the C++ build. On the H200 (torch
    2.11) one of ten W5 buckets failed that way in a build worker in each of two sessions
    (BENCHMARKS.md, twenty-second and twenty-third sessions) and was built again in the parent.
    Torch fixed it upstream the same way: by keeping the targets alive."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.codegen_int_array_var
    if getattr(original, "_boundgen_keeps_targets", False):
        return

    @functools.wraps(original)
    def codegen_int_array_var(self, int_array, writeline, *args, **kwargs):
        target = getattr(writeline, "__self__", writeline)
        # a live target's id is its own: no later buffer can alias it while the wrapper lives
        self.__dict__.setdefault("_boundgen_int_array_targets", {})[id(target)] = target
        return original(self, int_array, writeline, *args, **kwargs)

    codegen_int_array_var._boundgen_keeps_targets = True
    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
