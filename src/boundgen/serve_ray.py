"""Ray Serve deployment of the boundgen HTTP API: one replica per GPU, the app of `boundgen serve`.

Every replica builds the very app `boundgen serve` runs (`boundgen.server.app.create_app` over an
`Engine` loaded in the replica), and Serve's HTTP proxy routes requests to the replicas through its
ASGI ingress: same routes, schemas, errors, auth, limits and per-replica `/metrics`. Nothing here
re-declares a handler. Replica count, autoscaling and actor resources come from `RayServeConfig`,
which lives in the same config file as `ServerConfig` and `EngineConfig` (a `ray:` section) and
whose fields are also flags (`--replicas`, `--max-replicas`, `--target-ongoing-requests`, ...).

    boundgen serve --replicas 2 ...             # via `commands/serve.py` (see `add_ray_arguments`)
    python -m boundgen.serve_ray --replicas 2   # the same, without the hook in `commands/serve.py`

    from boundgen.serve_ray import build_app    # an Application for `serve.run`
    serve.run(build_app(model_dir, ServerConfig(), EngineConfig(device="cuda"),
                        RayServeConfig(replicas=4)))

A Serve config file (KubeRay `RayService`) points at `boundgen.serve_ray:app_builder` with `args`
that are the config file's keys (see docs/deploy.md).

Per replica: every response carries `x-boundgen-replica: <replica id>`; Serve calls `check_health`
(readiness and draining, as `/health`); with `replica_metrics_port` each replica also serves its own
Prometheus registry on a port of its own (`/metrics` through the proxy answers from whichever
replica the request reached, so scrape the replicas, not the proxy). Ray is optional: without it
every entry point raises `RayNotInstalled` saying `pip install 'boundgen[ray]'`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boundgen.config import EngineConfig
from boundgen.server.config import ServerConfig, read_config_file

log = logging.getLogger("boundgen.serve_ray")

REPLICA_HEADER = "x-boundgen-replica"
INSTALL_HINT = "pip install 'boundgen[ray]'"


class RayNotInstalled(RuntimeError):
    """Ray Serve is an optional extra."""


def require_ray() -> Any:
    """Import `ray.serve` or fail with the install command (a RuntimeError: the CLI prints one line)."""
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as exc:
        raise RayNotInstalled(
            f"serving with Ray needs Ray Serve, which is not installed ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    return serve


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class RayServeConfig:
    """How many engine replicas, how they scale and what each reserves. Flags and the `ray:` section of a
    `boundgen serve --config` file are this one dataclass (`boundgen.cliargs`)."""

    replicas: int | None = _f(
        None,
        "Ray Serve: fixed number of replicas (one per GPU on CUDA); giving it serves through Ray",
    )
    min_replicas: int | None = _f(None, "Ray Serve autoscaling: fewest replicas (default 1)")
    max_replicas: int | None = _f(
        None, "Ray Serve autoscaling: most replicas; giving it turns autoscaling on"
    )
    target_ongoing_requests: float = _f(
        32.0,
        "Ray Serve autoscaling: requests in flight per replica to aim for (batching wants several)",
    )
    upscale_delay_s: float | None = _f(
        None,
        "Ray Serve autoscaling: load must stay high this long "
        "before adding replicas (Ray's default)",
    )
    downscale_delay_s: float | None = _f(
        None,
        "Ray Serve autoscaling: load must stay low this long "
        "before removing replicas (Ray's default)",
    )
    max_ongoing_requests: int | None = _f(
        None,
        "Ray Serve: requests the proxy sends one replica at once (default: the server's max_queue)",
    )
    num_gpus: float | None = _f(
        None, "GPUs per replica (default: 1 when the engine device is CUDA, else 0)"
    )
    num_cpus: float = _f(1.0, "CPUs reserved per replica")
    ray_address: str | None = _f(
        None, "Ray cluster to join (default: RAY_ADDRESS, else start one locally)"
    )
    app_name: str = _f("boundgen", "Ray Serve application (and deployment) name")
    replica_metrics_port: int | None = _f(
        None, "each replica serves its own Prometheus /metrics on the first free port from this one"
    )
    health_check_period_s: float = _f(10.0, "Ray Serve: seconds between replica health checks")
    health_check_timeout_s: float = _f(30.0, "Ray Serve: a health check slower than this fails")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def validate(self) -> RayServeConfig:
        for name in ("replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "min_replicas" else 1):
                raise ValueError(
                    f"{name} must be >= {0 if name == 'min_replicas' else 1}, got {value}"
                )
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


# ------------------------------------------------------------------------------------------ config


def load_configs(path: str | os.PathLike) -> tuple[ServerConfig, EngineConfig, RayServeConfig]:
    """A `boundgen serve --config` file (YAML or TOML) with an optional `ray:` section."""
    from boundgen.server.config import _dataclass_from_dict, load_config_file

    server, engine = load_config_file(path)
    ray_section = dict(read_config_file(Path(path)).get("ray") or {})
    ray = _dataclass_from_dict(RayServeConfig, ray_section, source=f"{path} (ray)").validate()
    return server, engine, ray


def config_has_ray_section(path: str | os.PathLike | None) -> bool:
    return bool(path) and "ray" in read_config_file(Path(path))


def deployment_options(server: ServerConfig, engine: EngineConfig, ray_cfg: RayServeConfig) -> dict:
    """`serve.deployment(**options)` for these configs (no Ray import: testable anywhere)."""
    ray_cfg.validate()
    num_gpus = ray_cfg.num_gpus
    if num_gpus is None:
        num_gpus = 1 if engine.device.startswith("cuda") else 0
    opts: dict[str, Any] = {
        "name": ray_cfg.app_name,
        "ray_actor_options": {"num_cpus": ray_cfg.num_cpus, "num_gpus": num_gpus},
        # The app admits up to max_queue requests itself (429 beyond) and batches across them:
        # let the proxy hand it that many, not Serve's small default.
        "max_ongoing_requests": ray_cfg.max_ongoing_requests or server.max_queue,
        "graceful_shutdown_timeout_s": max(1.0, float(server.drain_timeout_s)),
        "health_check_period_s": ray_cfg.health_check_period_s,
        "health_check_timeout_s": ray_cfg.health_check_timeout_s,
        # Serve logs every request by default; follow the server's `access_log` (off by default).
        "logging_config": {
            "enable_access_log": bool(server.access_log),
            "log_level": {"TRACE": "DEBUG"}.get(server.log_level.upper(), server.log_level.upper()),
        },
    }
    if ray_cfg.autoscaling:
        lo = 1 if ray_cfg.min_replicas is None else ray_cfg.min_replicas
        auto: dict[str, Any] = {
            "min_replicas": lo,
            "max_replicas": ray_cfg.max_replicas,
            "target_ongoing_requests": ray_cfg.target_ongoing_requests,
        }
        if ray_cfg.replicas is not None:
            auto["initial_replicas"] = min(max(ray_cfg.replicas, lo), ray_cfg.max_replicas)
        if ray_cfg.upscale_delay_s is not None:
            auto["upscale_delay_s"] = ray_cfg.upscale_delay_s
        if ray_cfg.downscale_delay_s is not None:
            auto["downscale_delay_s"] = ray_cfg.downscale_delay_s
        opts["autoscaling_config"] = auto
    else:
        opts["num_replicas"] = ray_cfg.replicas or 1
    return opts


def replica_engine_config(engine: EngineConfig, num_gpus: float) -> EngineConfig:
    """Inside a replica Ray shows only its GPU(s) (CUDA_VISIBLE_DEVICES, also for a fraction of one):
    `cuda:3` becomes `cuda`."""
    if engine.device.startswith("cuda") and num_gpus > 0:
        return dataclasses.replace(engine, device="cuda")
    return engine


# ------------------------------------------------------------------------------------------ replica

# This process's app. A Serve replica is one Ray actor, i.e. one worker process: one app per
# process. Read and written through `_this_module()`, never as a bare global: a class cloudpickled
# by value (as happens when this file runs as `__main__`) would otherwise get a private copy of the
# globals.
_APP: Any = None


def _this_module() -> Any:
    import boundgen.serve_ray

    return boundgen.serve_ray


class _ReplicaASGI:
    """What `serve.ingress` gets: a tiny picklable ASGI callable that forwards to the app built inside
    the replica (the engine is never loaded on, or pickled from, the driver). Works with every Ray
    that accepts an ASGI app in `serve.ingress`."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        app = _this_module()._APP
        if app is None:
            raise RuntimeError("boundgen replica app is not built yet")
        await app(scope, receive, send)

    def __getattr__(
        self, name: str
    ) -> Any:  # `add_exception_handler`, `docs_url`, ... of the real app
        app = None if name.startswith("__") else _this_module()._APP
        if app is None:
            raise AttributeError(name)
        return getattr(app, name)


