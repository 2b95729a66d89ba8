"""Attention: packed metadata, backends (reference / CUDA varlen) and cascade (shared-prefix)
merging."""

from boundgen.attention.backends import AttentionBackend, available_backends, get_backend
from boundgen.attention.metadata import AttnInputs

__all__ = ["AttentionBackend", "AttnInputs", "available_backends", "get_backend"]
