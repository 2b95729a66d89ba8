"""How boundgen's Triton kernels are launched from inside their `torch.library.triton_op`s."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_INTERPRETED = False


@contextlib.contextmanager
def interpreted():
    """Inside: the few-row kernels (`models/stream*.py`, `models/layer_kernel.py`) also take
    CPU tensors, which Triton's interpreter runs where `TRITON_INTERPRET=1` (the tests'
    switch)."""
    global _INTERPRETED
    before, _INTERPRETED = _INTERPRETED, True
    try:
        yield
    finally:
        _INTERPRETED = before


def takes(x: torch.Tensor, weights) -> bool:
    """What every few-row kernel asks of its call, beside its own row limit and layer types:
    not while training (the kernels have no backward: with grad on and `weights` that want it,
    the demo trainer keeps the plain ops), and activations on CUDA in bf16/fp16 — or CPU ones
    under `interpreted()`."""
    import torch

    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16)
    return _INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"


def traceable(kernel):
    """`kernel` as torch.compile and torch.export can trace it inside a `triton_op`
    (`wrap_triton`). NOTE: under TRITON_INTERPRET=1 it is an InterpretedFunction, which some torch
    versions' `wrap_triton` refuse; there it only runs eagerly anyway, so it is launched as is."""
    import triton
    from torch.library import wrap_triton

    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel


def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessors (SMs): a persistent kernel's grid, a program each."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(x: torch.Tensor) -> str:
    """`tl.dot`'s input precision for a call on `x`: float32's own products for float32 (the
    tests' oracle precision; the engine takes the few-row kernels in bf16/fp16 only), not TF32's,
    which Triton's dot defaults to."""
    import torch

    return "ieee" if x.dtype == torch.float32 else "tf32"


def unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` as the kernels index them, each with its last dim contiguous: as it is where it
    already is, else a contiguous copy."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in tensors)


def one_stride_set(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`a` and `b` (the beam kernels' own-slot k and v) as a kernel that walks both with `a`'s
    strides reads them: as they are when their strides match (`kv.BeamKV`'s halves), else
    contiguous copies."""
    if a.stride() != b.stride():
        return a.contiguous(), b.contiguous()
    return a, b
