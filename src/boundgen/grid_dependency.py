"""Programmatic dependent launch (Hopper and later) for boundgen's own Triton kernels: the kernels'
side of it.

A CUDA graph runs dependent kernels one after the other: the GPU drains the first, then launches
the second, and idles in between. W3's graph on an H100 (forty-second session) launched 183
kernels, busy 797 µs and idle 248 µs between them (~1.4 µs a gap); a beam search's gaps are ~1 ms
of its 4.3. With a programmatic edge between two kernels (`compile/programmatic.py` rewrites a
captured graph's edges) the second may launch once every program of the first has run
`griddepcontrol.launch_dependents`; its programs then wait at `griddepcontrol.wait` until the
first has finished and its writes are visible. The launch and the programs' start overlap the
first kernel instead of following it.

A kernel may take such an edge only where nothing it reads or writes is touched before its wait:
each kernel of `KERNELS` starts with `await_inputs(PDL)` (the wait, then the trigger that lets its
own successor launch). The trigger is a hint: a successor whose edge stays a plain one (Inductor's
kernels, cuBLAS, copies) still starts after this kernel has finished. Both instructions are no-ops
in a kernel launched without a programmatic edge, so the kernels carry them whatever
`compile.programmatic.ON` says; `PDL` is false where the GPU has no `griddepcontrol` (before
sm_90) and in Triton's CPU interpreter, which lacks it.

What a weight-streaming kernel may do before its wait: fetch the weight rows it will stream into
L2 (`prefetch_rows`; no kernel of a graph writes a weight), so that they arrive while the kernel
before still runs and its own loads after the wait hit L2. `PREFETCH` (`BOUNDGEN_PREFETCH`,
default "0" until the GPU measures it) decides, read when a kernel is traced or launched;
compiled packages record it (`compile.cache.platform_info`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from boundgen.settings import switched

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

PREFETCH = os.environ.get("BOUNDGEN_PREFETCH", "0") == "1"

# The names of the kernels that start with `await_inputs` (`awaits` adds them as their modules
# load): the kernels a captured graph's edges into may be made programmatic.
KERNELS: set[str] = set()


def awaits(kernel):
    """Marks a Triton kernel whose first step is `await_inputs(PDL)` (the tests check that it
    is): edges into it may be made programmatic."""
    KERNELS.add(kernel.__name__)
    return kernel


@functools.cache
def _device_waits(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def waits(x: torch.Tensor) -> bool:
    """`PDL` for a kernel launched on `x`'s device: whether it carries `griddepcontrol` (CUDA,
    sm_90 and later; never in the interpreter, on CPU tensors)."""
    if not (AVAILABLE and x.is_cuda):
        return False
    return _device_waits(x.device.index if x.device.index is not None else 0)


def prefetches(x: torch.Tensor) -> bool:
    """`PREFETCH` for a weight-streaming kernel launched on `x`'s device: on (`PREFETCH`) where
    its kernels wait (`waits`)."""
    return PREFETCH and waits(x)


def prefetching(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: the weight-streaming kernels traced or launched prefetch their weights before
    their wait (`PREFETCH`) or not (an A/B's switch)."""
    return switched(globals(), "PREFETCH", on)


if AVAILABLE:

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """A kernel's first step: wait for the kernels it depends on (`griddepcontrol.wait`),
        then let its successor launch (`griddepcontrol.launch_dependents`)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_rows(W, rows, row_ok, k0, K: tl.constexpr, K_LEN: tl.constexpr, ON: tl.constexpr):
        """With ON: W[rows, k0 : k0 + K_LEN] of a row-major [*, K] weight of 16-bit elements
        into L2, one `prefetch.global.L2` a 128-byte line (64 elements), 16 lines a row at a
        time; rows where `row_ok`."""
        if ON:
            for c in tl.static_range(0, K_LEN, 16 * 64):
                j = c + tl.arange(0, 16) * 64
                ks = k0 + j
                at = W + rows.to(tl.int64)[:, None] * K + ks[None, :]
                ok = row_ok[:, None] & ((j < K_LEN) & (ks < K))[None, :]
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
                    "@p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r",
                    [at, ok.to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
