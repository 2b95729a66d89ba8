"""A one-layer Qwen2-shaped `ModelConfig` small enough for Triton's CPU interpreter (the few-row
kernels' tests: `test_skinny.py`, `test_stream.py`), and a Qwen2.5-0.5B-shaped layer for their GPU
tests."""

from __future__ import annotations

import torch
from torch import nn

from boundgen.config import ModelConfig
from boundgen.models.decoder import DecoderLayer


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


def qwen_layer_on_cuda() -> tuple[DecoderLayer, ModelConfig]:
    """A Qwen2.5-0.5B-shaped decoder layer (hidden 896, MLP 4,864, 14 + 2 heads of 64) on CUDA in
    bf16 without grad, seeded: weights ~N(0, 0.02), norms ~N(1, 0.02); and its config."""
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2,
                       head_dim=64, max_position_embeddings=4096)  # fmt: skip
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.02)
    return layer, cfg
