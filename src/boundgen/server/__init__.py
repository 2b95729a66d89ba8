"""HTTP serving: FastAPI app (`create_app`) speaking the peers' APIs (SGLang, vLLM, OpenAI, Cohere,
TEI, KServe v2 / Triton; docs/compat.md), request schemas, metrics, limits."""

from boundgen.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from boundgen.server.app import create_app

        return create_app
    raise AttributeError(f"module 'boundgen.server' has no attribute {name!r}")
