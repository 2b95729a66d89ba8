"""Readiness waits for the warm-up: /health and /v2/health/ready answer 503 (saying why) until the
warm-up requests have run, liveness and the rest of the API answer meanwhile; a failing warm-up
keeps the server not ready; a bad profile stops the start."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")  # server-only: skipped, not a collection error, without the server
from fastapi.testclient import TestClient

from boundgen.server.app import create_app
from boundgen.server.config import ServerConfig

LOCAL = "http://localhost"


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_not_ready_until_the_warm_up_has_run(engine_for):
    app = create_app(engine_for(), ServerConfig())
    state = app.state.boundgen
    release, ran = threading.Event(), []
    real = state.warmup
    assert [what for what, _ in real][:2] == ["score 64+4x16", "embed 1 texts"]

    def held():  # the first warm-up request waits until the test has looked
        release.wait(10)
        ran.append("held")

    state.warmup = [("held", held), *real]
    with TestClient(app, base_url=LOCAL) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/metrics").status_code == 200
        release.set()
        wait_for(lambda: client.get("/health").status_code == 200)
        assert client.get("/v2/health/ready").json() == {"ready": True}
    assert ran == ["held"]


def test_a_failing_warm_up_keeps_the_server_not_ready(engine_for):
    app = create_app(engine_for(), ServerConfig())

    def broken():
        raise RuntimeError("CUDA error: out of memory")

    app.state.boundgen.warmup = [("broken", broken)]
    with TestClient(app, base_url=LOCAL) as client:
        wait_for(lambda: "failed" in app.state.boundgen.unready)
        r = client.get("/health")
        assert r.status_code == 503
        assert "warm-up failed: RuntimeError: CUDA error: out of memory" in r.text


def test_off_means_ready_at_once(engine_for):
    app = create_app(engine_for(), ServerConfig(warmup="off"))
    assert app.state.boundgen.warmup == []
    with TestClient(app, base_url=LOCAL) as client:
        assert client.get("/health").status_code == 200


def test_a_profile_file_and_its_errors(engine_for, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps([{"kind": "beam", "prompt_tokens": 8, "width": 2, "count": 2}]))
    app = create_app(engine_for(), ServerConfig(warmup=str(path)))
    assert [what for what, _ in app.state.boundgen.warmup] == [
        "beam 1x8 W2 S1",
        "beam 2x8 W2 S1",
    ]
    path.write_text(json.dumps([{"kind": "beam", "prompt_tokens": 8, "trie": "items"}]))
    with pytest.raises(ValueError, match="unknown trie 'items'"):
        create_app(engine_for(), ServerConfig(warmup=str(path)))
    with pytest.raises(ValueError, match="warm-up profile .*missing.json"):
        create_app(engine_for(), ServerConfig(warmup=str(tmp_path / "missing.json")))


def test_hooks_run_after_a_successful_warm_up_before_readiness(engine_for):
    """The serving process freezes the heap the warm-up grew (`after_warm_up`) before it says ready;
    a failing hook is a failed warm-up."""
    app = create_app(engine_for(), ServerConfig())
    state = app.state.boundgen
    seen = []
    state.after_warm_up.append(lambda: seen.append(state.ready))
    with TestClient(app, base_url=LOCAL) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
    assert seen == [False]

    app = create_app(engine_for(), ServerConfig())

    def broken():
        raise MemoryError("no room to freeze")

    app.state.boundgen.after_warm_up.append(broken)
    with TestClient(app, base_url=LOCAL) as client:
        wait_for(lambda: "failed" in app.state.boundgen.unready)
        assert "warm-up failed: MemoryError: no room to freeze" in client.get("/health").text


@pytest.mark.parametrize("fails", [False, True])
def test_collector_paused_during_start_up_resumes_at_ready_or_failure(engine_for, fails):
    """`boundgen serve` pauses the cyclic collector until ready (the warm-up's tracing made it run
    collection after collection); it resumes after the warm-up, and after a failed one too."""
    import gc

    from boundgen.server.heap import freeze_startup_heap, pause_until_ready

    app = create_app(engine_for(), ServerConfig())
    state = app.state.boundgen
    if fails:

        def broken():
            raise MemoryError("no room")

        state.after_warm_up.append(broken)
    try:
        pause_until_ready()
        freeze_startup_heap(ready=False)
        assert not gc.isenabled()
        state.after_warm_up.append(freeze_startup_heap)
        with TestClient(app, base_url=LOCAL) as client:
            if fails:
                wait_for(lambda: "failed" in state.unready)
            else:
                wait_for(lambda: client.get("/health").status_code == 200)
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_shutdown_during_the_warm_up_stops_it_and_waits(engine_for):
    """A server stopped while it warms up runs no further warm-up request and waits for the one
    running: a process that exited with the warm-up thread inside torch aborted ("terminate called
    without an active exception", status 134)."""
    app = create_app(engine_for(), ServerConfig())
    state = app.state.boundgen
    started, ran = threading.Event(), []

    def slow(name):
        def call():
            started.set()
            time.sleep(0.3)
            ran.append(name)

        return call

    state.warmup = [(f"slow {i}", slow(i)) for i in range(5)]
    with TestClient(app, base_url=LOCAL):
        assert started.wait(10)
    # the lifespan's exit stopped it after the request that was running, and waited for it
    assert ran == [0]
    assert not state._warming.is_alive()
    assert (state.ready, state.unready) == (False, "shutting down")
