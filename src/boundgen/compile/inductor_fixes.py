"""Mends for Inductor bugs that break our AOTInductor builds, applied before a build.

Each mend is idempotent and leaves Inductor's behaviour as its authors meant it; where a torch
already carries the fix upstream, the mend changes nothing.
"""

from __future__ import annotations

import functools


def keep_int_array_targets_alive() -> None:
    """Hold every target that the C++ wrapper writes a size/stride array declaration into for as
    long as the wrapper lives.

    `CppWrapperCpu.codegen_int_array_var` caches a declared `int_array_N` by the `id()` of where
    it was written, and writes no declaration on a cache hit: torch 2.11 keys on the `writeline`
    it is handed (a bound method, made anew at each call), later versions on the buffer behind it.
    Both are short-lived; once one is freed, CPython hands its address to the next one, whose key
    then aliases the dead one's, and the wrapper uses `int_array_N` without declaring it: `error:
    'int_array_188' was not declared in this scope` from the C++ build. On the H200 (torch 2.11)
    one of ten W5 buckets failed that way in a build worker in each of two sessions (BENCHMARKS.md,
    twenty-second and twenty-third sessions) and was built again in the parent. So both the
    `writeline` and its buffer live as long as the wrapper (the twenty-fifth session's version
    kept only the buffer, which left torch 2.11's key free to alias: its test failed on the H200,
    2026-12-05)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.codegen_int_array_var
    if getattr(original, "_boundgen_keeps_targets", False):
        return

    @functools.wraps(original)
    def codegen_int_array_var(self, int_array, writeline, *args, **kwargs):
        # a live object's id is its own: no later writeline or buffer can alias it while the
        # wrapper lives
        alive = self.__dict__.setdefault("_boundgen_int_array_targets", {})
        for target in (writeline, getattr(writeline, "__self__", writeline)):
            alive[id(target)] = target
        return original(self, int_array, writeline, *args, **kwargs)

    codegen_int_array_var._boundgen_keeps_targets = True
    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
