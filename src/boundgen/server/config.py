"""Serving settings: `ServerConfig` (HTTP), `EngineConfig` (the model) and `RayServeConfig`
(scale-out) as one `ServeSettings`, read from one config file and the flags of `boundgen serve`.

A config file (YAML/TOML) holds keys of any of the three at the top level, or `server:`,
`engine:` and `ray:` sections; a flag overrides the file. Fields with `flag=False` are
config-file only (rare knobs), so `boundgen serve --help` stays short.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boundgen.config import EngineConfig
from boundgen.host_cores import usable_cores
from boundgen.settings import add_flags, from_args, load_sections, option, read_file

RAY_INSTALL_HINT = "pip install 'boundgen[ray]'"


@dataclass(frozen=True)
class ServerConfig:
    # --- model ---
    model: str | None = option(None, "checkpoint directory (default: the built-in demo model)")
    served_model_name: str | None = option(
        None, "name reported in responses (default: the model's name)"
    )
    tries: tuple[str, ...] = option((), "beam tries loaded at start, NAME=PATH each")
    trie_softmax: str = option(
        "vocab",
        "what a trie search's scores are normalised over: vocab (the full vocabulary, as HF "
        "generate with prefix_allowed_tokens_fn) | children (each step's trie children; the LM "
        "head then runs on the trie level's tokens only)",
    )
    # --- network ---
    host: str = option("127.0.0.1", "bind address (127.0.0.1 unless told otherwise)")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(
        None,
        "require `Authorization: Bearer KEY` (also env BOUNDGEN_API_KEY; prefer a file or the env: "
        "a flag shows in `ps`)",
    )
    api_key_file: str | None = option(
        None, "file whose first line is the API key (also env BOUNDGEN_API_KEY_FILE)"
    )
    allowed_hosts: tuple[str, ...] = option(
        (),
        "Host names requests may carry (port ignored; `*`: any). Default: the loopback names on "
        "a connection to a loopback address, any name on another address",
        flag=False,
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "origins (`https://app.example`) whose browser pages may call the API; `*`: any. "
        "Default: none (same-origin only)",
        flag=False,
    )
    header_timeout_s: float = option(
        5.0,
        "a request head must arrive whole within this many seconds of its first byte (or of the "
        "connection); trickling bytes does not extend it",
        flag=False,
    )
    body_timeout_s: float = option(
        10.0, "a request body must arrive whole within this many seconds of its head", flag=False
    )
    log_level: str = option("info", "log level (uvicorn and boundgen)")
    access_log: bool = option(False, "log every request")
    # --- load control ---
    max_queue: int = option(256, "requests admitted (queued + running) before answering 429")
    max_queue_ms: float | None = option(
        None,
        "shed (429) a request when the predicted wait for the model exceeds this; default: none, "
        "a request is refused only when it cannot meet its own deadline (the queue is what "
        "cross-request batching merges)",
        flag=False,
    )
    timeout_ms: int = option(
        10_000, "default per-request deadline; requests may set `timeout_ms` lower"
    )
    max_timeout_ms: int = option(60_000, "largest `timeout_ms` a request may ask for", flag=False)
    retry_after_s: int = option(1, "`Retry-After` seconds sent with 429", flag=False)
    drain_timeout_s: float = option(30.0, "on SIGTERM, wait this long for in-flight requests")
    warmup: str = option(
        "default",
        "before /health and /v2/health/ready say ready, run: `default` (one small request per "
        "workload and a beam search per trie), a profile file (JSON, the `boundgen compile "
        "--profile` format: compiles each beam search's graph before traffic), or `off`",
    )
    server_timing: bool = option(
        True,
        "add a Server-Timing header to responses: time in the handler, in the runtime and in each "
        "DAG node (tells a slow request's cause apart)",
        flag=False,
    )
    gil_switch_ms: float | None = option(
        None,
        "the interpreter's GIL switch interval, ms (unset: CPython's, 5 ms): how long a thread "
        "that released the GIL for a torch call may wait to get it back (server/gil.py)",
    )
    frontends: int | None = option(
        None,
        "HTTP frontend processes (0: HTTP in the engine's process). N > 0: N processes serve the "
        "HTTP API on the port and send the model work to the engine's process, so HTTP's Python "
        "does not share the GIL of the process that drives the GPU (docs/serving.md). Unset: on "
        "a GPU one per two cores this process may use, at most 4; 0 on the CPU and on Ray",
    )
    gc_freeze: bool = option(
        True,
        "freeze the start-up heap so Python's full garbage collections skip it (a full collection "
        "over it pauses requests for ~0.1-0.2 s)",
        flag=False,
    )
    # --- request size limits ---
    max_body_bytes: int = option(
        1 << 20,
        "largest request body (413 before it is read); 16 bytes per token of max_request_tokens "
        "holds the largest valid request twice",
        flag=False,
    )
    max_request_tokens: int = option(
        65_536, "tokens one request may have the model process (413 beyond)", flag=False
    )
    max_item_tokens: int = option(1024, "tokens per item, document or text", flag=False)
    max_query_tokens: int = option(4096, "tokens in a query or beam prompt", flag=False)
    max_label_tokens: int = option(256, "label_token_ids per score request", flag=False)
    # --- workload defaults ---
    rerank_label_tokens: tuple[str, ...] = option(
        (" yes", " no"),
        "rerank: relevance = softmax over these tokens' logits, first one (one token: the sigmoid "
        "of its logit)",
        flag=False,
    )
    rerank_query_template: str = option(
        "{query}", "rerank: text before each document (default model: its trained one)", flag=False
    )
    rerank_document_template: str = option(
        "{document}", "rerank: each document's text (default model: its trained one)", flag=False
    )
    rerank_v1_format: str = option(
        "cohere",
        "reply of /v1/rerank: cohere ({results: [...]}) or sglang (a list of {score, document, "
        "index}); both peers send the same request fields",
        choices=("cohere", "sglang"),
    )
    embed_input_types: tuple[str, ...] = option(
        (),
        "Cohere embed input_type prefixes, TYPE=PREFIX each (e.g. 'search_query=query: '); a type "
        "without one embeds the text as it is",
        flag=False,
    )
    embed_pooling: str = option(
        "last", "embeddings pooling: last | mean", choices=("last", "mean"), flag=False
    )
    embed_normalize: bool = option(
        True, "L2-normalize embeddings (OpenAI returns unit vectors)", flag=False
    )

    def resolved_api_key(self) -> str | None:
        return self.api_key_source()[0]

    def api_key_source(self) -> tuple[str | None, str]:
        """(the API key or None, where it came from): the first that is set of `api_key`,
        `api_key_file`, env BOUNDGEN_API_KEY, a file named by env BOUNDGEN_API_KEY_FILE."""
        if self.api_key:
            return self.api_key, "the api_key option"
        if self.api_key_file:
            return _read_key_file(self.api_key_file, "api_key_file"), "api_key_file"
        if os.environ.get("BOUNDGEN_API_KEY"):
            return os.environ["BOUNDGEN_API_KEY"], "env BOUNDGEN_API_KEY"
        if os.environ.get("BOUNDGEN_API_KEY_FILE"):
            path = os.environ["BOUNDGEN_API_KEY_FILE"]
            return _read_key_file(path, "BOUNDGEN_API_KEY_FILE"), "env BOUNDGEN_API_KEY_FILE"
        return None, "none"

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
            "max_request_tokens",
            "max_item_tokens",
            "max_query_tokens",
            "max_label_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.frontends is not None and self.frontends < 0:
            raise ValueError(f"frontends must be >= 0, got {self.frontends}")
        if self.gil_switch_ms is not None and not self.gil_switch_ms > 0:
            raise ValueError(f"gil_switch_ms must be > 0, got {self.gil_switch_ms}")
        if self.max_queue_ms is not None and not self.max_queue_ms > 0:
            raise ValueError(f"max_queue_ms must be > 0, got {self.max_queue_ms}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if len(self.rerank_label_tokens) < 1:
            raise ValueError("rerank_label_tokens needs at least one token")
        if self.trie_softmax not in ("vocab", "children"):
            raise ValueError(f"trie_softmax must be vocab or children, got {self.trie_softmax!r}")
        self.trie_paths()
        self.input_type_prefixes()
        return self

    def input_type_prefixes(self) -> dict[str, str]:
        """`embed_input_types` as input_type → prefix."""
        out = {}
        for spec in self.embed_input_types:
            name, sep, prefix = spec.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"embed_input_types: expected TYPE=PREFIX, got {spec!r}")
            out[name.strip()] = prefix
        return out

    def with_frontends_for(self, device: str) -> ServerConfig:
        """This config with `frontends` decided for an engine on `device`: as given, or unset →
        `auto_frontends`."""
        if self.frontends is not None:
            return self
        return dataclasses.replace(self, frontends=auto_frontends(device, usable_cores()))

    def with_default_model(self) -> tuple[Path, ServerConfig]:
        """(checkpoint, config): `model`, or without it the shipped demo model with its catalog
        trie served as `catalog` (`/v1/beam` with `"trie": "catalog"`) and rerank asking what it
        was trained on (its relevance templates and label words, unless set), so a new user's
        first server gives answers a person can judge."""
        if self.model:
            return Path(self.model), self
        from boundgen.demo import default_model_path, default_trie_path

        path = default_model_path()
        trained = json.loads((path / "demo.json").read_text())
        changes: dict[str, Any] = {"tries": self.tries or (f"catalog={default_trie_path()}",)}
        defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
        demo_rerank = {
            "rerank_query_template": trained["templates"]["relevance_query"],
            "rerank_document_template": trained["templates"]["relevance_item"].replace(
                "{title}", "{document}"
            ),
            "rerank_label_tokens": tuple(trained["label_words"]),
        }
        for name, value in demo_rerank.items():
            if getattr(self, name) == defaults[name]:
                changes[name] = value
        return path, dataclasses.replace(self, **changes).validate()


def _read_key_file(path: str, source: str) -> str:
    """The key on the first line of `path`; trailing whitespace (the newline) is not part of it."""
    try:
        with open(Path(path).expanduser()) as f:
            key = f.readline().rstrip()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the API key file: {exc}") from None
    if not key:
        raise ValueError(f"{source}: the API key file {path} is empty")
    return key


@dataclass(frozen=True)
class RayServeConfig:
    """How many engine replicas, how they scale and what each reserves (Ray Serve)."""

    replicas: int | None = option(
        None,
        "Ray Serve: fixed number of replicas (one per GPU on CUDA); giving it serves through Ray",
    )
    min_replicas: int | None = option(
        None, "Ray Serve autoscaling: fewest replicas (default 1)", flag=False
    )
    max_replicas: int | None = option(
        None, "Ray Serve autoscaling: most replicas; giving it turns autoscaling on"
    )
    target_ongoing_requests: float = option(
        32.0,
        "Ray Serve autoscaling: requests in flight per replica to aim for (batching wants several)",
        flag=False,
    )
    upscale_delay_s: float | None = option(
        None,
        "Ray Serve autoscaling: load must stay high this long before adding replicas",
        flag=False,
    )
    downscale_delay_s: float | None = option(
        None,
        "Ray Serve autoscaling: load must stay low this long before removing replicas",
        flag=False,
    )
    max_ongoing_requests: int | None = option(
        None,
        "Ray Serve: requests the proxy sends one replica at once (default: the server's max_queue)",
        flag=False,
    )
    num_gpus: float | None = option(
        None, "GPUs per replica (default: 1 when the engine device is CUDA, else 0)"
    )
    num_cpus: float = option(1.0, "CPUs reserved per replica", flag=False)
    ray_address: str | None = option(
        None, "Ray cluster to join (default: RAY_ADDRESS, else start one locally)"
    )
    app_name: str = option("boundgen", "Ray Serve application (and deployment) name", flag=False)
    replica_metrics_port: int | None = option(
        None,
        "each replica serves its own Prometheus /metrics on the first free port from this one",
        flag=False,
    )
    health_check_period_s: float = option(
        10.0, "Ray Serve: seconds between replica health checks", flag=False
    )
    health_check_timeout_s: float = option(
        30.0, "Ray Serve: a health check slower than this fails", flag=False
    )

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def validate(self) -> RayServeConfig:
        for name in ("replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            least = 0 if name == "min_replicas" else 1
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if self.autoscaling:
            lo = 1 if self.min_replicas is None else self.min_replicas
            if lo > self.max_replicas:
                raise ValueError(f"min_replicas={lo} > max_replicas={self.max_replicas}")
            if self.target_ongoing_requests <= 0:
                raise ValueError("target_ongoing_requests must be > 0")
        elif self.min_replicas is not None:
            raise ValueError(
                "min_replicas needs max_replicas (autoscaling); for a fixed count use replicas"
            )
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ValueError("num_cpus and num_gpus must be >= 0")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        return self


@dataclass(frozen=True)
class ServeSettings:
    server: ServerConfig
    engine: EngineConfig
    ray: RayServeConfig
    ray_section: bool = False  # the config file had a `ray:` section (it asks for Ray Serve)


_SECTIONS = {"server": ServerConfig, "engine": EngineConfig, "ray": RayServeConfig}


def load_settings(source: str | os.PathLike | dict[str, Any]) -> ServeSettings:
    """The settings in a config file (YAML/TOML path) or in the same mapping given directly."""
    data = read_file(source) if isinstance(source, (str, os.PathLike)) else dict(source or {})
    name = str(source) if isinstance(source, (str, os.PathLike)) else "settings"
    parts = load_sections(data, _SECTIONS, name)
    return ServeSettings(
        parts["server"].validate(), parts["engine"], parts["ray"].validate(), "ray" in data
    )


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """`--config`, the server, engine and Ray Serve flags, and `--ray/--no-ray`."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML/TOML file with server, engine and ray settings; flags override it",
    )
    add_flags(parser.add_argument_group("server"), ServerConfig)
    add_flags(parser.add_argument_group("engine"), EngineConfig)
    ray = parser.add_argument_group(f"Ray Serve ({RAY_INSTALL_HINT})")
    ray.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve through Ray Serve (also implied by --replicas, --max-replicas or a `ray:` "
        "section in --config)",
    )
    add_flags(ray, RayServeConfig)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The config file (if any) overridden by the flags that were given."""
    base = load_settings(args.config) if getattr(args, "config", None) else None
    server = from_args(ServerConfig, args, base.server if base else None).validate()
    engine = from_args(EngineConfig, args, base.engine if base else None)
    ray = from_args(RayServeConfig, args, base.ray if base else None).validate()
    return ServeSettings(server, engine, ray, bool(base and base.ray_section))


def wants_ray(args: argparse.Namespace, settings: ServeSettings) -> bool:
    """`--ray`/`--no-ray` decide; else replica flags or a `ray:` section in the config file."""
    flag = getattr(args, "ray", None)
    if flag is not None:
        return bool(flag)
    ray = settings.ray
    return ray.replicas is not None or ray.max_replicas is not None or settings.ray_section


MAX_AUTO_FRONTENDS = 4


def auto_frontends(device: str, cores: int) -> int:
    """Frontend processes when `frontends` is unset: on a GPU one per two usable cores
    (`host_cores`: the affinity, at most a container's CPU limit), at most
    `MAX_AUTO_FRONTENDS` (half the cores stay with the engine's threads: four frontends on eight
    server cores beat HTTP in the engine's process on every H100 host measured, BENCHMARKS.md
    thirty-second to thirty-fourth sessions); on the CPU none — there the model's own forward
    wants every core, and a frontend would take one from it."""
    if not device.startswith("cuda"):
        return 0
    return min(MAX_AUTO_FRONTENDS, cores // 2)


def engine_device_given(args: argparse.Namespace, settings: ServeSettings) -> bool:
    """Whether the user chose the device (by flag or config file), else the server picks one."""
    return getattr(args, "device", None) is not None or settings.engine.device != "cpu"
