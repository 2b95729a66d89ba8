"""A one-layer Qwen2-shaped `ModelConfig` small enough for Triton's CPU interpreter, random
weights for it, and random inputs on the device the kernels' tests run on (the few-row and
bucket kernels' tests: `test_stream*.py`, `test_bucket_gated.py`, `test_layer_kernel.py`)."""

from __future__ import annotations

import torch

from boundgen.config import ModelConfig


def small_config(**kw) -> ModelConfig:
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


def randn(g: torch.Generator, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    """Normal values × `scale` drawn from the CPU generator `g` (the same draws on any machine), in
    `dtype`, on CUDA where there is one, else on the CPU (Triton's interpreter)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


def spread_weights(module: torch.nn.Module, std: float, norm_std: float | None = None) -> None:
    """`module`'s parameters drawn at random, in place: 1-D ones (norms' weights, biases) around
    1 (std `norm_std`, `std` where not given), matrices around 0 (std `std`) — far enough from
    the checkpoint's init that a kernel skipping a norm or a bias shows."""
    for p in module.parameters():
        one_d = p.dim() == 1
        spread = (std if norm_std is None else norm_std) if one_d else std
        torch.nn.init.normal_(p, mean=1.0 if one_d else 0.0, std=spread)


def check_gated(gated, m: int, k: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated(x, w)` — a gate_up + SiLU·mul kernel, run under `stream.forced()` — against
    `stream_gated.reference` for x [m, k] and w [2i, k], in float32 and bf16 (seeded by the
    shape); returns the last (x, w)."""
    from boundgen.models import stream, stream_gated  # Triton's, imported where a test runs

    g = torch.Generator().manual_seed(m * k + i)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(g, m, k, dtype=dtype)
        w = randn(g, 2 * i, k, dtype=dtype, scale=k**-0.5)
        with stream.forced():
            got = gated(x, w)
        want = stream_gated.reference(x, w)
        assert got.dtype == dtype and got.shape == (m, i)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)
    return x, w
