"""`boundgen serve --frontends N`: the engine's process binds the port, serves the link
(`engine_link.py`) on its event loop, and starts N frontend processes (`frontend.py`) that accept
the port's connections and run the HTTP API; it restarts one that dies, and on SIGTERM/SIGINT
drains them (each finishes its in-flight requests, which the engine still serves) before the
runtime stops.

Nothing HTTP runs in the engine's process then: its Python is the link's messages, `Infer`, the
runtime and the device work — what the GIL of the process that holds the model has to do."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from typing import Any

from boundgen.host_cores import usable_cores
from boundgen.server import frontend, loop_lag
from boundgen.server.config import ServerConfig
from boundgen.server.engine_link import EngineLink
from boundgen.server.state import ServerState

log = logging.getLogger("boundgen.server")

# a frontend that exits this soon after its start is not restarted (a broken environment would
# only fail again): the server stops
FAST_FAIL_S = 10.0
SUPERVISE_S = 0.5  # how often the frontends are checked


def bind(config: ServerConfig) -> socket.socket:
    """The listening TCP socket on `config`'s host and port, for every frontend to accept on (as
    uvicorn binds one for its workers)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    sock.listen(max(2048, config.max_queue * 2))
    sock.set_inheritable(True)
    return sock


class Frontends:
    """The frontend processes: start, watch (restart one that dies), stop."""

    def __init__(self, config: ServerConfig, link_path: str, listener: socket.socket) -> None:
        self.config, self.link_path, self.listener = config, link_path, listener
        self._context = multiprocessing.get_context("spawn")  # never fork a process with CUDA
        self.processes: list[Any] = []
        self.started: list[float] = []
        self.restarts = 0

    def start(self) -> None:
        cores = usable_cores()
        if self.config.frontends >= cores:
            log.warning(
                "%d frontend processes on %d cores: with the engine's process they share cores, "
                "and a frontend waiting for a core holds its requests as a busy GIL would "
                "(fewer frontends, or more cores)",
                self.config.frontends,
                cores,
            )
        for i in range(self.config.frontends):
            self.processes.append(self._spawn(i))
            self.started.append(time.monotonic())

    def _spawn(self, index: int) -> Any:
        process = self._context.Process(
            target=frontend.main,
            args=(index, self.config, self.link_path, self.listener),
            name=f"boundgen-frontend-{index}",
            daemon=True,
        )
        process.start()
        return process

    def check(self) -> str | None:
        """Restart the frontends that died; → why the server must stop (one died at its start),
        or None."""
        for i, process in enumerate(self.processes):
            if process.is_alive():
                continue
            age = time.monotonic() - self.started[i]
            if age < FAST_FAIL_S:
                return (
                    f"frontend {i} exited with status {process.exitcode} {age:.1f} s after its "
                    "start (its log says why)"
                )
            log.error("frontend %d exited with status %s: restarting it", i, process.exitcode)
            self.processes[i] = self._spawn(i)
            self.started[i] = time.monotonic()
            self.restarts += 1
        return None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every frontend (uvicorn's graceful drain), wait up to `timeout_s`, then kill."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for i, process in enumerate(self.processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("frontend %d did not stop within %.0f s: killed", i, timeout_s)
                process.kill()
                process.join(5)


def run(state: ServerState, config: ServerConfig) -> int:
    """Serve `state`'s engine through `config.frontends` frontend processes until SIGTERM or
    SIGINT; → the exit status (1: a frontend could not start)."""
    listener = bind(config)
    try:
        return asyncio.run(_serve(state, config, listener))
    finally:
        listener.close()


async def _serve(state: ServerState, config: ServerConfig, listener: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state.start_warm_up()
    metrics = state.metrics
    lag = asyncio.create_task(loop_lag.probe(metrics.loop_lag, metrics.loop_lag_max))
    status = 0
    with tempfile.TemporaryDirectory(prefix="boundgen-link-") as tmp:  # 0700: this user only
        link = EngineLink(state)
        await link.start(os.path.join(tmp, "engine.sock"))
        pool = Frontends(config, os.path.join(tmp, "engine.sock"), listener)
        pool.start()
        log.info("%d frontend processes serving %s:%d", config.frontends, config.host, config.port)
        while not stop.is_set():
            why = pool.check()
            if why is not None:
                log.error("%s: the server stops", why)
                status = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), SUPERVISE_S)
            except TimeoutError:
                pass
        state.draining = True  # /health's 503 in every frontend from now on
        link.push_status()
        # the frontends drain their in-flight requests, which this loop keeps serving
        await asyncio.to_thread(pool.stop, config.drain_timeout_s + 5.0)
        lag.cancel()
        await link.close()
    state.stop_warm_up()  # (before the runtime closes under it)
    state.infer.close()
    state.close()
    return status
