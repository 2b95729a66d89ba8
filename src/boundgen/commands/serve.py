"""`boundgen serve`: the HTTP API (SGLang score, Cohere/vLLM rerank, OpenAI embeddings, KServe v2)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from boundgen.cliargs import add_dataclass_args, from_args
from boundgen.config import EngineConfig
from boundgen.server.config import ServerConfig, load_config_file

HELP = (
    "serve a model over HTTP (/v1/score, /v1/rerank, /v1/embeddings, /v1/beam, KServe v2, /metrics)"
)

log = logging.getLogger("boundgen.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML/TOML file with server and engine settings; flags override it",
    )
    add_dataclass_args(parser.add_argument_group("server"), ServerConfig)
    add_dataclass_args(parser.add_argument_group("engine"), EngineConfig)
    from boundgen.serve_ray import add_ray_arguments  # flags only: Ray itself is imported on use

    add_ray_arguments(parser.add_argument_group("ray serve (pip install 'boundgen[ray]')"))


def resolve_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    server, engine = load_config_file(args.config) if args.config else (ServerConfig(), None)
    engine_given = engine is not None and engine != EngineConfig()
    server = from_args(ServerConfig, args, base=server).validate()
    engine = from_args(EngineConfig, args, base=engine or EngineConfig())
    device_given = getattr(args, "device", None) is not None or (
        engine_given and engine.device != "cpu"
    )
    if not device_given:
        import torch

        # A new user gets the GPU when there is one.
        engine = dataclasses.replace(engine, device="cuda" if torch.cuda.is_available() else "cpu")
    return server, engine


def resolve_model(server: ServerConfig) -> tuple[Path, ServerConfig]:
    """`--model`, or without it the shipped demo model with its catalog trie served as `catalog`
    (`/v1/beam` with `"trie": "catalog"`), so a new user's first server gives answers a person can judge."""
    if server.model:
        return Path(server.model), server
    from boundgen.demo import default_model_path, default_trie_path

    tries = server.tries or (f"catalog={default_trie_path()}",)
    return default_model_path(), dataclasses.replace(server, tries=tries).validate()


def run(args: argparse.Namespace) -> int:
    from boundgen.compile import cli_startup
    from boundgen.serve_ray import run_from_args, wants_ray

    cli_startup()  # may re-exec with the libstdc++ preload AOTInductor needs (DESIGN §10)

    if wants_ray(args):
        return run_from_args(args)
    server_config, engine_config = resolve_configs(args)
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    model, server_config = resolve_model(server_config)

    from boundgen.engine import Engine
    from boundgen.server.app import create_app
    from boundgen.server.uvicorn import serve

    engine = Engine.from_pretrained(
        model, device=engine_config.device, dtype=engine_config.dtype, config=engine_config
    )
    app = create_app(engine, server_config)
    if server_config.gc_freeze:
        from boundgen.server.heap import freeze_startup_heap

        freeze_startup_heap()
    print(
        f"boundgen serve: {engine.model_name} ({model}) on {engine.device} at "
        f"http://{server_config.host}:{server_config.port}",
        file=sys.stderr,
        flush=True,
    )
    serve(app, server_config)
    return 0