class _ReplicaHeader:
    """Pure-ASGI middleware: `x-boundgen-replica: <id>` on every HTTP response."""

    def __init__(self, app: Any, replica_id: str):
        self.app = app
        self.value = replica_id.encode("latin-1", "replace")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append((REPLICA_HEADER.encode(), self.value))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


class BoundgenReplica:
    """One Serve replica: loads the engine on its device and builds `create_app(engine, server_config)`."""

    def __init__(
        self,
        model: str,
        server: ServerConfig,
        engine: EngineConfig,
        ray_cfg: RayServeConfig | None = None,
    ):
        from ray import serve

        from boundgen.engine import Engine
        from boundgen.server.app import create_app

        ray_cfg = ray_cfg or RayServeConfig()
        self.replica_id = _replica_id(serve)
        engine_obj = Engine.from_pretrained(
            model, device=engine.device, dtype=engine.dtype, config=engine
        )
        app = create_app(engine_obj, server)
        app.add_middleware(_ReplicaHeader, replica_id=self.replica_id)
        self.state = app.state.boundgen
        self.metrics_port = None
        if ray_cfg.replica_metrics_port:
            self.metrics_port = _start_metrics_server(
                self.state.metrics.registry, ray_cfg.replica_metrics_port, server.host
            )
        _replica_info(self.state.metrics.registry, self.replica_id, engine_obj, self.metrics_port)
        _this_module()._APP = app
        if server.gc_freeze:
            from boundgen.server.heap import freeze_startup_heap

            freeze_startup_heap()
        log.info(
            "boundgen replica %s: %s on %s, pid %d, metrics port %s",
            self.replica_id,
            getattr(engine_obj, "model_name", model),
            engine_obj.device,
            os.getpid(),
            self.metrics_port,
        )

    def check_health(self) -> None:
        """Serve's replica health check: the same readiness `/health` reports."""
        if self.state.draining:
            raise RuntimeError(f"replica {self.replica_id} is draining")
        if not self.state.ready:
            raise RuntimeError(f"replica {self.replica_id}: model is not ready")
        if getattr(self.state.infer, "closed", False):
            raise RuntimeError(f"replica {self.replica_id}: model pool is closed")


