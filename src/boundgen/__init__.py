"""boundgen: an inference engine for bounded generation workloads on small decoder LMs."""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "Trie"]


def __getattr__(name: str):
    # Lazy, so `import boundgen` stays cheap for the CLI and tools.
    if name == "Engine":
        from boundgen.engine import Engine

        return Engine
    if name == "EngineConfig":
        from boundgen.config import EngineConfig

        return EngineConfig
    if name == "Trie":
        from boundgen.workloads.trie import Trie

        return Trie
    raise AttributeError(f"module 'boundgen' has no attribute {name!r}")
