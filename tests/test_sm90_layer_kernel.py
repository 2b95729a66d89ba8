"""`benchmarks/sm90_layer_kernel.py`: the one-kernel layer compiled for sm_90 without a GPU, with
what its configuration costs (shared memory, registers, loops that wait for each load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sm90_layer_kernel as tool  # noqa: E402

# TTGIR's shape: a work-item loop whose epilogue loads (not a chain) around a K loop whose loads
# are asynchronous copies, then a sum over slices that loads in turn
TTGIR = """
    scf.for %item = %pid to %c126_i32 step %nprog  : i32 {
      %a = scf.for %k = %0 to %1 step %c64_i32 iter_args(%x = %y) -> (tensor<32x64xf32>) : i32 {
        %c = ttg.async_copy_global_to_local %p, %q : tensor<32x64x!tt.ptr<bf16>>
        scf.yield %c : tensor<32x64xf32>
      }
      %e = tt.load %bias : tensor<32x!tt.ptr<bf16>>
      %t = scf.for %s = %c0_i32 to %c7_i32 step %c1_i32 iter_args(%u = %v) -> (tensor<32x64xf32>) {
        %l = tt.load %parts : tensor<32x64x!tt.ptr<f32>>
        scf.yield %l : tensor<32x64xf32>
      }
    }
"""


def test_only_inner_loops_that_load_in_turn_are_listed():
    found = tool.unpipelined_loops(TTGIR)
    assert len(found) == 1 and found[0].startswith("1 load(s): %t = scf.for %s")
    # a loop over work items (a few a program) is no chain, innermost or not
    items = "    scf.for %h = %pid to %c14_i32 step %nprog  : i32 {\n      %q = tt.load %p\n    }\n"
    assert tool.unpipelined_loops(items) == []


def compiled(tmp_path, *args: str) -> dict:
    """The tool's rows (configuration → row) for `args`, run in a child: this process runs
    Triton's interpreter (conftest.py), the tool compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = tmp_path / "sm90.json"
    res = subprocess.run(
        [sys.executable, tool.__file__, "--out", str(out), *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if "No module named" in res.stderr:
        pytest.skip(f"this triton has no CUDA compiler API: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())["configs"]


def fits_one_program_a_multiprocessor(row: dict) -> bool:
    """228 KB of shared memory and 255 registers a thread, nothing spilled."""
    return (
        0 < row["shared_bytes"] <= 227 * 1024
        and 0 < row["registers"] <= 255
        and row["spill_bytes"] == [0, 0]
    )


def test_the_layer_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    row = compiled(tmp_path)["default"]
    # the default's sums load all at once; nothing read before the kernels before it are done
    assert fits_one_program_a_multiprocessor(row) and row["unpipelined_loops"] == []
    assert row["waits_first"] and row["l2_prefetches"] == 0


# (knobs, L2 prefetches asked for): the GEMMs' K not cut, the L2 prefetches, FLOW's waits
# instead of the barriers (with the prefetches and a deeper pipeline), every layer in one launch
# (STACK: the steps a called function in the loop over layers)
KNOB_CASES = {
    "64:32:1:1:1:1": False,
    "64:32:7:7:2:9:4:3:128": True,
    "64:32:7:7:2:9:4:6:1:1": True,
    "64:32:7:7:2:9:4:3:0:0:1": False,
}


@pytest.mark.parametrize(
    ("preset", "configs"),
    [("qwen2.5-0.5b", list(KNOB_CASES)), ("llama3.2-1b", ["64:32:7:7:2:9:4:6:1:1"])],
)
def test_every_form_of_the_layer_kernel_compiles_for_sm90(tmp_path, preset, configs):
    """The kernel's other forms, as a real call of each layer shape launches them (Llama-3.2-1B's:
    no q/k/v bias, 32 heads over 8)."""
    rows = compiled(tmp_path, "--preset", preset, "--configs", *configs)
    for config in configs:
        row = rows[config]
        assert fits_one_program_a_multiprocessor(row), (config, row)
        assert row["waits_first"], config  # programmatic launch: nothing read before the wait
        assert (row["l2_prefetches"] > 0) == KNOB_CASES[config], (config, row)
