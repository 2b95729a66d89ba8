"""Programmatic dependent launch (Hopper and later) for boundgen's own Triton kernels: the kernels'
side of it.

A CUDA graph runs dependent kernels one after the other: the GPU drains the first, then launches the
second, and idles in between. On an H100 (forty-second session) W3's graph took 904 µs by events for
797 µs of its 183 kernels (~0.6 µs a gap), a one-prompt beam search 4.33 ms for 3.64 ms of its 781
(~0.9 µs a gap). With a programmatic edge between two kernels (`compile/programmatic.py` rewrites a
captured graph's edges) the second may launch once every program of the first has run
`griddepcontrol.launch_dependents`; its programs then wait at `griddepcontrol.wait` until the first
has finished and its writes are visible. The launch and the programs' start overlap the first kernel
instead of following it.

A kernel may take such an edge only where nothing a kernel before it writes is touched before its
wait: each kernel of `KERNELS` calls `await_inputs(PDL)` (the wait, then the trigger that lets its
own successor launch) before any load or store, after index arithmetic only (and the weights'
prefetch below). The trigger is a hint: a successor whose edge stays a plain one (Inductor's
kernels, cuBLAS, copies) still starts after this kernel has finished. Both instructions are no-ops
in a kernel launched without a programmatic edge.

Triton 3.6 (the GPU image's) writes both instructions as inline assembly without operands, marked
impure (3.9, the CPU builds', as ops of their own). torch's analysis of what a user Triton kernel
writes (run when Inductor traces one) refuses impure inline assembly and then takes every argument
as written: on the H200 (forty-third session), with the switch on, the compiled searches failed to
compile and the AOTInductor buckets' scores came out wrong. Assembly without operands cannot name
a tensor, so it writes none of the kernel's arguments: `_asm_writing_nothing_passed_over` tells the
analysis so (installed on import, as the kernels are defined).

`ON` (`BOUNDGEN_PDL`, default "0" until the GPU measures it) decides both sides: the kernels traced
or launched while it is on carry the instructions (`PDL`, also false where the GPU has no
`griddepcontrol`, before sm_90, and in Triton's CPU interpreter, which lacks it), and graphs
captured while it is on get the edges. Off, the kernels are the ones the GPU suite last passed
with; compiled packages record it (`compile.cache.platform_info`).

What else may run before the wait: the weight-streaming kernels' (`models/stream`, `stream_gated`,
`stream_qkv`) prefetch into L2 of the weight rows they will stream (`prefetch_rows`, one
`prefetch.global.L2` a 128-byte line, by the first row tile's programs). No kernel of a graph
writes a weight, so the lines fetched while the kernel before still runs are the ones the kernel's
loads after the wait read, from L2 instead of HBM; all else (activations, bias, cos/sin, the
cache, the step) is still read after the wait. `PREFETCH` (`BOUNDGEN_PREFETCH`, default "0" until
the GPU measures it) switches it, read when a kernel is traced or launched; a kernel carries it
only where it carries the wait (`prefetches`: PREFETCH and `waits`, so never in the interpreter):
without the wait its loads follow at once and it gains nothing. Compiled packages record it with
`ON` (`prefetch_compiled`). Tried first in the forty-second session and removed: torch's analysis
below took it for a write of every argument.

The prefetch is impure inline assembly with operands (the lines' addresses): pure assembly would be
dropped as dead code (its dummy result is unused), and torch's analysis refuses impure assembly
with operands as it did the wait's. A prefetch writes no memory, so the mend passes over it too,
but only by its exact text (`PREFETCH_L2_ASM`, one constant for the kernel and the check, in
`ASM_WRITING_NOTHING`) and only in a kernel whose every inline assembly is operandless or on that
list (`every_asm_writes_nothing`, read off the TTIR module: torch's parsed ops keep no assembly
text). A kernel with any other assembly that takes operands, or a module the check cannot read,
keeps the operandless-only mend, and so torch's answer for it: every argument written.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

ON = os.environ.get("BOUNDGEN_PDL", "0") == "1"
PREFETCH = os.environ.get("BOUNDGEN_PREFETCH", "0") == "1"

# The names of the kernels that wait with `await_inputs` before any load or store (`awaits` adds
# them as their modules load): the kernels a captured graph's edges into may be made programmatic.
KERNELS: set[str] = set()


def awaits(kernel):
    """Marks a Triton kernel that calls `await_inputs(PDL)` before any load or store, after index
    arithmetic and its weight's prefetch only (the tests check that it does): edges into it may be
    made programmatic."""
    KERNELS.add(kernel.__name__)
    return kernel


@functools.cache
def device_waits(index: int) -> bool:
    """Whether CUDA device `index` has programmatic launch (`griddepcontrol`: sm_90 and later)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: kernels traced or launched, and graphs captured, take programmatic launch (`ON`)
    or not (an A/B's switch)."""
    return switched(globals(), "ON", on)


def waits(x: torch.Tensor) -> bool:
    """`PDL` for a kernel launched on `x`'s device: whether it carries `griddepcontrol` (`ON`,
    CUDA, sm_90 and later; never in the interpreter, on CPU tensors)."""
    if not (ON and AVAILABLE and x.is_cuda):
        return False
    return device_waits(x.device.index if x.device.index is not None else 0)


def prefetches(x: torch.Tensor) -> bool:
    """`PREFETCH` for a weight-streaming kernel launched on `x`'s device: on (`PREFETCH`) where
    the kernel waits (`waits`): before the wait is the only place the prefetch gains anything."""
    return PREFETCH and waits(x)


def prefetching(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside: the weight-streaming kernels traced or launched prefetch their weights before
    their wait (`PREFETCH`) or not (an A/B's switch; the prefetch comes only with `ON`)."""
    return switched(globals(), "PREFETCH", on)


def prefetch_compiled() -> bool:
    """Whether kernels traced now carry the prefetch where they wait (`PREFETCH` with `ON`): what
    compiled packages and blobs record."""
    return ON and PREFETCH


# `prefetch_rows`' assembly: one line of L2 (the address $1) fetched where $2 is nonzero; $0 is a
# dummy result (inline assembly must have one). One constant for the kernel and the mend's check.
PREFETCH_L2_ASM = (
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }"
)
# inline assembly of boundgen's kernels that takes operands but writes no memory, by exact text
ASM_WRITING_NOTHING = frozenset({PREFETCH_L2_ASM})

# the analysis' op for inline assembly, and the name it takes instead where it writes nothing: an
# op the analysis neither reads nor writes through
_ASM_OP, _ASM_WRITING_NOTHING = "tt.elementwise_inline_asm", "boundgen.asm_writing_nothing"


def every_asm_writes_nothing(ttir_module) -> bool:
    """Whether every inline assembly op of a kernel's TTIR module (torch's `generate_ttir`) is
    operandless or has a text of `ASM_WRITING_NOTHING`. False where the module cannot be walked
    or an op read: the mend then renames the operandless ones only."""
    verdicts = []

    def check(op) -> None:
        # exceptions kept inside: raised through the C++ walk they may not come back as Python's
        try:
            if op.get_name() == _ASM_OP and op.get_num_operands():
                verdicts.append(op.get_str_attr("asm_string") in ASM_WRITING_NOTHING)
        except Exception:
            verdicts.append(False)

    try:
        ttir_module.walk(check)
    except Exception:
        return False
    return all(verdicts)


def without_asm_writing_nothing(functions: dict, every_asm: bool = False) -> dict:
    """torch's parsed kernel (`ttir_to_functions`: function → result → ops) with the inline
    assembly ops that write nothing renamed, in place, so that the analysis passes over them:
    all of them where `every_asm` (the module's were checked: `every_asm_writes_nothing`), else
    those that take no operand (which cannot name a tensor)."""
    for ops in functions.values():
        for result, op_list in ops.items():
            ops[result] = [
                dataclasses.replace(op, name=_ASM_WRITING_NOTHING)
                if op.name == _ASM_OP and (every_asm or not op.args)
                else op
                for op in op_list
            ]
    return functions


def _asm_writing_nothing_passed_over() -> None:
    """Wraps torch's TTIR parser of user Triton kernels (`triton_kernel_wrap.ttir_to_functions`,
    what torch 2.11's and later analyses call by name) with `without_asm_writing_nothing`, the
    module checked by `every_asm_writes_nothing`. Once."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:  # pragma: no cover - a torch without user Triton kernels in Inductor
        return
    original = getattr(wrap, "ttir_to_functions", None)
    if original is None or getattr(original, "_boundgen_asm_writing_nothing", False):
        return

    @functools.wraps(original)
    def ttir_to_functions(ttir_module, *args, **kwargs):
        functions = original(ttir_module, *args, **kwargs)
        return without_asm_writing_nothing(functions, every_asm_writes_nothing(ttir_module))

    ttir_to_functions._boundgen_asm_writing_nothing = True
    wrap.ttir_to_functions = ttir_to_functions


if AVAILABLE:
    _asm_writing_nothing_passed_over()
    _PREFETCH_L2_ASM = tl.constexpr(PREFETCH_L2_ASM)  # a kernel reads only constexpr globals

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """A kernel's first step: wait for the kernels it depends on (`griddepcontrol.wait`),
        then let its successor launch (`griddepcontrol.launch_dependents`)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_rows(
        W, rows, row_ok, k0, K: tl.constexpr, K_LEN: tl.constexpr, PREFETCH: tl.constexpr
    ):
        """With PREFETCH: W[rows, k0 : k0 + K_LEN] of a row-major [*, K] weight of 16-bit
        elements into L2, one `prefetch.global.L2` a 128-byte line (64 elements), 16 lines a row
        at a time; rows where `row_ok`. Impure assembly: its dummy result is unused, and pure
        assembly would be dropped as dead code."""
        if PREFETCH:
            for c in tl.static_range(0, K_LEN, 16 * 64):
                j = c + tl.arange(0, 16) * 64
                ks = k0 + j
                at = W + rows.to(tl.int64)[:, None] * K + ks[None, :]
                ok = row_ok[:, None] & ((j < K_LEN) & (ks < K))[None, :]
                tl.inline_asm_elementwise(
                    _PREFETCH_L2_ASM,
                    "=r,l,r",
                    [at, ok.to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
