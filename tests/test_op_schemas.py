"""The schemas of boundgen's own operators (`torch.library.triton_op`s).

An argument an op writes to must not have a default. torch 2.11's `ADInplaceOrView` kernel drops a
trailing argument equal to its default before it indexes the written ones: an op whose mutated
`counts=None` was left out ran into `IndexError: tuple index out of range` on every CUDA call, while
the CPU tests (Triton's interpreter) never dispatch through that key (34 GPU tests failed,
BENCHMARKS.md forty-first session). This checks every op's schema on the CPU.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# every module that registers a `boundgen::` operator
OP_MODULES = (
    "boundgen.attention.beam_decode",
    "boundgen.attention.own_slots",
    "boundgen.attention.segments",
    "boundgen.models.bucket_gated",
    "boundgen.models.layer_kernel",
    "boundgen.models.stream",
    "boundgen.models.stream_gated",
    "boundgen.models.stream_qkv",
    "boundgen.quant.triton_quant",
)


def _schemas() -> dict[str, torch.FunctionSchema]:
    for name in OP_MODULES:
        importlib.import_module(name)
    out = {}
    for name in dir(torch.ops.boundgen):
        packet = getattr(torch.ops.boundgen, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out[name] = packet.default._schema
    return out


def test_the_op_modules_register_operators():
    schemas = _schemas()
    # the streamed kernels' and the one-kernel layer's ops, among others
    assert {"stream_qkv", "stream_qkv_slot", "stream_gated", "fused_layers"} <= set(schemas)


def test_every_module_that_registers_an_operator_is_checked():
    # a new op module left out of OP_MODULES would go unchecked
    src = Path(__file__).resolve().parents[1] / "src"
    registering = {
        ".".join(path.relative_to(src).with_suffix("").parts)
        for path in src.rglob("*.py")
        if re.search(r'triton_op\(\s*"boundgen::', path.read_text())
    }
    assert registering == set(OP_MODULES)


def test_no_operator_argument_that_is_written_has_a_default():
    written = []
    for op, schema in _schemas().items():
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(f"{op}.{arg.name}")
                assert not arg.has_default_value(), (
                    f"boundgen::{op} writes `{arg.name}`, which has a default: callers that leave "
                    "it out fail on CUDA (torch drops trailing defaults before indexing the "
                    "mutated arguments); declare it without one"
                )
    assert "stream_qkv_slot.kv" in written and "fused_layers.counters" in written
