"""A one-layer Qwen2-shaped `ModelConfig` small enough for Triton's CPU interpreter (the few-row
kernels' tests: `test_skinny.py`, `test_stream.py`)."""

from __future__ import annotations

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
