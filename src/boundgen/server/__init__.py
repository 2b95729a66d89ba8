"""HTTP serving: FastAPI app (`create_app`), request schemas, metrics, limits, KServe v2."""

from boundgen.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from boundgen.server.app import create_app

        return create_app
    raise AttributeError(f"module 'boundgen.server' has no attribute {name!r}")
