"""A one-layer Qwen2-shaped `ModelConfig` small enough for Triton's CPU interpreter, and random
inputs on the device the kernels' tests run on (the few-row and bucket kernels' tests:
`test_skinny.py`, `test_stream*.py`, `test_bucket_gated.py`)."""

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
