"""Ray Serve deployment of the boundgen HTTP API: one replica per GPU, the app of `boundgen serve`.

Every replica builds the very app `boundgen serve` runs (`boundgen.server.app.create_app` over an
`Engine` loaded in the replica), and Serve's HTTP proxy routes requests to the replicas through its
ASGI ingress: same routes, schemas, errors, auth, limits and per-replica `/metrics`. Nothing here
re-declares a handler. Replica count, autoscaling and actor resources come from `RayServeConfig`
(`boundgen.server.config`), which lives in the same config file as the server and engine settings (a
`ray:` section) and whose main fields are also flags (`--replicas`, `--max-replicas`, ...).

    boundgen serve --replicas 2 ...             # `commands/serve.py` calls `run(settings)`

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

import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any

from boundgen.config import EngineConfig
from boundgen.server.config import (
    RAY_INSTALL_HINT,
    RayServeConfig,
    ServerConfig,
    ServeSettings,
    load_settings,
)

log = logging.getLogger("boundgen.serve_ray")

REPLICA_HEADER = "x-boundgen-replica"


class RayNotInstalled(RuntimeError):
    """Ray Serve is an optional extra."""


def require_ray() -> Any:
    """Import `ray.serve` or fail with the install command (a RuntimeError: the CLI prints one
    line)."""
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as exc:
        raise RayNotInstalled(
            f"serving with Ray needs Ray Serve, which is not installed ({exc}); "
            f"install it with: {RAY_INSTALL_HINT}"
        ) from None
    return serve


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
    """Inside a replica Ray shows only its GPU(s) (CUDA_VISIBLE_DEVICES, also for a fraction of
    one): `cuda:3` becomes `cuda`."""
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
    """What `serve.ingress` gets: a tiny picklable ASGI callable that forwards to the app built
    inside the replica (the engine is never loaded on, or pickled from, the driver). Works with
    every Ray that accepts an ASGI app in `serve.ingress`."""

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
    """One Serve replica: loads the engine on its device and builds `create_app(engine,
    server_config)`."""

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
        from boundgen.server.gil import set_switch_interval

        if server.gil_switch_ms is not None:  # (a replica is its own process)
            set_switch_interval(server.gil_switch_ms)
        if server.gc_freeze:
            from boundgen.server.heap import freeze_startup_heap

            freeze_startup_heap()
            self.state.after_warm_up.append(freeze_startup_heap)  # and what warm-up made
        # Serve health-checks a replica as soon as this constructor returns, and one that is not
        # ready then fails to start: warm up here, not on the app's lifespan thread.
        if self.state.warmup:
            self.state.warm_up()
            self.state.warmup = []  # the lifespan finds nothing left to warm
        if self.state.unready:
            raise RuntimeError(f"replica {self.replica_id}: {self.state.unready}")
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
    `RayService`): `args` holds the same keys as a `boundgen serve --config` file (top-level keys,
    or `server:` / `engine:` / `ray:` sections), or `config_file: PATH`."""
    settings = builder_settings(args)
    return build_app(settings.server.model, settings.server, settings.engine, settings.ray)


def builder_settings(args: dict[str, Any]) -> ServeSettings:
    """The settings `app_builder` serves: `args` itself, or the file it names."""
    args = dict(args or {})
    if "config_file" in args:
        path = args.pop("config_file")
        if args:
            raise ValueError(f"app_builder: config_file cannot be combined with {sorted(args)}")
        settings = load_settings(path)
    else:
        settings = load_settings(args)
    if not settings.server.model:
        raise ValueError("app_builder: `model` (checkpoint directory on every node) is required")
    return settings


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
    """Join (or start) Ray, start Serve's HTTP proxy on `server.host:server.port`, deploy, wait
    until every replica is up (at most `timeout_s`: replicas that cannot be placed make Serve
    wait forever). Returns the base URL. `shutdown()` undoes it. `after_init()` runs right after
    `ray.init` (which installs Ray's own fatal-signal handlers: re-install yours there)."""
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
    """Stop Serve (replicas drain: Serve waits `graceful_shutdown_timeout_s`) and disconnect from
    Ray."""
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


def cluster_has_gpus(ray_cfg: RayServeConfig) -> bool:
    """Whether the Ray cluster (not only this driver) has GPUs: the engine's default device."""
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


def run(
    model: str | os.PathLike, server: ServerConfig, engine: EngineConfig, ray_cfg: RayServeConfig
) -> int:
    """`boundgen serve --ray|--replicas N ...`: serve until SIGTERM/SIGINT, then drain and stop."""
    require_ray()
    opts = deployment_options(server, engine, ray_cfg)
    count = (
        f"{opts['autoscaling_config']['min_replicas']}..{ray_cfg.max_replicas} (autoscaling)"
        if ray_cfg.autoscaling
        else str(opts["num_replicas"])
    )
    stop = threading.Event()

    def on_signals() -> None:  # again after ray.init, whose handler would abort on SIGTERM
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
