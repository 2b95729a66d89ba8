"""The one-kernel layer (`models/layer_kernel.py`) compiled for sm_90 on a machine without a GPU:
what each tile configuration costs before a device call spends minutes on it.

    python benchmarks/sm90_layer_kernel.py --configs default 64:32:7:7:2:9:4:6:0 --out sm90.json
    python benchmarks/sm90_layer_kernel.py --preset llama3.2-1b --configs 64:32:7:7:2:9:4:3:0:1

Per configuration (`layer_kernel.KNOBS` joined by ':', as `bench_layer_kernel.py --configs`): the
shared memory a program takes, its registers and spills (Triton's bundled `ptxas -v`), whether its
PTX waits for the kernels before it (programmatic launch) ahead of its first global access, the L2
prefetches it asks for (`PREFETCH`), and the loops of its TTGIR that load from global memory
without the software pipeline's asynchronous copies — each such loop waits for one load before it
issues the next (the fifty-fourth session found the norm's tile sum and the last slice's partial
sums written so; LLVM may still unroll a loop of a constant count, which the PTX then shows). The
kernel's arguments are those a real call passes (`fused_layers` on CPU tensors of a layer of
`--preset`'s shape, Qwen2.5-0.5B's by default, its launch captured, not run); the kernel is
compiled as the GPU launches it (all steps, with their barriers or FLOW's waits, and the
programmatic wait). Needs Triton with its CUDA backend (the CPU wheels have it) and no CUDA device;
the GPU image's Triton is 3.6 (`pip install --target DIR triton==3.6.0`, then `PYTHONPATH=DIR`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layer_kernel import build_model, knobs, w3_batch
from common import write_json

from boundgen.models import layer_kernel


def captured_launch(model, batch) -> dict:
    """The keyword arguments of the kernel's launch for the first layer of `batch` (CPU
    tensors), captured instead of launched."""
    found: dict = {}

    def capture(kernel):
        class Grid:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    found.setdefault("kwargs", {**dict(zip(kernel.arg_names, args)), **kwargs})

                return call

        return Grid()

    x = model.embed_tokens(batch.input_ids)
    cos, sin, squares, counters = layer_kernel.first_inputs(
        model, x, *model.rotary(batch.positions, x.dtype)
    )
    # the forward's first op call (`STACK`: every layer's, its weights found from the first's)
    layer, offsets = layer_kernel.launches(model)[0]
    args = layer_kernel.op_args(
        layer, x, squares, cos, sin, batch.attn.cu_seqlens, counters, offsets
    )
    real = layer_kernel.traceable
    layer_kernel.traceable = capture
    try:
        layer_kernel._fused_layers(*args)
    finally:
        layer_kernel.traceable = real
    return found["kwargs"]


# a tensor argument's element type, as Triton's signature names it
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def signature(kernel, kwargs: dict) -> tuple[dict, dict, dict]:
    """(Triton's signature, the constexprs, the launch options) of a captured call, as the GPU
    launch has them: every step with its barriers, the programmatic wait."""
    kwargs = {**kwargs, "PHASE": -1, "INTERPRET": False, "PDL": True}
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages")}
    sig, const = {}, {}
    for param, name in zip(kernel.params, kernel.arg_names):
        value = kwargs[name]
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
        else:
            sig[name] = "fp32" if isinstance(value, float) else "i32"
    return sig, const, options


def unpipelined_loops(ttgir: str) -> list[str]:
    """The innermost `scf.for` loops that load from global memory with `tt.load`: loads the
    pipeline did not turn into asynchronous copies, each waited for before the next iteration
    (an outer loop's own loads, such as a work item's epilogue, are not a chain and not listed;
    nor a loop over work items, `step %nprog`, a few a program)."""
    found, stack = [], []  # stack: [header line, own loads, has a nested loop, brace depth inside]
    for line in ttgir.splitlines():
        if re.search(r"\bscf\.for\b", line):
            if stack:
                stack[-1][2] = True
            stack.append([line.strip()[:90], 0, False, 0])
        elif stack and " tt.load " in line:
            stack[-1][1] += 1
        if stack:
            stack[-1][3] += line.count("{") - line.count("}")
            if stack[-1][3] <= 0:
                header, loads, nested, _ = stack.pop()
                if loads and not nested and "step %nprog" not in header:
                    found.append(f"{loads} load(s): {header}")
    return found


def compile_one(kernel, sig, const, options, ptxas: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    at = kernel.arg_names.index
    aligned = {(at(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(kernel, sig, {(at(n),): v for n, v in const.items()}, aligned)
    compiled = triton.compile(src, GPUTarget("cuda", 90, 32), options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp, "k.cubin"))],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {
        "shared_bytes": compiled.metadata.shared,
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": [int(spills.group(1)), int(spills.group(2))] if spills else None,
        **ptx_facts(compiled.asm["ptx"]),
        "unpipelined_loops": unpipelined_loops(compiled.asm["ttgir"]),
    }


def ptx_facts(ptx: str) -> dict:
    """Whether the kernel's first global load, store or copy comes after its grid dependency wait
    (nothing read before the kernels it depends on have written it), and how many L2 prefetches
    it issues."""
    body = ptx[ptx.index(".entry") :]
    wait = body.find("griddepcontrol.wait")
    accesses = [
        i for i in (body.find(op) for op in ("ld.global", "st.global", "cp.async")) if i >= 0
    ]
    return {
        "waits_first": 0 <= wait < min(accesses),
        "l2_prefetches": body.count("prefetch.global.L2"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["default"])
    ap.add_argument(
        "--preset", default="qwen2.5-0.5b", help="the layer's shape (checkpoints.PRESETS)"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # its kernels would be the interpreter's, which do not compile
        ap.error("TRITON_INTERPRET is set: this compiles the kernel; run it without")
    import triton
    from triton.backends.nvidia import compiler

    # the ptxas Triton itself compiles sm_90 with (3.9 bundles two; its older one fails on 3.9's
    # sm_90 PTX)
    ptxas = compiler.get_ptxas(90).path
    model = build_model(torch.device("cpu"), layers=1, preset=args.preset)
    batch = w3_batch(torch.device("cpu"))
    results = {"triton": triton.__version__, "preset": args.preset, "configs": {}}
    for config in args.configs:
        with torch.inference_mode(), knobs(config), contextlib.redirect_stdout(sys.stderr):
            kwargs = captured_launch(model, batch)
        kernel = layer_kernel._layer_kernel
        row = compile_one(kernel, *signature(kernel, kwargs), ptxas)
        results["configs"][config] = row
        print(
            f"{config}: shared {row['shared_bytes']} B, {row['registers']} registers, spills "
            f"{row['spill_bytes']}, waits first {row['waits_first']}, L2 prefetches "
            f"{row['l2_prefetches']}, loops loading unpipelined: {len(row['unpipelined_loops'])}"
        )
        for loop in row["unpipelined_loops"]:
            print(f"   {loop}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
