"""Helpers for server tests and load tests: a cached tiny checkpoint, an engine whose model calls
are slow, a free port, the ASGI scope of an HTTP request as uvicorn hands it over, a `boundgen
serve` subprocess that is started and stopped cleanly, and a frontend's app over the engine's link
in one process (`frontend_app`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


def tiny_model_dir(root: str | os.PathLike | None = None, seq_cls: int | None = None) -> Path:
    """The `tiny` preset under `root` (default: the boundgen cache), made once."""
    from boundgen.checkpoints import default_model_dir, make_model

    name = "tiny-server-test" + (f"-cls{seq_cls}" if seq_cls else "")
    out = Path(root or default_model_dir()) / name
    if not (out / "config.json").exists():
        make_model("tiny", out, seq_cls=seq_cls, progress=False, overwrite=True)
    return out


class _SlowRunner:
    """A runner that first sleeps `delay_s` in every forward and every beam search."""

    def __init__(self, runner: Any, delay_s: float):
        self._runner = runner
        self.delay_s = delay_s

    def rows(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay_s)
        return self._runner.rows(*args, **kwargs)

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay_s)
        return self._runner.beam_search(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def slow_engine(engine: Any, delay_s: float) -> Any:
    """An engine over `engine`'s model whose every model call first sleeps `delay_s` (to test
    queues, deadlines, drains); concurrent requests merged into one batch sleep once."""
    return engine.with_runner(_SlowRunner(engine.runner, delay_s))


def http_scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    """The ASGI scope uvicorn gives an app for an HTTP/1.1 request from 127.0.0.1 to
    127.0.0.1:8000 (header names lowercased, as uvicorn does)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "state": {},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`boundgen serve ...` on 127.0.0.1 and a free port; `stop()` sends SIGTERM and waits."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "boundgen.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._wait_ready(startup_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"boundgen serve exited with {self.proc.returncode}:\n"
                    + (self.proc.stdout.read() if self.proc.stdout else "")
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"boundgen serve did not become ready in {timeout_s}s")

    def stop(self, timeout_s: float = 30.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out or ""

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def inflight(server: ServeProcess) -> float:
    """A running server's admitted requests not done yet (`boundgen_inflight` in /metrics)."""
    import re

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^boundgen_inflight (\S+)$", text, re.M).group(1))


def wait_until(condition: Any, timeout_s: float) -> bool:
    """Poll `condition()` every 10 ms for up to `timeout_s`: → whether it came true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


@contextlib.contextmanager
def frontend_app(engine: Any, config: Any) -> Iterator[tuple[Any, Any]]:
    """`boundgen serve --frontends` in one process, for tests: the engine's `ServerState` behind
    its link on an event loop of its own (a thread), and a frontend's app over a real Unix socket
    to it. → (the app, whose lifespan attaches the link: use it under `TestClient(app)` as a
    context manager; the engine's `ServerState`)."""
    import asyncio
    import tempfile
    import threading

    from boundgen.server.app import build_app
    from boundgen.server.engine_link import EngineLink
    from boundgen.server.frontend import connect
    from boundgen.server.state import ServerState

    config = config.validate()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
    thread.start()
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.sock")

        async def start() -> tuple[ServerState, EngineLink]:
            state = ServerState(engine, config)
            link = EngineLink(state)
            await link.start(path)
            return state, link

        state, link = on_loop(start())
        sock, frontend = connect(path, 0, config)
        app = build_app(
            frontend, config, on_start=lambda: frontend.link.attach(sock), on_stop=lambda: None
        )
        try:
            yield app, state
        finally:
            on_loop(link.close())
            state.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
