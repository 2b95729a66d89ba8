"""The built-in demo model: Qwen2 trained by `boundgen.demo.train` on a synthetic catalog."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def default_model_path() -> Path:
    """Directory of the shipped demo checkpoint (HF Qwen2, tokenizer, catalog trie, eval sets)."""
    if not (ASSETS / "model.safetensors").exists():
        raise FileNotFoundError(
            f"demo model missing at {ASSETS}; build it with `boundgen train-demo --out {ASSETS}`"
        )
    return ASSETS


def default_trie_path() -> Path:
    """The demo catalog's trie (`{"item_id", "tokens"}` JSONL), e.g. for the server's `/v1/beam`."""
    return default_model_path() / "catalog_trie.jsonl"
