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
    twenty-second and twenty-third sessions) and was built again in the parent. So each buffer
    lives as long as the wrapper, and is always written through one `writeline` of its own, kept
    with it: torch 2.11's key then names the buffer as later versions' does, and a second array
    in the same buffer is found in the cache again. (The twenty-fifth session's version kept only
    the buffer, which left 2.11's key free to alias: its test failed on the H200, 2026-12-05; the
    twenty-sixth kept every `writeline` handed in, so 2.11 never hit its cache and declared an
    array again for every call: the test of one buffer failed on an H100, 2026-12-05.)"""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.codegen_int_array_var
    if getattr(original, "_boundgen_keeps_targets", False):
        return

    @functools.wraps(original)
    def codegen_int_array_var(self, int_array, writeline, *args, **kwargs):
        # a live object's id is its own: no later writeline or buffer can alias it while the
        # wrapper lives. A bound method holds its buffer, so keeping the first one handed in for
        # a buffer keeps both, and handing that one on gives 2.11 the same key for the buffer.
        alive = self.__dict__.setdefault("_boundgen_int_array_targets", {})
        # (a builtin's bound method, `lines.append`, has an owner but no `__func__`: kept by its
        # own id, as any other callable)
        owner, func = getattr(writeline, "__self__", None), getattr(writeline, "__func__", None)
        key = (id(owner), func) if owner is not None and func is not None else id(writeline)
        writeline = alive.setdefault(key, writeline)
        return original(self, int_array, writeline, *args, **kwargs)

    codegen_int_array_var._boundgen_keeps_targets = True
    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
