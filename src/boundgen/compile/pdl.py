"""Programmatic dependent launch for Inductor's own Triton kernels — an A/B switch, off until the
GPU says which is faster.

A W4 search replays ~1,700 kernels from one CUDA graph with ~1.6 µs between them (BENCHMARKS.md,
2026-12-01: ~2 ms of a 6–8 ms search); most are Inductor's elementwise and norm kernels around the
GEMMs of a compiled layer-step. On Hopper a kernel launched with programmatic dependent launch
(PDL) may start while the kernel before it finishes: it runs its prologue, and its loads of
buffers the previous kernel did not write, then waits (`griddepcontrol.wait`) for that kernel's
memory before the first dependent load. With `BOUNDGEN_PDL=1` Inductor emits the wait and the
early trigger in its kernels and launches them with the attribute (`triton.enable_pdl`); a CUDA
graph captures the launches as programmatic edges. Kernels that are not Inductor's (cuBLAS, flash
attention, our Triton ops) launch as before, so a PDL kernel after one of them waits for it whole.

Only `torch.compile`'s Python wrapper launches with the attribute (the beam layers, the
`compile` backends); AOTInductor's C++ launcher does not forward it (torch 2.11 to 2.13), so the
packages stay as they are and their key does not change.
"""

from __future__ import annotations

import os
from typing import Any

from boundgen.settings import env_choice

MODES = ("0", "1")
MODE = os.environ.get("BOUNDGEN_PDL", "0")


def mode() -> str:
    """The launch mode this process compiles with (`MODES`)."""
    return env_choice("BOUNDGEN_PDL", MODE, MODES)


def inductor_options() -> dict[str, Any]:
    """Inductor config for a `torch.compile` in this process's mode: PDL under "1" where this
    torch has the option, nothing (Inductor's defaults and cache keys) otherwise."""
    if mode() == "0":
        return {}
    import torch._inductor.config as inductor

    if not hasattr(inductor.triton, "enable_pdl"):  # a torch before the option: plain launches
        return {}
    return {"triton.enable_pdl": True}
