"""`boundgen serve`: the HTTP API (SGLang score, Cohere/vLLM rerank, OpenAI embeddings, KServe v2),
in this process or on Ray Serve replicas."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from boundgen.server.config import (
    add_serve_flags,
    engine_device_given,
    settings_from_args,
    wants_ray,
)

HELP = (
    "serve a model over HTTP (/v1/score, /v1/rerank, /v1/embeddings, /v1/beam, KServe v2, /metrics)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:  # the server's packages come with an extra: say which, before loading anything
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"needs the '{exc.name}' package: pip install 'boundgen[server]'"
        ) from None
    from boundgen.compile.preload import cli_startup

    cli_startup()  # may re-exec with the libstdc++ preload AOTInductor needs (DESIGN §10)
    settings = settings_from_args(args)
    server, engine = settings.server, settings.engine
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model, server = server.with_default_model()
    ray = wants_ray(args, settings)
    if ray and server.frontends:
        raise ValueError(
            "frontends: a Ray Serve replica is its own process behind Ray's proxy; serve with "
            "--frontends 0 (what an unset --frontends is on Ray)"
        )
    if not engine_device_given(args, settings):  # a new user gets the GPU when there is one
        if ray:
            from boundgen.serve_ray import cluster_has_gpus

            has_gpu = cluster_has_gpus(settings.ray)
        else:
            import torch

            has_gpu = torch.cuda.is_available()
        engine = dataclasses.replace(engine, device="cuda" if has_gpu else "cpu")
    if ray:
        from boundgen.serve_ray import run as run_on_ray

        return run_on_ray(model, server, engine, settings.ray)

    from boundgen import cuda_waits
    from boundgen.engine import Engine
    from boundgen.server.app import create_app
    from boundgen.server.gil import set_switch_interval
    from boundgen.server.uvicorn import serve

    server = server.with_frontends_for(engine.device)  # unset: frontends on a GPU (config.py)
    if server.gil_switch_ms is not None:
        set_switch_interval(server.gil_switch_ms)
    if server.gc_freeze:
        from boundgen.server.heap import freeze_startup_heap, pause_until_ready

        pause_until_ready()
    if server.frontends:  # the engine's threads sleep while they wait for the GPU (`cuda_waits`)
        cuda_waits.set_default("block")
    engine_obj = Engine.from_pretrained(model, config=engine)
    if server.frontends:
        from boundgen.server import frontends
        from boundgen.server.app import log_exposure
        from boundgen.server.state import ServerState

        server = server.validate()
        log_exposure(server)
        state = ServerState(engine_obj, server)
    else:
        app = create_app(engine_obj, server)
        state = app.state.boundgen
    if server.gc_freeze:
        warming = bool(state.warmup)
        freeze_startup_heap(ready=not warming)
        if warming:  # and what the warm-up made; the collector resumes then
            state.after_warm_up.append(freeze_startup_heap)
    how = f" through {server.frontends} frontend processes" if server.frontends else ""
    if engine_obj.device.type == "cuda":  # (the default differs with frontends: say which)
        how += f", GPU waits {cuda_waits.policy()} (BOUNDGEN_CUDA_WAIT)"
    print(
        f"boundgen serve: {engine_obj.model_name} ({model}) on {engine_obj.device} at "
        f"http://{server.host}:{server.port}{how}",
        file=sys.stderr,
        flush=True,
    )
    if server.frontends:
        return frontends.run(state, server)
    serve(app, server)
    return 0
