"""Supported HuggingFace architectures → (family, task)."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen2ForSequenceClassification": ("qwen2", "seq_cls"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "Qwen3ForSequenceClassification": ("qwen3", "seq_cls"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "seq_cls"),
}


def lookup_architecture(name: str) -> tuple[str, str]:
    try:
        return SUPPORTED_ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"unsupported architecture '{name}'; supported: {supported}") from None
