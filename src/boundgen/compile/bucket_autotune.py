"""Inductor's GEMM autotuning for the AOTInductor buckets — an A/B switch, off until the GPU says
which is faster.

Every GEMM of a bucket goes to cuBLAS (Inductor's default). At W3's 64 rows its kernels are
latency-bound (qkv 4.7 µs and o_proj 4.2 µs a layer for 2.1 and 1.6 MB of weights) and `down` pays
a separate split-K reduce (1.9 µs a layer); in W2 and W1 the SiLU·mul between gate_up and down is
a pass of its own (314 µs of W2's 3.4 ms of kernels; H200, BENCHMARKS.md twenty-first session).
With `BOUNDGEN_BUCKET_AUTOTUNE=1` Inductor times its Triton GEMM templates against cuBLAS for each
GEMM of a bucket at compile time and keeps the fastest, and a Triton template may take the
elementwise work around it (Inductor's epilogue and prologue fusion: SiLU·mul into `down`'s
operand load). A bucket's shapes are static, so each GEMM is timed at exactly the rows it runs.
(The beam search's layers, whose rows are dynamic, lost with it: `BOUNDGEN_GEMM_AUTOTUNE`, removed
in the twentieth session; this switch leaves them alone.) The cost is compile time: each GEMM
shape is benchmarked once per build; `boundgen compile`'s parallel workers time theirs on a
shared GPU at once, so an A/B builds its buckets one at a time (`benchmarks/profile_w3.py
--autotune 0,1`). The mode is part of the buckets' platform key when on.
"""

from __future__ import annotations

import os
from typing import Any

from boundgen.settings import env_choice

MODES = ("0", "1")
MODE = os.environ.get("BOUNDGEN_BUCKET_AUTOTUNE", "0")


def mode() -> str:
    """The autotune mode this process builds buckets with (`MODES`)."""
    return env_choice("BOUNDGEN_BUCKET_AUTOTUNE", MODE, MODES)


def inductor_options() -> dict[str, Any]:
    """Inductor config for a bucket's build: cuBLAS against Inductor's Triton templates per GEMM
    under "1", nothing (Inductor's defaults and cache keys) under "0"."""
    if mode() == "0":
        return {}
    return {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
