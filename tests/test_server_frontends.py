"""HTTP frontend processes (`boundgen serve --frontends N`): the link's frames and errors, a
frontend's app against the engine's state over a real Unix socket (the same replies as the
in-process app, errors from the engine's admission, metrics and readiness in the engine's one
registry, cancellation), and `boundgen serve --frontends 2` as processes."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from boundgen import Engine, Trie
from boundgen.server.app import build_app, create_app
from boundgen.server.config import ServerConfig
from boundgen.server.engine_link import EngineLink
from boundgen.server.errors import Overloaded, ServerError, Timeout
from boundgen.server.frontend import connect
from boundgen.server.link import TrieRef, Wire, encode, error_fields, rebuild_error
from boundgen.server.state import ServerState
from boundgen.server.testing import ServeProcess, inflight, tiny_model_dir, wait_until

TRIE_SEQS = [[5, 6, 7], [5, 6, 8], [5, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tries") / "catalog.jsonl"
    Trie.from_sequences(TRIE_SEQS, item_ids=[100, 101, 102, 103]).save(path)
    return ServerConfig(tries=(f"catalog={path}",), warmup="off").validate()


# ---- the wire -----------------------------------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_frames_split_and_joined_arrive_whole_and_in_order():
    got = []
    wire = Wire(lambda w, m: got.append(m))
    messages = [("infer", i, "score", {"ids": list(range(i * 50))}, 100, i) for i in range(5)]
    data = b"".join(encode(m) for m in messages)
    # one byte at a time, then everything at once
    for i in range(len(data)):
        wire.data_received(data[i : i + 1])
    wire.data_received(data)
    assert got == messages + messages


def test_a_turns_messages_go_in_one_write():
    async def main() -> list[bytes]:
        wire = Wire(lambda w, m: None)
        wire.connection_made(_Transport())
        wire.send(("done", 1, [1.0], None))
        wire.send(("done", 2, [2.0], None))
        assert wire.transport.written == []  # written at the end of the turn
        await asyncio.sleep(0)
        return wire.transport.written

    (written,) = asyncio.run(main())
    got = []
    Wire(lambda w, m: got.append(m)).data_received(written)
    assert got == [("done", 1, [1.0], None), ("done", 2, [2.0], None)]


def test_errors_cross_the_link_as_the_same_class_status_and_headers():
    exc = Overloaded("busy; retry after 2s", headers={"Retry-After": "2"})
    again = rebuild_error(pickle.loads(pickle.dumps(error_fields(exc))))
    assert type(again) is Overloaded
    assert (again.status, again.message, again.headers) == (429, exc.message, {"Retry-After": "2"})
    # a class the link does not know comes back as a plain 500
    fields = ("NoSuchError", "boom", None, {}, 500)
    assert type(rebuild_error(fields)) is ServerError


# ---- a frontend's app over the link, in one process ---------------------------------------------


class _Served:
    """The engine's state behind its link and a frontend's app over it, on one event loop."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config

    async def __aenter__(self) -> _Served:
        self.tmp = tempfile.TemporaryDirectory()
        path = os.path.join(self.tmp.name, "engine.sock")
        self.state = ServerState(self.engine, self.config)
        self.link = EngineLink(self.state)
        await self.link.start(path)
        self.lost: list[bool] = []
        sock, self.frontend = await asyncio.to_thread(
            connect, path, 0, self.config, lambda: self.lost.append(True)
        )
        self.frontend_link = self.frontend.link
        app = build_app(
            self.frontend,
            self.config,
            on_start=lambda: self.frontend_link.attach(sock),
            on_stop=lambda: None,
        )
        await self.frontend_link.attach(sock)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        await self.link.close()
        self.state.close()
        self.tmp.cleanup()


def _in_process(engine: Engine, config: ServerConfig) -> httpx.AsyncClient:
    app = create_app(engine, config)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


REQUESTS = [
    ("/v1/score", {"query": [1, 2, 3], "items": [[4, 5], [6]], "label_token_ids": [7, 8]}),
    ("/v1/score", {"query": "a query", "items": ["one", "two"], "label_token_ids": [7, 8]}),
    ("/v1/beam", {"prompt": [1, 2, 3], "beam_width": 3, "steps": 3, "trie": "catalog"}),
    ("/v1/beam", {"prompt": [1, 2, 3], "beam_width": 2, "steps": 2}),
    ("/v1/embeddings", {"input": ["hello there", "general kenobi"]}),
    ("/tokenize", {"prompt": "hello there"}),
]


