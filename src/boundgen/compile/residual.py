"""A layer's residual adds kept out of cuBLAS's `addmm` in compiled graphs (`BOUNDGEN_RESIDUAL`:
`add`, the default, or `addmm`, Inductor's own graph).

Inductor rewrites `x + linear(h)` (a decoder layer's residual add after `o_proj` and after
`down_proj`) into `addmm(x, h, W)`, one GEMM with beta = 1 (its post-grad `addmm` pattern). For a
2-D `x`, ATen's `addmm_out` first copies `x` into the output tensor (a device-to-device memcpy) and
only a 1-D bias takes cuBLASLt's epilogue without it. So every layer of a compiled graph launches
two memcpys beside its GEMMs: 220 `Memcpy DtoD` in one profiled W4 search at b1 (H100,
BENCHMARKS.md twenty-ninth session), and 48 a W3 call would make (24 layers) — inferred from
ATen's code, not traced per call site. A memcpy of a [rows, hidden] activation is ~1 µs, plus the
gap before the next launch.

Under `add` the pass below undoes the rewrite: `mm`, then an add that Inductor fuses into the
next kernel that reads the sum (the post-attention RMSNorm; in a whole-model package also the next
layer's input RMSNorm). The numerics become eager's: the product rounded to the model dtype, then
the add. The mode is part of the compiled artifacts' platform key (`compile.cache.platform_info`)
and, through the pass's `uuid`, of Inductor's own cache keys.

Why `add` is the default: W4's searches, built both ways in one process, were faster with it at 1,
8 and 32 prompts over the vocabulary and over the children (H100, 2026-12-05: −0.11 to −0.27 ms of
5.3–13.8; the copies gone, 96 launches fewer), and W3's bucket is the same either way (271
kernels, twenty-second session). The whole GPU suite passes with it (thirtieth session), the
random-weight compiled searches judged against a float32 reference: with random weights a bf16
search's near-ties go either way, and one compiled search under `add` kept a best beam HF float32
scores 0.167 above the plain bf16 search's, which the older test (the plain search's best beam)
called a failure.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from boundgen.settings import env_choice

MODES = ("addmm", "add")
MODE = os.environ.get("BOUNDGEN_RESIDUAL", "add")


def mode() -> str:
    """The residual mode this process compiles with (`MODES`)."""
    return env_choice("BOUNDGEN_RESIDUAL", MODE, MODES)


class UnfusedResidual(CustomGraphPass):
    """Post-grad pass: every `addmm(inp, a, b)` whose `inp` is a 2-D matrix (a residual, not a
    bias vector) and whose alpha and beta are 1 becomes `inp + mm(a, b)`. `rewritten` counts
    the rewrites of this instance (tests read it)."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._guards import detect_fake_mode

        aten = torch.ops.aten
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("alpha", "beta")):
                continue
            inp, a, b = node.args
            vals = [getattr(x, "meta", {}).get("val") for x in (inp, a, b)]
            if not all(isinstance(v, torch.Tensor) for v in vals) or vals[0].dim() != 2:
                continue  # a bias vector: cuBLASLt adds it in the GEMM's epilogue, no copy
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (a, b))
                add = graph.call_function(aten.add.Tensor, (mm, inp))
            fake = detect_fake_mode(vals)
            if fake is not None:  # the shapes later passes and the lowering read
                with fake:
                    mm.meta["val"] = aten.mm.default(vals[1], vals[2])
                    add.meta["val"] = aten.add.Tensor(mm.meta["val"], vals[0])
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            self.rewritten += 1

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def inductor_options() -> dict[str, Any]:
    """Inductor config for a compile in this process's mode: the pass under `add`, nothing (the
    default graph, the default cache keys) under `addmm`."""
    return {"post_grad_custom_post_pass": UnfusedResidual()} if mode() == "add" else {}
