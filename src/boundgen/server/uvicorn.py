"""Run an app under uvicorn with a graceful drain: on SIGTERM/SIGINT readiness turns 503 at once,
the listening socket closes, in-flight requests finish (up to `drain_timeout_s`), then the model
pool stops."""

from __future__ import annotations

from types import FrameType
from typing import Any

import uvicorn

from boundgen.server.config import ServerConfig


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True  # /health and /v2/health/ready answer 503 from now on
        super().handle_exit(sig, frame)


def serve(app: Any, config: ServerConfig) -> None:
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
        timeout_keep_alive=30,
        backlog=max(2048, config.max_queue * 2),
    )
    DrainingServer(uv_config, app.state.boundgen).run()
