"""`ServerConfig`: every `boundgen serve` knob, once. Flags, YAML/TOML config files and `create_app` all
read this one dataclass (`boundgen.cliargs` turns fields into `--flags`). Engine knobs (device,
dtype,
max_items, max_beam_width, ...) stay in `boundgen.config.EngineConfig`; a config file may hold both."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _f(default: Any, help: str, **meta: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **meta}
        )
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ServerConfig:
    # --- model ---
    model: str | None = _f(None, "checkpoint directory (default: the built-in demo model)")
    served_model_name: str | None = _f(
        None, "name reported in responses (default: the model's name)"
    )
    # --- network ---
    host: str = _f("127.0.0.1", "bind address (127.0.0.1 unless told otherwise)")
    port: int = _f(8000, "TCP port")
    api_key: str | None = _f(
        None, "require `Authorization: Bearer KEY` (also env BOUNDGEN_API_KEY)"
    )
    log_level: str = _f("info", "uvicorn log level")
    access_log: bool = _f(False, "log every request")
    # --- load control ---
    max_queue: int = _f(256, "requests admitted (queued + running) before answering 429")
    timeout_ms: int = _f(
        10_000, "default per-request deadline; requests may set `timeout_ms` lower"
    )
    max_timeout_ms: int = _f(60_000, "largest `timeout_ms` a request may ask for")
    retry_after_s: int = _f(1, "`Retry-After` seconds sent with 429")
    drain_timeout_s: float = _f(30.0, "on SIGTERM, wait this long for in-flight requests")
    runtime: bool = _f(
        True,
        "serve through the DAG runtime (cross-request batching); "
        "--no-runtime calls the engine on worker threads",
    )
    batch_token_budget: int | None = _f(
        None,
        "runtime: most tokens merged into one forward (default: the engine's max_batch_tokens)",
    )
    batch_max_wait_ms: float = _f(0.0, "runtime: how long a batch may wait for more requests")
    cpu_workers: int | None = _f(None, "runtime: CPU node threads (default: the runtime's choice)")
    workers: int = _f(1, "--no-runtime: model worker threads")
    server_timing: bool = _f(
        True,
        "add a Server-Timing header to responses: time in the handler, in the "
        "runtime and in each DAG node (tells a slow request's cause apart)",
    )
    gc_freeze: bool = _f(
        True,
        "freeze the start-up heap so Python's full garbage collections skip it "
        "(a full collection over it pauses requests for ~0.1-0.2 s)",
    )
    # --- request size limits ---
    max_body_bytes: int = _f(8 << 20, "largest request body (413 beyond)")
    max_item_tokens: int = _f(1024, "tokens per item, document or text")
    max_query_tokens: int = _f(4096, "tokens in a query or beam prompt")
    max_label_tokens: int = _f(256, "label_token_ids per score request")
    # --- workload defaults ---
    rerank_label_tokens: tuple[str, ...] = _f(
        (" yes", " no"), "rerank: relevance = softmax over these tokens' logits, first one"
    )
    rerank_query_template: str = _f("{query}", "rerank: text before each document")
    rerank_document_template: str = _f("{document}", "rerank: each document's text")
    embed_pooling: str = _f("last", "embeddings pooling: last | mean", choices=("last", "mean"))
    embed_normalize: bool = _f(True, "L2-normalize embeddings (OpenAI returns unit vectors)")
    tries: tuple[str, ...] = _f((), "beam tries loaded at start, NAME=PATH each")

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("BOUNDGEN_API_KEY") or None

    def trie_paths(self) -> dict[str, Path]:
        out = {}
        for spec in self.tries:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"tries: expected NAME=PATH, got {spec!r}")
            out[name.strip()] = Path(path.strip()).expanduser()
        return out

    def validate(self) -> ServerConfig:
        for name in (
            "max_queue",
            "timeout_ms",
            "max_timeout_ms",
            "max_body_bytes",
            "max_item_tokens",
            "max_query_tokens",
            "max_label_tokens",
            "workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if len(self.rerank_label_tokens) < 1:
            raise ValueError("rerank_label_tokens needs at least one token")
        self.trie_paths()
        return self


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (.yaml/.yml) or TOML (.toml) config file."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        raise ValueError(f"config file must end in .yaml, .yml or .toml: {path}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def load_config_file(path: str | os.PathLike) -> tuple[ServerConfig, Any]:
    """YAML (.yaml/.yml) or TOML (.toml). Keys of `ServerConfig` and of `EngineConfig` at the top level,
    or under `server:` and `engine:` sections. Returns (ServerConfig, EngineConfig)."""
    from boundgen.config import EngineConfig

    path = Path(path)
    data = read_config_file(path)
    data.pop("ray", None)  # the Ray Serve section belongs to boundgen.serve_ray
    server = dict(data.pop("server", None) or {})
    engine = dict(data.pop("engine", None) or {})
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    for key, value in data.items():
        (engine if key.replace("-", "_") in engine_keys else server)[key] = value
    return (
        config_from_dict(server, source=str(path)),
        _dataclass_from_dict(EngineConfig, engine, source=f"{path} (engine)"),
    )


def config_from_dict(data: dict[str, Any], source: str = "config") -> ServerConfig:
    return _dataclass_from_dict(ServerConfig, data, source).validate()


def _dataclass_from_dict(cls: type, data: dict[str, Any], source: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
    values = {}
    for key, value in data.items():
        if key == "tries" and isinstance(value, dict):  # `tries: {name: path}` is also accepted
            value = tuple(f"{k}={v}" for k, v in value.items())
        elif isinstance(known[key].default, tuple) and isinstance(value, list):
            value = tuple(value)
        values[key] = value
    return cls(**values)
