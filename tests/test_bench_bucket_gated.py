"""`benchmarks/bench_bucket_gated.py` (CUDA only to time): every way it computes gate_up with
SiLU·mul as the epilogue — the engine's kernel, host- and device-made TMA descriptors, the weight's
rows interleaved, persistent programs with and without warp specialization — gives the float32
oracle's numbers (Triton's CPU interpreter: conftest.py sets `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_bucket_gated as bench
from hopper import run_in_child

# rows past the row tiles, several column tiles, two K steps: (rows, columns, K, GROUP_M, warps,
# stages); the persistent variants' 4 programs (`bucket_gated._programs` on the CPU) walk 9 tiles
TILE = (16, 16, 32, 2, 4, 2)


@pytest.mark.parametrize("variant", bench.VARIANTS)
def test_every_variant_computes_silu_mul_of_gate_up(variant):
    rows, k, inter = 40, 64, 48
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(2 * inter, k, generator=g) * 0.1
    y = x @ w.T
    want = F.silu(y[:, :inter]) * y[:, inter:]
    weight = bench.interleave(w) if variant.endswith("-inter") else w
    got = bench.gated_variant(x, weight, TILE, variant)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if variant in bench.PERSISTENT:  # the interpreter's "compiled" warps: the tile's
        assert bench.COMPILED_WARPS[f"{variant} 16x16x32x2x4x2"] == 4


def test_interleave_puts_each_gate_row_before_its_up_row():
    w = torch.arange(8.0)[:, None].repeat(1, 3)  # rows 0..3 gate, 4..7 up
    assert bench.interleave(w)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


WARP_SPECIALIZED = """
import sys

sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import bench_bucket_gated as bench
from boundgen.models import bucket_gated

fn = bench._gated_persistent_kernel
ws_tile = bench.ws_tile(bucket_gated.GATED_TILE)
cases = (("ws_tile", ws_tile, False), ("8 warps", (128, 128, 64, 8, 8, 3), False),
         ("ws_tile inter", ws_tile, True))
for label, tile, inter in cases:
    block_m, block_n, block_k, group_m, warps, stages = tile
    const = dict(INTER_N=4864, K=896, NUM_PROGRAMS=132, WARP_SPECIALIZE=True, INTERLEAVED=inter,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m)
    sig = {"X": "*bf16", "W": "*bf16", "Out": "*bf16", "M": "i32"}
    sig.update(dict.fromkeys(const, "constexpr"))
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("X", "W", "Out")}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, aligned)
    options = dict(num_warps=warps, num_stages=stages)
    kernel = triton.compile(src, GPUTarget("cuda", 90, 32), options)
    print(label, "setmaxnreg" in kernel.asm["ptx"], kernel.metadata.num_warps)
"""


def test_the_warp_specialized_variant_compiles_warp_specialized_for_hopper():
    """`tma-ws` at `ws_tile`'s 4 warps compiles for sm_90 (Triton's bundled ptxas, no GPU) into
    a load warpgroup and two MMA warpgroups that trade registers (`setmaxnreg`, 12 warps), its
    one-dot `tma-ws-inter` too; at 8 warps Triton's Hopper pass leaves the loop as it is — why
    `ws_tile` sets 4."""
    out = run_in_child(WARP_SPECIALIZED, str(Path(bench.__file__).parent)).splitlines()
    assert "ws_tile True 12" in out
    assert "8 warps False 8" in out
    assert "ws_tile inter True 12" in out
