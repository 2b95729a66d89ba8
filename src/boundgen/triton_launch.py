"""How boundgen's Triton kernels are launched from inside their `torch.library.triton_op`s."""

from __future__ import annotations


def traceable(kernel):
    """`kernel` as torch.compile and torch.export can trace it inside a `triton_op`
    (`wrap_triton`). NOTE: under TRITON_INTERPRET=1 it is an InterpretedFunction, which some torch
    versions' `wrap_triton` refuse; there it only runs eagerly anyway, so it is launched as is."""
    import triton
    from torch.library import wrap_triton

    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel
