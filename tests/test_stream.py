"""The weight-streaming residual GEMM (`models/stream.py`) against the plain layers it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`; with CUDA the same tests run the compiled kernel, and the `gpu` test runs
a decoder layer inside `torch.compile` against the plain layer.
"""

from __future__ import annotations

import pytest
import torch
from hopper import compile_in_child
from small_layer import randn, small_config, spread_weights

pytest.importorskip("triton")

from boundgen.models import stream
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """The kernel on (64 rows) whatever `BOUNDGEN_STREAM_MAX_ROWS` says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 64)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    # K in one slice, split unevenly (the last slice short), past a BLOCK_K step; rows from 1 to
    # past one 64-row block; columns not a multiple of BLOCK_N
    [(1, 96, 48), (5, 300, 130), (16, 640, 64), (17, 1000, 70), (64, 256, 200), (70, 512, 96)],
)
def test_the_partials_are_the_k_slices_products(m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    x, w = randn(g, m, k), randn(g, n, k, scale=k**-0.5)
    with stream.forced():
        got = stream.partials(x, w)
    want = stream.reference_partials(x, w)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.sum(0).cpu(), (x @ w.T).cpu(), rtol=2e-5, atol=2e-5)


def test_k_splits_by_about_256_and_at_most_8():
    """o_proj's 896 → 4, `down`'s 4,864 → 8, a short K → 1, a long one at most 8."""
    assert [stream.split_k(k) for k in (64, 256, 896, 1024, 4864, 16384)] == [1, 1, 4, 4, 8, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_residual_adds_the_residual_in_float32(dtype):
    g = torch.Generator().manual_seed(3)
    x, w, r = randn(g, 9, 384, dtype=dtype), randn(g, 80, 384, dtype=dtype), randn(g, 9, 80)
    r = r.to(dtype)
    with stream.forced(), torch.no_grad():
        got = stream.linear_residual(x, w, r)
    want = (r.float() + x.float() @ w.float().T).to(dtype)
    assert got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_which_calls_the_kernel_takes():
    layer = DecoderLayer(small_config()).to(DEV)
    few = torch.zeros(stream.MAX_ROWS, 96, device=DEV)
    many = torch.zeros(stream.MAX_ROWS + 1, 96, device=DEV)
    down, qkv = layer.mlp.down_proj, layer.self_attn.qkv_proj
    with stream.forced(), torch.no_grad():
        assert stream.applies(few, down) == (CUDA is False)  # float32 on CUDA: cuBLAS
        assert stream.applies(few.to(torch.bfloat16), down)
        assert not stream.applies(many.to(torch.bfloat16), down)  # more rows than MAX_ROWS
        assert not stream.applies(few[:, :64].to(torch.bfloat16), qkv)  # a bias: not this op
        fp8 = Fp8Linear.from_linear(down, mode="emulate")
        assert not stream.applies(few.to(torch.bfloat16), fp8)  # FP8 layers keep their path
        with stream.rows_up_to(0):
            assert not stream.applies(few.to(torch.bfloat16), down)
    if not CUDA:
        with torch.no_grad():
            assert not stream.applies(few, down)  # outside forced(): never the interpreter
    bf16 = layer.to(torch.bfloat16)
    with stream.forced():  # grad on, weights that want it: training keeps the plain op
        assert not stream.applies(few.to(torch.bfloat16), bf16.mlp.down_proj)


def test_a_decoder_layer_with_the_kernel_equals_it_without(monkeypatch):
    """o_proj + residual and the MLP's down + residual (its K split in two) through the kernel
    against the same layer without it (qkv stays on the plain op). Float32 on the CPU (the
    interpreter), bf16 on CUDA."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = small_config(intermediate_size=640)
    assert stream.split_k(cfg.intermediate_size) == 2
    layer = DecoderLayer(cfg).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)
    x = torch.randn(12, 64, device=DEV, dtype=dtype)
    o = torch.randn(12, cfg.num_heads * cfg.head_dim, device=DEV, dtype=dtype)
    cos = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)
    sin = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)

    def parts():
        q, k, v = layer.attention_input(x, cos, sin)
        return q, k, v, layer.attention_output(x, o), layer.mlp_block(x)

    calls, partials = [], stream.partials

    def spy(h, w):
        calls.append(w.shape[0])
        return partials(h, w)

    monkeypatch.setattr(stream, "partials", spy)
    with torch.no_grad():
        with stream.rows_up_to(0):
            plain = parts()
        assert calls == []
        with stream.forced(), stream.rows_up_to(stream.MAX_ROWS):
            got = parts()
    assert calls == [64, 64]  # o_proj, down
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, plain, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


HOPPER = """
from boundgen.models import stream

fn = stream._stream_kernel
k, n, block_m = (int(a) for a in sys.argv[1:4])
per = stream.k_per(k, stream.split_k(k))
const = dict(K=k, N=n, K_PER=per, BLOCK_M=block_m, BLOCK_N=stream.BLOCK_N, BLOCK_K=stream.BLOCK_K,
             PRECISION="tf32", INTERPRET=False, PDL=True)
sig = {"X": "*bf16", "W": "*bf16", "Parts": "*fp32", "M": "i32", "stride_xm": "i32"}
sig.update(dict.fromkeys(const, "constexpr"))
aligned = ["X", "W", "Parts", "stride_xm"]
warps, stages = stream.NUM_WARPS, stream.NUM_STAGES
"""


@pytest.mark.parametrize(("k", "n", "block_m"), [(896, 896, 16), (4864, 896, 64)])
def test_the_kernel_compiles_for_hopper(k, n, block_m):
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed): o_proj and `down`."""
    out = compile_in_child(HOPPER, str(k), str(n), str(block_m))
    assert "waits first True" in out  # programmatic launch: nothing read before the wait


@pytest.mark.gpu
def test_a_compiled_layer_with_the_kernel_equals_the_plain_one():
    """Inside `torch.compile` (the op traced, its partials summed by Inductor's residual kernel)
    at 16, 64 and 128 rows, the rows marked dynamic as the compiled beam layers' are."""
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, head_dim=64)
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    spread_weights(layer, 0.02)

    def parts(x, o, cos, sin):
        q, k, v = layer.attention_input(x, cos, sin)
        return q, k, v, layer.attention_output(x, o), layer.mlp_block(x)

    compiled = torch.compile(parts)
    for rows in (16, 64, 128):
        x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
        # a RoPE table's values (|cos|, |sin| ≤ 1): Inductor's rotation rounds once where eager
        # rounds each product, and N(0, 1) factors up to ~4 made that bf16 gap 0.039 in one of
        # 57,344 values (H100, thirty-eighth session)
        angle = torch.rand(rows, 1, 32, device="cuda") * 6.3
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        for t in (x, o, cos, sin):
            torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            with stream.rows_up_to(128):
                got = compiled(x, o, cos, sin)
            with stream.rows_up_to(0):
                want = parts(x, o, cos, sin)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