def _replica_id(serve: Any) -> str:
    try:
        ctx = serve.get_replica_context()
        return str(getattr(ctx, "replica_tag", None) or ctx.replica_id.unique_id)
    except Exception:
        return f"pid{os.getpid()}"


def _start_metrics_server(registry: Any, base_port: int, host: str, tries: int = 64) -> int:
    from prometheus_client import start_http_server

    for port in range(base_port, base_port + tries):
        try:
            start_http_server(port, addr=host, registry=registry)
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free metrics port in {base_port}..{base_port + tries - 1}")


def _replica_info(registry: Any, replica_id: str, engine: Any, metrics_port: int | None) -> None:
    from prometheus_client import Info

    try:
        node = __import__("ray").get_runtime_context().get_node_id()
    except Exception:
        node = ""
    Info("boundgen_replica", "this Ray Serve replica", registry=registry).info(
        {
            "replica_id": replica_id,
            "node_id": str(node),
            "pid": str(os.getpid()),
            "device": str(getattr(engine, "device", "")),
            "metrics_port": str(metrics_port or ""),
        }
    )


# ------------------------------------------------------------------------------------------ app


def build_app(
    model: str | os.PathLike,
    server: ServerConfig | None = None,
    engine: EngineConfig | None = None,
    ray_cfg: RayServeConfig | None = None,
) -> Any:
    """A Serve `Application` (for `serve.run`) serving `model` with these configs."""
    serve = require_ray()
    server = (server or ServerConfig()).validate()
    engine = engine or EngineConfig()
    ray_cfg = (ray_cfg or RayServeConfig()).validate()
    opts = deployment_options(server, engine, ray_cfg)
    replica_engine = replica_engine_config(engine, opts["ray_actor_options"]["num_gpus"])
    ingress = serve.ingress(_ReplicaASGI())(BoundgenReplica)
    deployment = serve.deployment(ingress, **opts)
    return deployment.bind(str(model), server, replica_engine, ray_cfg)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve config-file entry (`import_path: boundgen.serve_ray:app_builder`, e.g. in a KubeRay
    `RayService`): `args` holds the same keys as a `boundgen serve --config` file (top-level server
    and engine keys, or `server:` / `engine:` / `ray:` sections), or `config_file: PATH`."""
    server, engine, ray_cfg = configs_from_builder_args(args)
    return build_app(server.model, server, engine, ray_cfg)


def configs_from_builder_args(
    args: dict[str, Any],
) -> tuple[ServerConfig, EngineConfig, RayServeConfig]:
    from boundgen.server.config import _dataclass_from_dict, config_from_dict

    args = dict(args or {})
    if "config_file" in args:
        server, engine, ray_cfg = load_configs(args.pop("config_file"))
        if args:
            raise ValueError(f"app_builder: config_file cannot be combined with {sorted(args)}")
    else:
        ray_section = dict(args.pop("ray", None) or {})
        server_d = dict(args.pop("server", None) or {})
        engine_d = dict(args.pop("engine", None) or {})
        engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
        for key, value in args.items():
            (engine_d if key.replace("-", "_") in engine_keys else server_d)[key] = value
        server = config_from_dict(server_d, source="app_builder args")
        engine = _dataclass_from_dict(EngineConfig, engine_d, source="app_builder args (engine)")
        ray_cfg = _dataclass_from_dict(
            RayServeConfig, ray_section, source="app_builder args (ray)"
        ).validate()
    if not server.model:
        raise ValueError("app_builder: `model` (checkpoint directory on every node) is required")
    return server, engine, ray_cfg


# ------------------------------------------------------------------------------------------ running


def start(
    model: str | os.PathLike,
    server: ServerConfig,
    engine: EngineConfig,
    ray_cfg: RayServeConfig,
    *,
    ray_init: dict[str, Any] | None = None,
    after_init: Any = None,
    timeout_s: float | None = None,
) -> str:
    """Join (or start) Ray, start Serve's HTTP proxy on `server.host:server.port`, deploy, wait until every
    replica is up (at most `timeout_s`: replicas that cannot be placed make Serve wait forever).
    Returns the base URL. `shutdown()` undoes it. `after_init()` runs right after `ray.init` (which
    installs Ray's own fatal-signal handlers: re-install yours there)."""
    serve = require_ray()
    import ray

    if not ray.is_initialized():
        address = ray_cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {
            "address": address,
            "include_dashboard": False,
            "ignore_reinit_error": True,
        }
        if address is None:
            # A local cluster only for HTTP serving: requests travel inline in actor calls, so the
            # object store needs little (Ray's default reserves 30 % of RAM).
            kwargs["object_store_memory"] = 512 * 2**20
        kwargs.update(ray_init or {})
        ray.init(**kwargs)
    if after_init is not None:
        after_init()
    serve.start(http_options={"host": server.host, "port": server.port})
    app = build_app(model, server, engine, ray_cfg)
    if timeout_s is None:
        serve.run(app, name=ray_cfg.app_name, route_prefix="/", blocking=False)
    else:
        errors: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(app, name=ray_cfg.app_name, route_prefix="/", blocking=False)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=deploy, name="boundgen-serve-run", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(
                f"Ray Serve replicas not running after {timeout_s:.0f}s "
                f"(cluster resources {ray.available_resources()}): "
                f"{serve.status().applications.get(ray_cfg.app_name)}"
            )
        if errors:
            raise errors[0]
    return f"http://{server.host}:{server.port}"


def shutdown() -> None:
    """Stop Serve (replicas drain: Serve waits `graceful_shutdown_timeout_s`) and disconnect from Ray."""
    try:
        import ray
        from ray import serve
    except ImportError:
        return
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()


def add_ray_arguments(parser: Any) -> None:
    """`--ray/--no-ray` and the `RayServeConfig` flags (no Ray import). For `commands/serve.py`."""
    from boundgen.cliargs import add_dataclass_args

    parser.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve through Ray Serve (also implied by --replicas, --max-replicas or a "
        f"`ray:` section in --config); needs {INSTALL_HINT}",
    )
    add_dataclass_args(parser, RayServeConfig)


def wants_ray(args: argparse.Namespace) -> bool:
    flag = getattr(args, "ray", None)
    if flag is not None:
        return bool(flag)
    if (
        getattr(args, "replicas", None) is not None
        or getattr(args, "max_replicas", None) is not None
    ):
        return True
    return config_has_ray_section(getattr(args, "config", None))


def resolve_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig, RayServeConfig]:
    """Like `commands.serve.resolve_configs`, plus the `ray:` section / flags. Without `--device`, the
    engine uses CUDA when the Ray cluster (not only this driver) has GPUs."""
    from boundgen.cliargs import from_args

    if getattr(args, "config", None):
        server, engine, ray_cfg = load_configs(args.config)
        engine_given = engine != EngineConfig()
    else:
        server, engine, ray_cfg, engine_given = (
            ServerConfig(),
            EngineConfig(),
            RayServeConfig(),
            False,
        )
    server = from_args(ServerConfig, args, base=server).validate()
    engine = from_args(EngineConfig, args, base=engine)
    ray_cfg = from_args(RayServeConfig, args, base=ray_cfg).validate()
    device_given = getattr(args, "device", None) is not None or (
        engine_given and engine.device != "cpu"
    )
    if not device_given:
        engine = dataclasses.replace(engine, device="cuda" if _cluster_has_gpus(ray_cfg) else "cpu")
    return server, engine, ray_cfg


