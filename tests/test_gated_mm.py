"""RMSNorm + gate_up + SiLU·mul in one kernel for prefill-sized row counts (`models/gated_mm.py`).

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`)
under `skinny.forced()`, in float32 (the interpreter's bf16 casts do not round to nearest); what
only the compiler checks (layouts, shared memory, registers of the two accumulators) is checked
by compiling it for sm_90 in a child process; the `gpu` test runs it in bf16 on the device."""

from __future__ import annotations

import pytest
import torch
from hopper import compile_in_child
from test_skinny import _config
from torch import nn

pytest.importorskip("triton")

from boundgen.models import gated_mm, skinny
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

if not gated_mm.AVAILABLE:
    pytest.skip("no triton", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# tiles the interpreter runs fast: one block, several (a partial last one), grouped row blocks
SMALL_TILES = [(16, 16, 16, 1, 4, 2), (16, 32, 32, 2, 4, 2), (32, 16, 16, 3, 4, 2)]


def _inputs(m, k, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(DEV)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w = (torch.randn(2 * n, k, generator=g) * k**-0.5).to(dtype).to(DEV)
    return x, norm, w


@pytest.mark.skipif(CUDA, reason="the interpreter's check (CPU)")
@pytest.mark.parametrize("tile", SMALL_TILES)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 16, 16), (37, 48, 40), (70, 32, 24)])
def test_kernel_is_rmsnorm_then_gate_up_then_silu_mul(m, k, n, tile):
    """Every output tile, in any row-block grouping, is eager's RMSNorm → gate_up → SiLU·mul up to
    the summation order (float32); rows, columns and K that the tile does not divide are masked."""
    x, norm, w = _inputs(m, k, n, seed=m * k + n)
    x[min(3, m - 1)] = 0  # an all-zero row: RMSNorm's eps keeps it finite
    with skinny.forced():
        got = gated_mm.launch_norm_gated_mm(x, norm, 1e-6, w, tile)
    want = skinny.reference_norm_gated(x, norm, 1e-6, w)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(CUDA, reason="the interpreter's check (CPU)")
def test_op_takes_rows_with_a_stride():
    """The registered op on a row-strided view (a slice of a wider buffer), default tiles."""
    x, norm, w = _inputs(20, 32, 16, seed=5)
    wide = torch.zeros(20, 48)
    wide[:, :32] = x
    with skinny.forced():
        got = torch.ops.boundgen.norm_gated_mm(wide[:, :32], norm, 1e-5, w)
    torch.testing.assert_close(got, skinny.reference_norm_gated(x, norm, 1e-5, w))


def _layer() -> DecoderLayer:
    torch.manual_seed(0)
    layer = DecoderLayer(_config()).eval()  # hidden 64, intermediate 96
    with torch.no_grad():
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return layer


def test_applies_only_when_on_and_to_enough_plain_rows(monkeypatch):
    layer = _layer()
    x = torch.randn(40, 64)
    with skinny.forced(), torch.no_grad():
        assert not gated_mm.applies(x, layer.mlp)  # off by default
        monkeypatch.setattr(gated_mm, "MIN_ROWS", 32)
        assert gated_mm.applies(x, layer.mlp) == (not CUDA)  # float32 on CUDA: cuBLAS
        assert not gated_mm.applies(x[:31], layer.mlp)  # fewer rows than MIN_ROWS
        fp8 = nn.Module()
        fp8.gate_up_proj = Fp8Linear.from_linear(layer.mlp.gate_up_proj, mode="emulate")
        assert not gated_mm.applies(x, fp8)  # FP8 layers keep their own path
    assert not gated_mm.applies(x, layer.mlp)  # no interpreter without forced()


@pytest.mark.skipif(CUDA, reason="the interpreter's check (CPU)")
def test_decoder_mlp_block_takes_the_kernel_when_on(monkeypatch):
    """`DecoderLayer.mlp_block` through the kernel equals the plain path (float32)."""
    layer = _layer()
    x = torch.randn(24, 64) * 2
    with torch.no_grad():
        want = layer.mlp_block(x)
        monkeypatch.setattr(gated_mm, "MIN_ROWS", 8)
        calls = []
        real = gated_mm.launch_norm_gated_mm
        monkeypatch.setattr(
            gated_mm, "launch_norm_gated_mm", lambda *a, **k: calls.append(1) or real(*a, **k)
        )
        with skinny.forced():
            got = layer.mlp_block(x)
    assert calls, "the kernel was not used"
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


HOPPER = """
from boundgen.models import gated_mm

block_m, block_n, block_k, group_m, warps, stages = (int(a) for a in sys.argv[1:7])
fn = gated_mm._norm_gated_mm_kernel
const = dict(
    K=896, N=4864, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
    INTERPRET=False,
)
sig = {n: "i32" for n in fn.arg_names}
sig.update({n: "*bf16" for n in ("x_ptr", "norm_ptr", "w_ptr", "out_ptr")})
sig["eps"] = "fp64"  # Inductor's launcher types a Python float fp64
sig.update(dict.fromkeys(const, "constexpr"))
aligned = [n for n in fn.arg_names if sig[n].startswith("*")]
"""


@pytest.mark.parametrize(
    "tile", [gated_mm.DEFAULT_TILE, (128, 128, 64, 8, 8, 3), (64, 64, 32, 8, 4, 4)]
)
def test_kernel_compiles_for_hopper(tile):
    """The default tile and the sweep's largest and smallest compile for sm_90 (Triton's bundled
    ptxas, no GPU): two [BLOCK_M, BLOCK_N] float32 accumulators fit, the eps typed fp64."""
    compile_in_child(HOPPER, *map(str, tile))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 777, 8192])
def test_gpu_kernel_matches_eager_in_bf16(m):
    """bf16 at Qwen2.5-0.5B's MLP shape on the device, default and swept tiles."""
    x, norm, w = _inputs(m, 896, 4864, seed=m, dtype=torch.bfloat16)
    want = skinny.reference_norm_gated(x, norm, 1e-6, w)
    for tile in (None, *gated_mm.SWEEP[::5]):
        got = gated_mm.launch_norm_gated_mm(x, norm, 1e-6, w, tile)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
