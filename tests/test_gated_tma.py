"""gate_up + SiLU·mul at a bucket's rows as one TMA-fed GEMM (`models/gated_tma.py`) against the
plain projection and SiLU·mul it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`, its tensor descriptors included; with CUDA the same tests run the
compiled kernel, and the `gpu` tests run a decoder layer inside `torch.compile` and an
AOTInductor-sized shape against the plain layer.
"""

from __future__ import annotations

import pytest
import torch
from small_layer import small_config
from torch import nn

pytest.importorskip("triton")

from boundgen.models import gated_tma, stream, stream_gated
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

if not gated_tma.AVAILABLE:
    pytest.skip("Triton without host-side tensor descriptors", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMALL = (32, 16, 32, 2, 4, 2)  # a tile the interpreter walks quickly: several tiles a program


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Streaming up to 16 rows, the bucket kernel on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 16)
    monkeypatch.setattr(gated_tma, "GATED", True)


def _randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize(
    ("m", "k", "i"),
    # one K step; K past a step and not a multiple of it; rows and columns not multiples of the
    # tile (TMA fills past the edges with zeros and clips the stores)
    [(32, 32, 16), (70, 136, 40), (100, 96, 56)],
)
def test_the_kernel_is_silu_of_gate_times_up(m, k, i):
    g = torch.Generator().manual_seed(m * k + i)
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(g, m, k, dtype=dtype)
        w = _randn(g, 2 * i, k, dtype=dtype, scale=k**-0.5)
        with stream.forced():
            got = gated_tma.launch(x, w, SMALL if not CUDA else None)
        want = stream_gated.reference(x, w)
        assert got.dtype == dtype and got.shape == (m, i)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)


def test_every_tile_is_walked_by_some_program():
    """Fewer programs than tiles (the interpreter's three; an SM each on a GPU): each program
    walks every PROGRAMS-th tile, GROUP_M row tiles together, and no output tile is left
    unwritten (the output starts as torch.empty: a skipped tile would hold garbage or NaN)."""
    g = torch.Generator().manual_seed(7)
    x = _randn(g, 7 * 32, 32)
    w = _randn(g, 2 * 5 * 16, 32, scale=0.2)
    with stream.forced():
        got = gated_tma.launch(x, w, SMALL if not CUDA else None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, stream_gated.reference(x, w), rtol=2e-5, atol=2e-5)


def test_which_calls_the_kernel_takes(monkeypatch):
    layer = DecoderLayer(small_config()).to(DEV)
    gate_up = layer.mlp.gate_up_proj
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=torch.bfloat16)
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=torch.bfloat16)
    with stream.forced(), torch.no_grad():
        assert gated_tma.applies(many, gate_up)
        assert not gated_tma.applies(few, gate_up)  # few rows stream (`stream_gated`)
        assert not gated_tma.applies(many, Fp8Linear.from_linear(gate_up, mode="emulate"))
        odd = torch.zeros(stream.MAX_ROWS + 1, 60, device=DEV, dtype=torch.bfloat16)
        assert not gated_tma.applies(odd, nn.Linear(60, 128, bias=False))  # 120-byte rows
        assert not gated_tma.applies(many, nn.Linear(64, 128, bias=True).to(DEV))
        with gated_tma.enabled(False):
            assert not gated_tma.applies(many, gate_up)
    if not CUDA:  # outside the interpreter's switch, CPU tensors never take it
        assert not gated_tma.applies(many, gate_up)
    monkeypatch.setattr(gated_tma, "GATED", False)
    with gated_tma.enabled(True):
        assert gated_tma.GATED
    assert not gated_tma.GATED  # the switch restored


def test_a_decoder_layer_with_the_kernel_equals_it_without(monkeypatch):
    """The MLP block (x + down(SiLU(gate)·up)) at more rows than stream: with the kernel against
    the same layer without it. Float32 on the CPU (the interpreter), bf16 on CUDA."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    layer = DecoderLayer(small_config(intermediate_size=200)).to(DEV, dtype)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.1)
    x = torch.randn(40, 64, device=DEV, dtype=dtype)
    calls, gated = [], gated_tma.gated

    def spy(h, w):
        calls.append(tuple(w.shape))
        return gated(h, w)

    monkeypatch.setattr(gated_tma, "gated", spy)
    if not CUDA:  # the interpreter walks the default tile's 128 x 64 slowly: a small one
        monkeypatch.setattr(gated_tma, "TILE", SMALL)
    with torch.no_grad(), stream.forced():
        with gated_tma.enabled(False):
            plain = layer.mlp_block(x)
        assert calls == []
        got = layer.mlp_block(x)
    assert calls == [(400, 64)]  # gate_up's weight [2 × 200, 64]
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == plain.dtype and got.shape == plain.shape
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1920, 300])
def test_a_compiled_layer_with_the_kernel_equals_the_plain_one(rows):
    """Inside `torch.compile` (the op traced with its tensor descriptors) at W2's 1,920 rows and
    a bucket's rows past the tile, Qwen2.5-0.5B's MLP shape, against the plain layer."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, head_dim=64)
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.02)
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(layer.mlp_block)
    with torch.no_grad():
        got = compiled(x)
        with gated_tma.enabled(False):
            want = layer.mlp_block(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
