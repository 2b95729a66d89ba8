"""gate_up + SiLU·mul as one weight-streaming GEMM (`models/stream_gated.py`) against the plain
projection and SiLU·mul it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`; with CUDA the same tests run the compiled kernel, and the `gpu` test runs
a decoder layer inside `torch.compile` against the plain layer.
"""

from __future__ import annotations

import pytest
import torch
from hopper import compile_in_child
from small_layer import check_gated, small_config, spread_weights
from torch import nn

pytest.importorskip("triton")

from boundgen.models import stream, stream_gated
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Streaming on (64 rows) and gate_up's kernel on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 64)
    monkeypatch.setattr(stream_gated, "GATED", True)


@pytest.mark.parametrize(
    ("m", "k", "i"),
    # one K step, K past a step and not a multiple of it, columns not a multiple of BLOCK_N, rows
    # from 1 to past one 64-row block
    [(1, 96, 48), (5, 300, 70), (17, 130, 40), (64, 256, 100), (70, 128, 33)],
)
def test_the_kernel_is_silu_of_gate_times_up(m, k, i):
    x, w = check_gated(stream_gated.gated, m, k, i)
    # the oracle itself: gate is the weight's first half, up its second
    x, w = x.float(), w.float()
    gate, up = x @ w[:i].T, x @ w[i:].T
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(stream_gated.reference(x, w), want, rtol=2e-5, atol=2e-5)


def test_the_kernel_wants_gate_and_up_of_x_s_width():
    x = torch.zeros(4, 100, device=DEV)
    with stream.forced(), pytest.raises(RuntimeError):  # K 100 against the weight's 96
        stream_gated.gated(x, torch.zeros(8, 96, device=DEV))
    with stream.forced(), pytest.raises(RuntimeError):  # 7 rows: no even split in gate and up
        stream_gated.gated(x, torch.zeros(7, 100, device=DEV))


def test_which_calls_the_kernel_takes(monkeypatch):
    layer = DecoderLayer(small_config()).to(DEV)
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=torch.bfloat16)
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=torch.bfloat16)
    gate_up = layer.mlp.gate_up_proj
    with stream.forced(), torch.no_grad():
        assert stream_gated.applies(few, gate_up)
        assert not stream_gated.applies(many, gate_up)  # more rows than stream.MAX_ROWS
        assert not stream_gated.applies(few, Fp8Linear.from_linear(gate_up, mode="emulate"))
        with stream.rows_up_to(0):  # streaming off: this kernel too
            assert not stream_gated.applies(few, gate_up)
        with stream_gated.enabled(False):
            assert not stream_gated.applies(few, gate_up)
    monkeypatch.setattr(stream_gated, "GATED", False)
    with stream_gated.enabled(True):
        assert stream_gated.GATED
    assert not stream_gated.GATED  # the switch restored


@pytest.mark.parametrize("down_bias", [False, True])
def test_a_decoder_layer_with_the_kernel_equals_it_without(down_bias, monkeypatch):
    """The MLP block (x + down(SiLU(gate)·up)) with gate_up's kernel against the same layer
    without it: with `down` streamed, or with a `down` the streamed GEMM does not take (a bias:
    then `down` takes the kernel's output as it is). Float32 on the CPU (the interpreter), bf16 on
    CUDA."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    layer = DecoderLayer(small_config(intermediate_size=200)).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)
    if down_bias:
        layer.mlp.down_proj = nn.Linear(200, 64, bias=True).to(DEV, dtype)
    x = torch.randn(12, 64, device=DEV, dtype=dtype)
    calls, gated = [], stream_gated.gated

    def spy(h, w):
        calls.append(tuple(w.shape))
        return gated(h, w)

    monkeypatch.setattr(stream_gated, "gated", spy)
    with torch.no_grad():
        with stream_gated.enabled(False), stream.forced():
            plain = layer.mlp_block(x)
        assert calls == []
        with stream.forced():
            got = layer.mlp_block(x)
    assert calls == [(400, 64)]  # gate_up's weight [2 × 200, 64]
    with stream.forced(), torch.no_grad():  # which `down` path the block took
        assert stream.applies(x, layer.mlp.down_proj) is not down_bias
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == plain.dtype and got.shape == plain.shape
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)


HOPPER = """
from boundgen.models import stream_gated

fn = stream_gated._gated_kernel
k, i, block_m = (int(a) for a in sys.argv[1:4])
block_n, block_k, warps, stages = stream_gated.tile_for(int(sys.argv[4]))
const = dict(K=k, I=i, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32",
             INTERPRET=False, PDL=True)
sig = {"X": "*bf16", "W": "*bf16", "Out": "*bf16", "M": "i32", "stride_xm": "i32"}
sig.update(dict.fromkeys(const, "constexpr"))
aligned = ["X", "W", "Out", "stride_xm"]
"""


@pytest.mark.parametrize("block_m,rows", [(16, 16), (64, 64), (64, 128)])
def test_the_kernel_compiles_for_hopper(block_m, rows):
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed) with the tile `tile_for`
    gives the rows: Qwen2.5-0.5B's gate_up (K 896, I 4,864) at a decode step's 16 rows, a
    prompt's 64, and 128 (two row tiles)."""
    out = compile_in_child(HOPPER, "896", "4864", str(block_m), str(rows))
    assert "waits first True" in out  # programmatic launch: nothing read before the wait


@pytest.mark.gpu
def test_a_compiled_layer_with_the_kernel_equals_the_plain_one():
    """Inside `torch.compile` (the op traced, `down` streamed after it) at 16, 64 and 128 rows,
    the rows marked dynamic as the compiled beam layers' are."""
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, head_dim=64)
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    spread_weights(layer, 0.02)
    compiled = torch.compile(layer.mlp_block)
    for rows in (16, 64, 128):
        x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            with stream.rows_up_to(128):
                got = compiled(x)
            with stream.rows_up_to(0):
                want = layer.mlp_block(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