def test_a_frontend_answers_what_the_in_process_app_answers(engine, config):
    _same_replies(engine, config)


@pytest.mark.gpu
def test_a_frontend_answers_what_the_in_process_app_answers_on_cuda(model_dir, config):
    """As above with the engine on the GPU (where `serve` starts frontends by default): every
    route's reply through a frontend equals the in-process app's over the same engine."""
    _same_replies(Engine.from_pretrained(model_dir, device="cuda", dtype="bfloat16"), config)


def _same_replies(engine, config) -> None:
    async def main() -> None:
        local = _in_process(engine, config)
        async with _Served(engine, config) as served:
            for path, body in REQUESTS:
                # each shape once first: on CUDA a shape's first forward may run before its graph
                # exists (and another bucket, padded otherwise: bf16 sums in another order)
                assert (await local.post(path, json=body)).status_code == 200, path
                mine, theirs = (
                    await served.http.post(path, json=body),
                    await local.post(path, json=body),
                )
                assert (mine.status_code, path) == (200, path), mine.text
                a, b = mine.json(), theirs.json()
                for reply in (a, b):
                    if isinstance(reply, dict):
                        reply.pop("created", None)
                        reply.pop("id", None)
                assert a == b, path
            assert (await served.http.get("/v1/models")).json()["data"][0]["trie_depths"] == {
                "catalog": 3
            }
        await local.aclose()

    asyncio.run(main())


