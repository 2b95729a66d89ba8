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

A kernel may take such an edge only where nothing it reads or writes is touched before its wait:
each kernel of `KERNELS` starts with `await_inputs(PDL)` (the wait, then the trigger that lets its
own successor launch). The trigger is a hint: a successor whose edge stays a plain one (Inductor's
kernels, cuBLAS, copies) still starts after this kernel has finished. Both instructions are no-ops
in a kernel launched without a programmatic edge.

Triton 3.6 (the GPU image's) writes both instructions as inline assembly without operands, marked
impure (3.9, the CPU builds', as ops of their own). torch's analysis of what a user Triton kernel
writes (run when Inductor traces one) refuses impure inline assembly and then takes every argument
as written: on the H200 (forty-third session), with the switch on, the compiled searches failed to
compile and the AOTInductor buckets' scores came out wrong. Assembly without operands cannot name
a tensor, so it writes none of the kernel's arguments: `_operandless_asm_writes_nothing` tells the
analysis so (installed on import, as the kernels are defined).

`BOUNDGEN_PDL` (`MODE`) says which graphs take it: "0" none, "small" (the default) the graphs of
prefill buckets of at most `SMALL_TOKENS` tokens (short prompts: W3), "buckets" every prefill
bucket's graph (score, classify, embed: W1–W3, W5) but not the beam searches', "1" every graph. On
an H100 (forty-fourth session) the edges took W3's graph 899–906 → 873 µs but lost W4's searches
0.17 ms and W2 0.03 ms (a few long GEMMs: no gaps to save): hence "small", which gives them to the
graphs of many short kernels only (forty-ninth session, W3's bucket, interleaved: the runner −0.035
ms, `Engine.score` −0.035 to −0.043; the default since the whole GPU suite passed under it,
fifty-first session, H100: 87 passed). `active()` decides both sides, read on the thread that traces
or captures: the kernels traced or launched while it is true carry the instructions (`PDL`, also
false where the GPU has no `griddepcontrol`, before sm_90, and in Triton's CPU interpreter, which
lacks it), and graphs captured while it is true get the edges. It is `ON` (any mode but "0"), except
inside `for_searches()` — a beam search's trace and capture (`ModelRunner.beam_search`,
`SearchGraphs.run`) — where it is `ON and SEARCHES` (mode "1"), and under "small" only inside
`for_bucket(tokens)` of a small bucket (a bucket's export, `compile.aoti.build_package`, the
compiled backend's warm-up, and its graph's capture, `compile.graphs.capture_buckets`). A graph is
captured in the context its kernels were traced in, so its edges only go into kernels that wait: an
edge into a kernel traced without the wait would let it read its inputs before they are written.
Compiled packages and the searches' compiled-layers blob record what their kernels carry (`key()` in
`compile.cache.platform_info`, `compile.torch_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Iterator

import torch

from boundgen.settings import switched

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - triton ships with CUDA torch and the dev extra
    AVAILABLE = False

MODES = ("0", "small", "buckets", "1")
# "small": the buckets of at most this many tokens take it (the rows up to which the layers stream
# their weights, `models.stream.MAX_ROWS`: short prompts, whose graphs are many short kernels)
SMALL_TOKENS = 128


def mode_of(value: str) -> str:
    """`BOUNDGEN_PDL`'s value checked: one of `MODES`."""
    if value not in MODES:
        raise ValueError(
            f"BOUNDGEN_PDL={value!r}: use 0 (no graph), small (the graphs of prefill buckets of "
            f"at most {SMALL_TOKENS} tokens), buckets (every prefill bucket's graph) or 1 (every "
            "graph, the beam searches' too)"
        )
    return value


MODE = mode_of(os.environ.get("BOUNDGEN_PDL", "small"))
ON = MODE != "0"  # kernels traced and graphs captured take it (outside `for_searches`)
SEARCHES = MODE == "1"  # the beam searches' too
# the most tokens a bucket that takes it may have (None: any)
MAX_TOKENS = SMALL_TOKENS if MODE == "small" else None
# per thread: `searches_off`, True inside `for_searches` where the searches do not take it;
# `bucket_tokens`, the tokens of the bucket traced or captured inside `for_bucket`
_thread = threading.local()

# The names of the kernels that start with `await_inputs` (`awaits` adds them as their modules
# load): the kernels a captured graph's edges into may be made programmatic.
KERNELS: set[str] = set()


def awaits(kernel):
    """Marks a Triton kernel whose first step is `await_inputs(PDL)` (the tests check that it
    is): edges into it may be made programmatic."""
    KERNELS.add(kernel.__name__)
    return kernel


@functools.cache
def device_waits(index: int) -> bool:
    """Whether CUDA device `index` has programmatic launch (`griddepcontrol`: sm_90 and later)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Inside: kernels traced or launched, and graphs captured, take programmatic launch or not,
    the beam searches' too (`ON` and `SEARCHES`: an A/B's switch, process-wide)."""
    with switched(globals(), "ON", on), switched(globals(), "SEARCHES", on):
        yield


@contextlib.contextmanager
def for_searches() -> Iterator[None]:
    """Inside, on this thread: a beam search's kernels traced and graphs captured take
    programmatic launch only where the searches do (`SEARCHES`)."""
    before = getattr(_thread, "searches_off", False)
    _thread.searches_off = not SEARCHES
    try:
        yield
    finally:
        _thread.searches_off = before


@contextlib.contextmanager
def for_bucket(tokens: int) -> Iterator[None]:
    """Inside, on this thread: a prefill bucket of `tokens` tokens is traced or captured (under
    "small" it takes programmatic launch only where `tokens` ≤ `MAX_TOKENS`)."""
    before = getattr(_thread, "bucket_tokens", None)
    _thread.bucket_tokens = tokens
    try:
        yield
    finally:
        _thread.bucket_tokens = before


def in_searches() -> bool:
    """Whether a beam search's kernels and graphs take programmatic launch (`ON` and
    `SEARCHES`): what `active()` says inside `for_searches`."""
    return ON and SEARCHES


def _switched_on() -> bool:
    """`ON`, but not inside `for_searches` unless `SEARCHES`."""
    return ON and not getattr(_thread, "searches_off", False)


def active() -> bool:
    """Whether kernels traced or launched, and graphs captured, on this thread now take
    programmatic launch: `ON`, but not inside `for_searches` unless `SEARCHES`, and where there
    is a `MAX_TOKENS` ("small") only inside `for_bucket` of a bucket that small."""
    if not _switched_on():
        return False
    if MAX_TOKENS is None:
        return True
    tokens = getattr(_thread, "bucket_tokens", None)
    return tokens is not None and tokens <= MAX_TOKENS


def key() -> str | None:
    """What compiled packages record of it (`compile.cache.platform_info`; None: nothing, the
    keys of the packages built before the switch): "1" where every bucket traced on this thread
    now takes it, "small:<MAX_TOKENS>" where the small ones do (each package then carries what its
    bucket's size says)."""
    if not _switched_on():
        return None
    return "1" if MAX_TOKENS is None else f"small:{MAX_TOKENS}"


def waits(x: torch.Tensor) -> bool:
    """`PDL` for a kernel launched on `x`'s device: whether it carries `griddepcontrol`
    (`active()`, CUDA, sm_90 and later; never in the interpreter, on CPU tensors)."""
    if not (AVAILABLE and x.is_cuda and active()):
        return False
    return device_waits(x.device.index if x.device.index is not None else 0)


# the analysis' op for inline assembly, and the name an operandless one takes instead: an op it
# neither reads nor writes through
_ASM_OP, _OPERANDLESS_ASM = "tt.elementwise_inline_asm", "boundgen.operandless_inline_asm"


def without_operandless_asm(functions: dict) -> dict:
    """torch's parsed kernel (`ttir_to_functions`: function → result → ops) with every inline
    assembly op that takes no operand renamed, in place, so that the analysis passes over it."""
    for ops in functions.values():
        for result, op_list in ops.items():
            ops[result] = [
                dataclasses.replace(op, name=_OPERANDLESS_ASM)
                if op.name == _ASM_OP and not op.args
                else op
                for op in op_list
            ]
    return functions


def _operandless_asm_writes_nothing() -> None:
    """Wraps torch's TTIR parser of user Triton kernels (`triton_kernel_wrap.ttir_to_functions`,
    what torch 2.11's and later analyses call by name) with `without_operandless_asm`. Once."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:  # pragma: no cover - a torch without user Triton kernels in Inductor
        return
    original = getattr(wrap, "ttir_to_functions", None)
    if original is None or getattr(original, "_boundgen_operandless_asm", False):
        return

    @functools.wraps(original)
    def ttir_to_functions(*args, **kwargs):
        return without_operandless_asm(original(*args, **kwargs))

    ttir_to_functions._boundgen_operandless_asm = True
    wrap.ttir_to_functions = ttir_to_functions


if AVAILABLE:
    _operandless_asm_writes_nothing()

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """A kernel's first step: wait for the kernels it depends on (`griddepcontrol.wait`),
        then let its successor launch (`griddepcontrol.launch_dependents`)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
