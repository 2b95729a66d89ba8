"""Inductor's GEMM autotuning for our compiled graphs — an A/B switch, off until the GPU says
which is faster.

Every GEMM of a compiled layer goes to cuBLAS today (Inductor's default, `max_autotune_gemm`
off). The decode GEMMs of a beam search have 16–512 rows and run at 50–60 % of the H200's HBM
bandwidth (BENCHMARKS.md: at 16 rows gate_up 7.0 µs, down 5.6, qkv 4.4, o_proj 4.0), a W3
bucket's at 64 rows likewise. With `BOUNDGEN_GEMM_AUTOTUNE=1` Inductor times its Triton GEMM
templates against cuBLAS for each GEMM shape at compile time and keeps the fastest (for a
bucket's fixed rows; the beam search's layers, whose rows are dynamic, are timed at the rows of
their first compile). The cost is compile time (each new GEMM shape is benchmarked once, and the
timings are cached with Inductor's own caches). The mode is part of the compiled artifacts'
platform key (`compile.cache.platform_info`) and, through the config, of Inductor's cache keys.
"""

from __future__ import annotations

import os
from typing import Any

from boundgen.settings import env_choice

MODES = ("0", "1")
MODE = os.environ.get("BOUNDGEN_GEMM_AUTOTUNE", "0")


def mode() -> str:
    """The autotune mode this process compiles with (`MODES`)."""
    return env_choice("BOUNDGEN_GEMM_AUTOTUNE", MODE, MODES)


def inductor_options() -> dict[str, Any]:
    """Inductor config for a compile in this process's mode: cuBLAS against Inductor's Triton
    templates per GEMM under "1" (no C++ templates: our compiled graphs are CUDA ones), nothing
    (Inductor's defaults and cache keys) under "0"."""
    if mode() == "0":
        return {}
    return {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
