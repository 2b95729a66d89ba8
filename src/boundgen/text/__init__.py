"""Tokenization and packing: text → token ids → one `PackedBatch` per forward."""