def _cluster_has_gpus(ray_cfg: RayServeConfig) -> bool:
    address = ray_cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            import ray

            if not ray.is_initialized():
                ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
            return ray.cluster_resources().get("GPU", 0) > 0
        except Exception as exc:
            log.warning("could not read the Ray cluster's resources at %s: %s", address, exc)
    import torch

    return torch.cuda.is_available()


def run_from_args(args: argparse.Namespace) -> int:
    """`boundgen serve --ray|--replicas N ...`: serve until SIGTERM/SIGINT, then drain and stop."""
    require_ray()
    server, engine, ray_cfg = resolve_configs(args)
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from boundgen.commands.serve import resolve_model

    model, server = resolve_model(server)
    opts = deployment_options(server, engine, ray_cfg)
    count = (
        f"{opts['autoscaling_config']['min_replicas']}..{ray_cfg.max_replicas} (autoscaling)"
        if ray_cfg.autoscaling
        else str(opts["num_replicas"])
    )
    stop = threading.Event()

    def on_signals() -> (
        None
    ):  # again after ray.init, whose handler would abort the process on SIGTERM
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    on_signals()
    try:
        url = start(model, server, engine, ray_cfg, after_init=on_signals)
        print(
            f"boundgen serve (Ray Serve): {model} on {count} replica(s), "
            f"{opts['ray_actor_options']['num_gpus']} GPU / {ray_cfg.num_cpus} CPU each, "
            f"at {url}",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print(
            "boundgen serve (Ray Serve): stopping, draining replicas", file=sys.stderr, flush=True
        )
    finally:
        shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m boundgen.serve_ray`: every `boundgen serve` flag plus the Ray Serve ones."""
    from boundgen.commands import serve as serve_cmd
    from boundgen.compile import cli_startup

    cli_startup()  # the libstdc++ preload AOTInductor needs (DESIGN §10); local replicas inherit it
    parser = argparse.ArgumentParser(
        prog="python -m boundgen.serve_ray", description="boundgen HTTP API on Ray Serve replicas"
    )
    serve_cmd.add_arguments(parser)
    if "--replicas" not in parser._option_string_actions:  # commands/serve.py may add them already
        add_ray_arguments(parser.add_argument_group("ray serve"))
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"boundgen serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Run the imported module's `main`, so Ray pickles `boundgen.serve_ray` classes by reference.
    from boundgen.serve_ray import main as _main

    sys.exit(_main())
