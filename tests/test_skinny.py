"""The fused few-row linear layers (`models/skinny.py`) against the eager ops they replace.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `skinny.forced()`; with CUDA the same tests run the compiled kernels, and the `gpu` tests
run a decoder layer inside `torch.compile` against the unfused layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from boundgen.config import ModelConfig
from boundgen.models import skinny
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SHAPES = [(1, 64, 48), (7, 96, 80), (16, 128, 64), (40, 48, 200), (64, 80, 32)]


def _randn(g, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _close(got, want, dtype, bf16_tol=3e-2):
    # float32: the summation order only; bf16: a few units in the last place of the output (a
    # product of two rounded GEMM outputs, SiLU·mul, doubles the units: `bf16_tol`)
    tol = {torch.float32: 2e-5, torch.bfloat16: bf16_tol}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_norm_linear_is_rmsnorm_then_the_linear_layer(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * k + n)
    x = _randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w, bias = _randn(g, n, k, scale=k**-0.5, dtype=dtype), _randn(g, n, dtype=dtype)
    with skinny.forced():
        for b in (bias, None):
            got = torch.ops.boundgen.norm_linear(x, norm, 1e-6, w, b)
            _close(got, skinny.reference_norm_linear(x, norm, 1e-6, w, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_norm_gated_is_rmsnorm_gate_up_and_silu_mul(m, k, n, dtype):
    g = torch.Generator().manual_seed(m + k * n)
    x = _randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w = _randn(g, 2 * n, k, scale=k**-0.5, dtype=dtype)
    with skinny.forced():
        got = torch.ops.boundgen.norm_gated(x, norm, 1e-6, w)
    _close(got, skinny.reference_norm_gated(x, norm, 1e-6, w), dtype, bf16_tol=6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_residual_adds_the_residual(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = _randn(g, m, k, dtype=dtype), _randn(g, n, k, scale=k**-0.5, dtype=dtype)
    res = _randn(g, m, n, scale=4.0, dtype=dtype)
    with skinny.forced():
        got = torch.ops.boundgen.linear_residual(x, w, res)
    _close(got, skinny.reference_linear_residual(x, w, res), dtype)


def test_strided_rows_are_read_by_their_stride():
    """A view whose rows are not packed (a slice of wider rows) gives what its copy gives."""
    g = torch.Generator().manual_seed(3)
    wide = _randn(g, 9, 2 * 64)
    x, w, res = wide[:, :64], _randn(g, 32, 64, scale=0.125), _randn(g, 9, 32)
    with skinny.forced():
        got = torch.ops.boundgen.linear_residual(x, w, res)
    _close(got, skinny.reference_linear_residual(x.contiguous(), w, res), torch.float32)


def _config(**kw) -> ModelConfig:
    base = dict(
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        task="causal_lm",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=True,
        qk_norm=False,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_which_calls_the_kernels_take():
    layer = DecoderLayer(_config()).to(DEV)
    few, many = torch.zeros(skinny.MAX_ROWS, 64, device=DEV), torch.zeros(65, 64, device=DEV)
    lin = layer.self_attn.qkv_proj
    with skinny.forced():
        assert skinny.applies(few, lin) == (CUDA is False)  # float32 on CUDA: cuBLAS
        assert skinny.applies(few.to(torch.bfloat16), lin)
        assert not skinny.applies(many.to(torch.bfloat16), lin)  # more rows than MAX_ROWS
        fp8 = Fp8Linear.from_linear(lin, mode="emulate")
        assert not skinny.applies(few.to(torch.bfloat16), fp8)  # FP8 layers keep their path
    if not CUDA:
        assert not skinny.applies(few, lin)  # outside forced(): never the interpreter


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_decoder_layer_with_the_kernels_equals_it_without(qk_norm):
    """The layer's three fused parts against the same layer unfused (float32 on the CPU: the
    interpreter; bf16 on CUDA) — every weight path used: qkv bias, Qwen3's q/k norms."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = _config(family="qwen3" if qk_norm else "qwen2", qk_norm=qk_norm, qkv_bias=not qk_norm)
    layer = DecoderLayer(cfg).to(DEV, dtype)
    for p in layer.parameters():  # norms away from 1, so a dropped norm weight shows
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.1)
    x = torch.randn(12, 64, device=DEV, dtype=dtype)
    o = torch.randn(12, cfg.num_heads * cfg.head_dim, device=DEV, dtype=dtype)
    cos = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)
    sin = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)

    def parts():
        return (
            *layer.attention_input(x, cos, sin),
            layer.attention_output(x, o),
            layer.mlp_block(x),
        )

    plain = parts() if not CUDA else None
    with skinny.forced():
        fused = parts()
    if CUDA:
        skinny_max, skinny.MAX_ROWS = skinny.MAX_ROWS, 0  # the unfused path on CUDA
        try:
            plain = parts()
        finally:
            skinny.MAX_ROWS = skinny_max
    for got, want in zip(fused, plain, strict=True):
        _close(got, want, dtype, bf16_tol=6e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_kernels_inside_torch_compile_with_dynamic_rows():
    """A Qwen2.5-0.5B-shaped layer (K 896 in 7 tiles, up to 76 column programs): compiled with
    the rows dynamic (as the beam layers are), the fused parts give the eager fused parts' bits;
    the q/k/v within bf16 noise (RoPE is fused by Inductor there)."""
    torch.manual_seed(0)
    cfg = _config(
        hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64
    )
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.02)
    compiled = {
        name: torch.compile(getattr(layer, name), fullgraph=True)
        for name in ("attention_input", "attention_output", "mlp_block")
    }
    for m in (16, 40, 64):
        x = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
        cos = torch.rand(m, 1, 32, device="cuda", dtype=torch.bfloat16)
        sin = (1 - cos.float() ** 2).sqrt().to(torch.bfloat16)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(o, 0)
        assert torch.equal(compiled["mlp_block"](x), layer.mlp_block(x))
        assert torch.equal(compiled["attention_output"](x, o), layer.attention_output(x, o))
        for got, want in zip(
            compiled["attention_input"](x, cos, sin),
            layer.attention_input(x, cos, sin),
            strict=True,
        ):
            _close(got, want, torch.bfloat16)