def test_the_frontend_validates_and_the_engine_admits(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:
            seen = []  # what reached the engine's `Infer`
            start = served.state.infer.start
            served.state.infer.start = lambda *a: (seen.append(a[0]), start(*a))[1]
            # refused by the frontend's own checks: the engine never sees it
            bad = await served.http.post(
                "/v1/beam", json={"prompt": [1], "beam_width": 2, "steps": 3, "trie": "nope"}
            )
            assert bad.status_code == 400 and "unknown trie 'nope'" in bad.text
            assert seen == []
            assert (await served.http.post("/v1/score", json=REQUESTS[0][1])).status_code == 200
            assert seen == ["score"]
            # refused by the engine's admission: the same status, type and message back
            served.state.infer.close()
            shut = await served.http.post("/v1/score", json=REQUESTS[0][1])
            assert shut.status_code == 503
            assert shut.json()["message"] == "server is shutting down"

    asyncio.run(main())


def test_metrics_and_statistics_are_the_engines_one_registry(engine, config):
    def count(text: str, series: str) -> float:
        found = re.search(re.escape(series) + r" ([0-9.e+]+)", text)
        return float(found.group(1)) if found else 0.0

    async def main() -> None:
        async with _Served(engine, config) as served:
            for _ in range(3):
                assert (await served.http.post("/v1/score", json=REQUESTS[0][1])).status_code == 200
            assert (await served.http.post("/v1/beam", json=REQUESTS[2][1])).status_code == 200
            text = (await served.http.get("/metrics")).text
            local = served.state.metrics.render()[0].decode()
            for series in (
                'boundgen_requests_total{endpoint="score",status="200"}',
                'boundgen_items_total{endpoint="score"}',
                'boundgen_items_total{endpoint="beam"}',
            ):
                assert count(text, series) == count(local, series) > 0, series
            assert count(text, 'boundgen_requests_total{endpoint="score",status="200"}') == 3
            assert count(text, 'boundgen_items_total{endpoint="beam"}') == 3  # 3 beams
            infer = {
                "inputs": [
                    {"name": "query", "datatype": "BYTES", "shape": [1], "data": ["q"]},
                    {"name": "items", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
                    {"name": "label_token_ids", "datatype": "INT64", "shape": [2], "data": [7, 8]},
                ]
            }
            name = served.frontend.model_name
            assert (
                await served.http.post(f"/v2/models/{name}/infer", json=infer)
            ).status_code == 200
            stats = (await served.http.get("/v2/models/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 1
            assert served.state.kserve_stats.inference_count == 1

    asyncio.run(main())


def test_a_frontends_loop_lag_and_cpu_are_exported_by_the_engine(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:
            reporting = asyncio.create_task(served.frontend.metrics.report(3, every_s=0.05))
            await asyncio.sleep(0.3)
            reporting.cancel()
            await asyncio.sleep(0)
            text = (await served.http.get("/metrics")).text
            cpu = re.search(
                r'boundgen_frontend_cpu_seconds_total\{frontend="3"\} ([0-9.e+-]+)', text
            )
            assert cpu is not None and float(cpu.group(1)) > 0
            lags = re.search(r"boundgen_frontend_event_loop_lag_seconds_count ([0-9.e+]+)", text)
            assert lags is not None and float(lags.group(1)) >= 10  # a probe every 10 ms
            assert "boundgen_frontend_event_loop_lag_max_seconds " in text

    asyncio.run(main())


def test_readiness_is_the_engines(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:
            assert (await served.http.get("/health")).status_code == 200
            served.state.ready, served.state.unready = False, "warming up (2/9 requests done)"
            for _ in range(50):  # pushed within the link's status poll
                reply = await served.http.get("/health")
                if reply.status_code == 503:
                    break
                await asyncio.sleep(0.02)
            assert reply.status_code == 503 and "warming up (2/9" in reply.text
            served.state.ready, served.state.unready = True, ""
            for _ in range(50):
                if (await served.http.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            assert served.frontend.ready and not served.frontend.draining
            served.state.draining = True  # the engine's process got SIGTERM
            for _ in range(50):
                reply = await served.http.get("/v2/health/ready")
                if reply.status_code == 503:
                    break
                await asyncio.sleep(0.02)
            assert reply.status_code == 503 and "shutting down" in reply.text
            assert served.frontend.draining

    asyncio.run(main())


class _StuckWork:
    def __init__(self, on_done) -> None:
        self.on_done, self.cancelled = on_done, asyncio.Event()

    def cancel(self) -> bool:  # as the runtime's request: its end reported on the loop
        self.cancelled.set()
        asyncio.get_running_loop().call_soon(self.on_done, None, asyncio.CancelledError(), None)
        return True


class _StuckInfer:
    """An `Infer` whose requests never finish until cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.work: list[_StuckWork] = []

    def start(self, kind, request, timeout_ms, tokens, on_done) -> _StuckWork:
        self.started.set()
        self.work.append(_StuckWork(on_done))
        return self.work[-1]


def test_a_client_gone_cancels_the_work_in_the_engine(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:
            stuck = served.state.infer = _StuckInfer()
            call = asyncio.ensure_future(served.frontend.infer("score", {"x": 1}, 1000, 3))
            await asyncio.wait_for(stuck.started.wait(), 5)
            assert len(served.link._work) == 1
            call.cancel()  # what the guard does when the client disconnects
            await asyncio.wait_for(stuck.work[0].cancelled.wait(), 5)
            await asyncio.sleep(0.01)
            assert served.link._work == {} and served.link._tasks == {}

    asyncio.run(main())


def test_a_lost_engine_fails_the_waiting_requests_and_stops_the_frontend(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:
            served.state.infer = _StuckInfer()
            call = asyncio.ensure_future(served.frontend.infer("score", {"x": 1}, 1000, 3))
            await asyncio.sleep(0.05)
            for wire in list(served.link.wires):
                wire.close()  # the engine's process is gone
            with pytest.raises(ServerError) as err:
                await asyncio.wait_for(call, 5)
            assert err.value.status == 503
            assert served.lost == [True]
            assert not served.frontend.ready and served.frontend.draining

    asyncio.run(main())


def test_beam_requests_name_their_trie_and_get_the_engines(engine, config):
    state = ServerState(engine, config)
    link = EngineLink(state)
    fields = link._resolve({"prompts": [[1]], "trie": TrieRef("catalog", 3)})
    assert fields["trie"] is state.tries["catalog"]
    state.close()


def test_engine_timeouts_come_back_as_504(engine, config):
    async def main() -> None:
        async with _Served(engine, config) as served:

            class Late:  # an `Infer` whose requests reach their deadline
                def start(self, kind, request, timeout_ms, tokens, on_done):
                    late = Timeout(f"request did not finish within timeout_ms={timeout_ms}")
                    asyncio.get_running_loop().call_later(0.01, on_done, None, late, None)
                    return _StuckWork(on_done)

            served.state.infer = Late()
            reply = await served.http.post("/v1/score", json={**REQUESTS[0][1], "timeout_ms": 7})
            assert reply.status_code == 504
            assert reply.json()["message"] == "request did not finish within timeout_ms=7"

    asyncio.run(main())


# ---- processes ----------------------------------------------------------------------------------


def test_serve_with_two_frontends_serves_and_drains(model_dir, tmp_path):
    with ServeProcess("--model", str(model_dir), "--device", "cpu", "--frontends", "2") as srv:
        for _ in range(6):  # new connections: the kernel spreads them over the two
            reply = httpx.post(srv.url + "/v1/score", json=REQUESTS[0][1], timeout=30)
            assert reply.status_code == 200, reply.text
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'boundgen_requests_total{endpoint="score",status="200"} 6.0' in metrics

        # each frontend reports its CPU time from its start; the server is ready once the engine
        # is, so on a loaded machine the second may still be importing (CI, 2026-12-05)
        def reported() -> bool:
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            return all(
                f'boundgen_frontend_cpu_seconds_total{{frontend="{index}"}}' in text
                for index in (0, 1)
            )

        assert wait_until(reported, 60)
        frontends = [pid for pid in _children(srv.proc.pid) if "spawn_main" in _cmdline(pid)]
        assert len(frontends) == 2, frontends
        code, out = srv.stop()
    assert code == 0, out[-3000:]
    assert "2 frontend processes serving" in out
    assert [pid for pid in frontends if _alive(pid)] == []  # stopped with the server


def test_a_frontend_process_serves_every_route_without_torch(model_dir):
    """A frontend process runs the whole HTTP API without importing torch (the engine's process
    holds the model): its memory maps no libtorch after requests to every kind of route, and it
    stays small (a frontend that imported torch through the server modules held ~256 MB on this
    CPU build and took 2.7 s to start)."""
    name = model_dir.name
    infer = {
        "inputs": [
            {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["the user likes"]},
            {"name": "items", "shape": [2], "datatype": "BYTES", "data": [" red", " a hat"]},
            {"name": "label_token_ids", "shape": [2], "datatype": "INT64", "data": [3, 7]},
        ]
    }
    embed = {"input": ["hello"], "encoding_format": "base64", "embed_dtype": "bfloat16"}
    posts = [
        *REQUESTS[:2],
        REQUESTS[3],
        *REQUESTS[4:],
        ("/v1/embeddings", embed),
        ("/v1/embeddings", {**embed, "encoding_format": "bytes"}),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("/v2/rerank", {"query": "q", "documents": ["a", "b"], "model": name}),
        ("/rerank", {"query": "q", "texts": ["a", "b"]}),
        ("/embed", {"inputs": "hello"}),
        ("/v2/embed", {"texts": ["hello"], "embedding_types": ["int8", "ubinary"]}),
        ("/v1/classify", {"input": ["a"]}),
        (f"/v2/models/{name}/infer", infer),
        ("/v1/score", {"query": [1], "items": [[2]], "label_token_ids": [10**9]}),  # a 400
    ]
    gets = ["/health", "/v1/models", "/metrics", f"/v2/models/{name}", f"/v2/models/{name}/stats"]
    with ServeProcess("--model", str(model_dir), "--device", "cpu", "--frontends", "1") as srv:
        (frontend,) = [pid for pid in _children(srv.proc.pid) if "spawn_main" in _cmdline(pid)]
        answered = []
        for path, body in posts:
            answered.append((path, httpx.post(srv.url + path, json=body, timeout=30).status_code))
        for path in gets:
            answered.append((path, httpx.get(srv.url + path, timeout=30).status_code))
        assert [a for a in answered if a[1] >= 500] == []
        assert sum(code == 200 for _, code in answered) >= len(answered) - 3, answered
        with open(f"/proc/{frontend}/maps") as f:
            torch_maps = [line for line in f if "libtorch" in line]
        with open(f"/proc/{frontend}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    assert torch_maps == []
    assert rss_kb < 160_000, f"{rss_kb} kB resident"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_client_that_goes_away_frees_the_engine_behind_a_frontend():
    """The client of a long request disconnects: its frontend cancels it over the link and the
    engine drops the work at once, not when the request would have ended (`boundgen_inflight`,
    the engine's admitted requests, back to 0)."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, 1800) for _ in range(n)]
    heavy = {
        "query": ids(16),
        "items": [ids(200) for _ in range(256)],
        "label_token_ids": [299, 272],
    }
    with ServeProcess("--device", "cpu", "--frontends", "1") as srv:
        alone = time.monotonic()
        assert httpx.post(srv.url + "/v1/score", json=heavy, timeout=120).status_code == 200
        alone = time.monotonic() - alone  # what the heavy request takes on this machine
        body = json.dumps(heavy).encode()
        host, port = srv.url.removeprefix("http://").split(":")
        head = (
            f"POST /v1/score HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            assert wait_until(lambda: inflight(srv) == 1, 10)  # admitted by the engine
            start = time.monotonic()
        assert wait_until(lambda: inflight(srv) == 0, alone)
        freed = time.monotonic() - start
        # the cut is between the pieces of its forward: at most one piece runs on
        assert freed < 0.5 * alone, (freed, alone)
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'boundgen_requests_total{endpoint="score",status="499"} 1.0' in metrics


def test_serve_refuses_frontends_on_ray(model_dir):
    cmd = [sys.executable, "-m", "boundgen.cli", "serve", "--model", str(model_dir)]
    done = subprocess.run(
        [*cmd, "--device", "cpu", "--frontends", "2", "--ray"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "a Ray Serve replica is its own process" in done.stderr


class _Loaded(Exception):
    pass


@pytest.mark.parametrize(
    "frontends, device, wait",
    [(0, "cpu", "spin"), (2, "cpu", "block"), (None, "cpu", "spin"), (None, "cuda", "block")],
)
def test_serve_with_frontends_makes_the_engines_gpu_waits_sleep(
    model_dir, monkeypatch, frontends, device, wait
):
    """`serve --frontends N` sets sleeping GPU waits as its engine process's default before the
    engine loads (`cuda_waits`); BOUNDGEN_CUDA_WAIT still decides when set. Unset, frontends run
    on a GPU (four on these eight cores) and not on the CPU."""
    from boundgen import cuda_waits
    from boundgen.cli import build_parser
    from boundgen.commands import serve
    from boundgen.engine import Engine

    seen = []

    def load(*a, **k):
        seen.append(cuda_waits.policy())
        raise _Loaded

    monkeypatch.setattr(cuda_waits, "_default", "spin")
    monkeypatch.delenv("BOUNDGEN_CUDA_WAIT", raising=False)
    monkeypatch.setattr(Engine, "from_pretrained", load)
    monkeypatch.setattr("boundgen.compile.preload.cli_startup", lambda: None)
    monkeypatch.setattr("boundgen.server.heap.pause_until_ready", lambda: None)  # keeps gc on
    monkeypatch.setattr("boundgen.server.config.usable_cores", lambda: 8)
    argv = ["serve", "--model", str(model_dir), "--device", device]
    if frontends is not None:
        argv += ["--frontends", str(frontends)]
    args = build_parser().parse_args(argv)
    with pytest.raises(_Loaded):
        serve.run(args)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "spin")
    with pytest.raises(_Loaded):
        serve.run(args)
    assert seen == [wait, "spin"]


def test_unset_frontends_are_one_per_two_cores_on_a_gpu_at_most_four():
    from boundgen.server.config import auto_frontends

    assert [auto_frontends("cuda", c) for c in (1, 2, 3, 4, 8, 16, 128)] == [0, 1, 1, 2, 4, 4, 4]
    assert auto_frontends("cuda:1", 6) == 3
    assert auto_frontends("cpu", 16) == 0


def test_given_frontends_are_kept_and_unset_ones_decided_for_the_device(monkeypatch):
    monkeypatch.setattr("boundgen.server.config.usable_cores", lambda: 6)
    assert ServerConfig().with_frontends_for("cuda").frontends == 3
    assert ServerConfig().with_frontends_for("cpu").frontends == 0
    assert ServerConfig(frontends=0).with_frontends_for("cuda").frontends == 0
    assert ServerConfig(frontends=2).with_frontends_for("cpu").frontends == 2


def test_negative_frontends_is_refused():
    with pytest.raises(ValueError, match="frontends must be >= 0"):
        ServerConfig(frontends=-1).validate()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class _FakeProcess:
    def __init__(self, alive: bool = True, exitcode: int | None = None) -> None:
        self.alive, self.exitcode = alive, exitcode

    def is_alive(self) -> bool:
        return self.alive


def test_a_frontend_that_dies_is_restarted_unless_it_died_at_its_start(monkeypatch):
    from boundgen.server import frontends

    pool = frontends.Frontends(ServerConfig(frontends=2), "/nowhere", listener=None)
    spawned: list[int] = []

    def spawn(index: int) -> _FakeProcess:
        spawned.append(index)
        return _FakeProcess()

    monkeypatch.setattr(pool, "_spawn", spawn)
    pool.start()
    assert spawned == [0, 1] and pool.check() is None
    # frontend 1 dies after running a while: a new one takes its place
    pool.processes[1] = _FakeProcess(alive=False, exitcode=-9)
    pool.started[1] -= frontends.FAST_FAIL_S + 1
    assert pool.check() is None
    assert spawned == [0, 1, 1] and pool.restarts == 1 and pool.processes[1].is_alive()
    # frontend 0 dies right after its start (a broken environment): the server stops
    pool.processes[0] = _FakeProcess(alive=False, exitcode=1)
    why = pool.check()
    assert why is not None and why.startswith("frontend 0 exited with status 1")
    assert spawned == [0, 1, 1]
