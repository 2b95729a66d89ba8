"""Issue 19 against a live `boundgen serve` (demo model, CPU): no request can stall, exhaust or
outlive the server, and the defaults are safe. Each test sends what an attacker or a careless client
would and asserts its bound: status, time, `/health` latency measured concurrently (≤ 100 ms) and
the server's resident memory afterwards.

Each test failed on the server the issue was filed against (the bound it asserts is one fix of
docs/security.md).

Servers: `server` (every default, shared by the module), `keyed_server` (API key from the
environment), and `disposable_server`, for requests that wedge or exhaust the server they hit: it is
replaced after any test that leaves it unresponsive or still busy, and its address space is capped
so that a runaway allocation fails inside it instead of exhausting the test machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import random
import resource
import select
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_probe import HealthProbe, host_port, raw_request, read_response, rss_mib, wait_closed

from boundgen.server.testing import ServeProcess, inflight, wait_until

HEALTH_MS = 100.0  # issue 19: no request, however shaped, blocks /health for more than ~100 ms
IDLE_PROBES = 10  # /health round trips measured on the idle server first (the machine's noise)
REFUSE_S = 1.0  # a request refused by a limit is answered within this (read, parse, check)
RSS_REFUSED_MIB = 64.0  # resident memory a refused request may leave behind
# Proposed defaults (docs/security.md): the request head must arrive whole within HEADER_TIMEOUT_S
# of the connection (or of the previous response); the body within BODY_TIMEOUT_S of the head.
HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 10.0
SLACK_S = 3.0
# A request past its deadline (or whose client left) frees the model at its next chunk boundary.
AFTER_CANCEL_S = 1.0
# A 51k-token score request (forwards of up to 32k tokens) grew the demo server's RSS by ~220 MiB
# on the 2-core dev machine; cancelled work may leave no more than that.
RSS_HEAVY_MIB = 256.0
ADDRESS_SPACE_HEADROOM = 4 << 30  # disposable_server: virtual memory it may add after start-up

# A test that failed on /health's bound alone (`HealthStall`) runs once more: a stall the server
# makes (a GIL hold on its event loop, what these bounds were written against: 150-600 ms each
# time) repeats, a hiccup of the 2-core test machine does not. Such machines answered one probe in
# 129 ms (a 10 MiB reply, CI) and 103 ms (a refused 768 KiB body, a fresh-clone `.ci/run` on the
# development machine) where the same blocks measure 3-37 ms and 1-40 ms there otherwise
# (BENCHMARKS.md, 2026-12-04 nineteenth session).
pytestmark = pytest.mark.flaky(reruns=1, only_rerun=["HealthStall"])

JSON = {"Content-Type": "application/json"}
LABELS = [299, 272]  # " yes", " no" in the demo tokenizer (demo.json)
KEY = "reliability-test-key"


# ---------------------------------------------------------------------------------------- servers


def _idle(server: ServeProcess, wait_s: float = 2.0) -> bool:
    """Answers /health at once and has no admitted request left running."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200 and not inflight(
                server
            ):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def _cap_address_space(pid: int) -> None:
    with open(f"/proc/{pid}/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + ADDRESS_SPACE_HEADROOM
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--device", "cpu")
    yield proc
    proc.stop(timeout_s=10)


@pytest.fixture(scope="module")
def keyed_server():
    proc = ServeProcess("--device", "cpu", env={"BOUNDGEN_API_KEY": KEY})
    yield proc
    proc.stop(timeout_s=10)


@pytest.fixture(scope="module")
def _disposable():
    held: list[ServeProcess] = []
    yield held
    for proc in held:
        proc.stop(timeout_s=5)


@pytest.fixture
def disposable_server(_disposable):
    if not _disposable:
        proc = ServeProcess("--device", "cpu")
        _cap_address_space(proc.proc.pid)
        _disposable.append(proc)
    proc = _disposable[0]
    yield proc
    if proc.proc.poll() is not None or not _idle(proc):
        proc.stop(timeout_s=3)
        _disposable.clear()


# ---------------------------------------------------------------------------------------- helpers


class HealthStall(AssertionError):
    """/health took longer than the bound during a block (the other bounds held)."""


@contextlib.contextmanager
def bounded(server: ServeProcess, seconds: float, rss_growth_mib: float = RSS_REFUSED_MIB):
    """Around a block: /health latency sampled all along, the block's wall time (≤ `seconds`) and
    the server's RSS growth after it (≤ `rss_growth_mib`).

    /health may take at most HEALTH_MS more than it took just before the block on the idle server:
    what the server adds, not what a busy test machine adds to every round trip."""
    pid = server.proc.pid
    rss0 = rss_mib(pid)
    with HealthProbe(server.url) as probe:
        while len(probe.latencies_ms) < IDLE_PROBES:
            time.sleep(0.01)
        idle_ms = max(probe.latencies_ms)
        first = len(probe.latencies_ms)
        start = time.monotonic()
        yield
        elapsed = time.monotonic() - start
        while len(probe.latencies_ms) < first + 3:
            time.sleep(0.01)
    during = probe.latencies_ms[first:]
    assert elapsed <= seconds, f"took {elapsed:.2f} s; the bound is {seconds} s"
    grown = rss_mib(pid) - rss0
    assert grown <= rss_growth_mib, f"RSS grew {grown:.0f} MiB; the bound is {rss_growth_mib} MiB"
    if max(during) > HEALTH_MS + idle_ms:
        raise HealthStall(
            f"/health stalled: max {max(during):.0f} ms over {len(during)} probes "
            f"(idle before: max {idle_ms:.0f} ms); {probe.summary()}"
        )


def model_name(server: ServeProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"]


def infer_path(server: ServeProcess) -> str:
    return f"/v2/models/{model_name(server)}/infer"


def kserve_score(items: dict) -> dict:
    query = {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["red shoes"]}
    return {"inputs": [query, {"name": "items", **items}]}


def valid_bodies(server: ServeProcess) -> dict[str, dict]:
    """One small valid request per POST route (classify answers 400 on the demo LM: no head)."""
    rerank = {"query": "red shoes", "documents": ["red shoes", "a blue sofa"]}
    return {
        "/v1/score": {
            "query": "Query: red shoes\n",
            "items": ["Item: a\nRelevant:"],
            "label_token_ids": LABELS,
        },
        "/v1/rerank": rerank,
        "/v2/rerank": rerank,
        "/rerank": rerank,
        "/v1/classify": {"input": "red shoes"},
        "/v1/embeddings": {"input": ["red shoes"]},
        "/v1/beam": {"prompt": "Query: red shoes\nID:", "beam_width": 2, "steps": 3},
        infer_path(server): kserve_score({"shape": [1], "datatype": "BYTES", "data": ["a"]}),
    }


def token_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1800) for _ in range(n)]


def error_message(body: bytes) -> str:
    data = json.loads(body)
    err = data.get("error", data)  # SGLang's routes answer a flat error object
    return err if isinstance(err, str) else err["message"]


def send(server: ServeProcess, path: str, body: dict | bytes, headers=JSON, timeout_s=10.0):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return raw_request(server.url, "POST", path, raw, headers, timeout_s=timeout_s)


# ------------------------------------------------------------------------- limits before the work


SHAPE_BOMBS = [
    ([10**12, 0], []),  # 0 elements declared, 10^12 rows to slice
    ([2**32, 2**32], []),  # the int64 product wraps to 0
    ([6148914691236517206, 3], [1, 2]),  # the int64 product wraps to 2, and 2 values are sent
]


def test_kserve_shape_bomb_is_refused_before_allocation(disposable_server):
    path = infer_path(disposable_server)
    for shape, data in SHAPE_BOMBS:
        body = kserve_score({"shape": shape, "datatype": "INT64", "data": data})
        with bounded(disposable_server, REFUSE_S):
            status, text = send(disposable_server, path, body, timeout_s=REFUSE_S + 2)
        assert status in (400, 413), (shape, status, text[:300])
        assert "shape" in error_message(text), text[:300]
    ok = kserve_score({"shape": [1, 4], "datatype": "INT64", "data": [11, 12, 13, 14]})
    assert send(disposable_server, path, ok)[0] == 200


def huge_text_requests(chars: int, every_route: bool) -> list[tuple[str, bytes]]:
    text = ("red running shoes, size 42, Berlin. " * (chars // 36 + 1))[:chars]
    score = {"query": text, "items": ["Item: a"], "label_token_ids": LABELS}
    item = {"query": "Query: shoes\n", "items": [text], "label_token_ids": LABELS}
    out = [
        ("/v1/score", score),
        ("/v1/rerank", {"query": text, "documents": ["a"]}),
        ("/rerank", {"query": "shoes", "documents": [text]}),
    ]
    if every_route:
        out += [
            ("/v1/score", item),
            ("/v2/rerank", {"query": text, "documents": ["a"]}),
            ("/v1/rerank", {"query": "shoes", "documents": [{"text": text}]}),
        ]
    return [(path, json.dumps(body).encode()) for path, body in out]


@pytest.mark.parametrize(
    "chars,every_route",
    [(8_000_000, False), (256 << 10, True)],
    ids=["8MB-three-at-once", "256KiB-every-route"],
)
def test_huge_text_is_refused_before_tokenizing(disposable_server, chars, every_route):
    """The issue's 8 MB text, three at once; and on every route that takes text, one small enough
    for any sensible body limit but far beyond any text limit (256 Ki characters, ~100k tokens,
    where the demo model's context is 256)."""
    requests = huge_text_requests(chars, every_route)
    with (
        bounded(disposable_server, 2 * REFUSE_S),
        cf.ThreadPoolExecutor(len(requests)) as pool,
    ):
        answers = list(
            pool.map(lambda r: send(disposable_server, *r, timeout_s=6.0), requests),
        )
    for (path, _), (status, text) in zip(requests, answers):
        assert status == 413, (path, status, text[:300])


def tiny_values_body(path: str, max_bytes: int) -> bytes:
    """~max_bytes of the cheapest JSON values to send and the dearest to build: [1] or "a" each."""
    n = max_bytes // 4
    if path == "/v1/embeddings":
        return json.dumps({"input": [[1]] * n}, separators=(",", ":")).encode()
    return json.dumps(
        {"query": "q", "items": ["a"] * n, "label_token_ids": LABELS}, separators=(",", ":")
    ).encode()


def test_many_tiny_json_values_are_refused_without_a_stall(server):
    """Not in the issue's list: 768 KiB of `[1],` (~200k one-element lists) is ~0.5 s of GIL-held
    parsing and validation here, before the item count is checked."""
    for path in ("/v1/embeddings", "/v1/score"):
        body = tiny_values_body(path, 768 << 10)
        with bounded(server, REFUSE_S):
            status, text = send(server, path, body)
        assert status == 413, (path, status, text[:300])


def test_request_over_the_token_budget_is_refused_up_front(disposable_server):
    """4096 items × 60 tokens: ~20 s of the demo model on this CPU, far past the 10 s deadline."""
    rng = random.Random(0)
    body = {"query": token_ids(16, rng), "items": [token_ids(60, rng) for _ in range(4096)]}
    body["label_token_ids"] = LABELS
    with bounded(disposable_server, REFUSE_S):
        status, text = send(disposable_server, "/v1/score", body, timeout_s=REFUSE_S + 2)
    assert status == 413, (status, text[:300])
    assert "token" in error_message(text), text[:300]


def test_oversize_body_is_refused_before_it_is_read(server):
    host, port = host_port(server.url)
    head = (
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Content-Length: {n}\r\n\r\n"
    )
    with bounded(server, 2 * REFUSE_S):
        for path in ("/v1/score", infer_path(server)):
            with socket.create_connection((host, port), timeout=REFUSE_S) as sock:
                # only the head: a 413 now proves that the body was neither awaited nor parsed
                sock.sendall(head.format(path=path, host=host, port=port, n=64 << 20).encode())
                status, text = read_response(sock)
            assert status == 413, (path, status, text[:300])
        status = _send_chunked(server, "/v1/score", 12 << 20)
        assert status == 413


def _send_chunked(server: ServeProcess, path: str, total: int) -> int:
    """Stream `total` bytes with Transfer-Encoding: chunked (no Content-Length); the status."""
    host, port = host_port(server.url)
    chunk = b"x" * 65536
    with socket.create_connection((host, port), timeout=REFUSE_S) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        with contextlib.suppress(OSError):  # the server may answer and close before the end
            for _ in range(total // len(chunk)):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        return read_response(sock)[0]


# ------------------------------------------------------------------------------------ slow clients


def _trickle_head(sock: socket.socket, limit_s: float) -> float | None:
    """Send an endless header, one byte every 0.5 s: seconds until the server closed (None: it
    did not within `limit_s`)."""
    start = time.monotonic()
    sock.sendall(b"POST /v1/score HTTP/1.1\r\nX-Slow: ")
    while time.monotonic() - start < limit_s:
        readable, _, _ = select.select([sock], [], [], 0.5)
        try:
            if readable and not sock.recv(65536):
                return time.monotonic() - start
            sock.sendall(b"a")
        except OSError:
            return time.monotonic() - start
    return None


def test_slow_clients_are_cut_off(server):
    """A head never finished, a head trickled byte by byte (an idle timer would never fire) and a
    body never finished: each connection is closed by its deadline, while others are served."""
    host, port = host_port(server.url)
    addr = (host, port)
    head_limit = HEADER_TIMEOUT_S + SLACK_S
    body_limit = BODY_TIMEOUT_S + SLACK_S
    stalled_head = socket.create_connection(addr)
    stalled_head.sendall(f"POST /v1/score HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
    stalled_body = socket.create_connection(addr)
    stalled_body.sendall(
        f"POST /v1/score HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        'Content-Length: 1000\r\n\r\n{"query": '.encode()
    )
    trickled = socket.create_connection(addr)
    with bounded(server, body_limit + 1), cf.ThreadPoolExecutor(3) as pool:
        head_closed = pool.submit(wait_closed, stalled_head, head_limit)
        body_closed = pool.submit(wait_closed, stalled_body, body_limit)
        trickle_closed = pool.submit(_trickle_head, trickled, head_limit)
        answer = httpx.post(server.url + "/v1/embeddings", json={"input": ["a"]}, timeout=5)
        assert answer.status_code == 200  # the server keeps serving meanwhile
        results = head_closed.result(), body_closed.result(), trickle_closed.result()
    for sock in (stalled_head, stalled_body, trickled):
        sock.close()
    (head_s, _), (body_s, _), trickle_s = results
    assert head_s is not None and head_s <= head_limit, f"unfinished head kept {head_s}"
    assert trickle_s is not None and trickle_s <= head_limit, f"trickled head kept {trickle_s}"
    assert body_s is not None and body_s <= body_limit, f"unfinished body kept {body_s}"


# -------------------------------------------------------------------------- deadlines that cancel


def heavy_score(timeout_ms: int | None) -> bytes:
    """256 items × 200 tokens: ~51k tokens, ~1.2 s of the demo model on the 2-core dev machine
    (2026-12-05)."""
    rng = random.Random(1)
    body = {"query": token_ids(16, rng), "items": [token_ids(200, rng) for _ in range(256)]}
    body |= {"label_token_ids": LABELS} | ({"timeout_ms": timeout_ms} if timeout_ms else {})
    return json.dumps(body).encode()


def test_cancelled_request_frees_the_model(disposable_server):
    """A request past its deadline, or whose client went away, is dropped in the runtime: its
    admission slot is free well before the request would have ended (the work stops between
    pieces of its forward), and the next request does not wait for it."""
    srv = disposable_server
    small = {"query": [11, 12, 13], "items": [[14, 15, 16, 17]], "label_token_ids": LABELS}
    host, port = host_port(srv.url)
    start = time.monotonic()
    assert send(srv, "/v1/score", heavy_score(None), timeout_s=60)[0] == 200
    alone = time.monotonic() - start  # the heavy request's own time on this machine
    deadline_ms = 300
    # deadline: the client waits for its 504; disconnect: the client goes away mid-request
    for how in ("deadline", "disconnect"):
        with bounded(srv, 0.5 + SLACK_S + AFTER_CANCEL_S + alone, RSS_HEAVY_MIB):
            if how == "deadline":
                start = time.monotonic()
                status, text = send(srv, "/v1/score", heavy_score(deadline_ms), timeout_s=5)
                assert status == 504, (status, text[:300])
                assert time.monotonic() - start <= deadline_ms / 1e3 + 0.5
                rest = alone - deadline_ms / 1e3  # what the request had left to run
            else:
                body = heavy_score(None)
                head = (
                    f"POST /v1/score HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                with socket.create_connection((host, port)) as sock:
                    sock.sendall(head.encode() + body)
                    assert wait_until(lambda: inflight(srv) == 1, 10)
                rest = alone
            freed = time.monotonic()
            assert wait_until(lambda: inflight(srv) == 0, alone), how
            freed = time.monotonic() - freed
            assert freed < 0.5 * rest, f"{how}: freed after {freed:.2f} s of {rest:.2f} s left"
            start = time.monotonic()
            status, text = send(srv, "/v1/score", small, timeout_s=AFTER_CANCEL_S + 2)
            waited = time.monotonic() - start
        assert status == 200, (how, status, text[:300])
        assert waited <= AFTER_CANCEL_S, f"{how}: the next request waited {waited:.2f} s"


def test_504_message_says_the_request_was_not_run(server):
    rng = random.Random(2)
    heavy = {"query": token_ids(16, rng), "items": [token_ids(32, rng) for _ in range(1024)]}
    heavy["label_token_ids"] = LABELS
    # the server learns its cost from these runs (the first of a new shape is not learned from:
    # it may have compiled); after one run the prediction still came from the warm-up's small
    # batches and, on the development machine of 2026-12-05, admitted the request, which timed out
    for _ in range(3):
        assert send(server, "/v1/score", heavy, timeout_s=60)[0] == 200
    with bounded(server, 0.2 + REFUSE_S):
        status, text = send(server, "/v1/score", heavy | {"timeout_ms": 200})
    assert status == 504, (status, text[:300])
    message = error_message(text)
    assert "timeout_ms=200" in message and "did not finish" not in message, message


# ---------------------------------------------------------------------------------- safe defaults


BROWSER_SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]


def test_browser_simple_post_is_refused(server):
    """The content types a web page may POST cross-origin without a preflight get 415 on every
    route; JSON routes also refuse a body without a Content-Type (a page's fetch of a Blob)."""
    with bounded(server, 2 * REFUSE_S):
        for path, body in valid_bodies(server).items():
            for ctype in BROWSER_SIMPLE_TYPES:
                status, text = send(server, path, body, {"Content-Type": ctype})
                assert status == 415, (path, ctype, status, text[:200])
                assert "application/json" in error_message(text), text[:300]
            if "/infer" not in path:  # tritonclient sends KServe bodies without a Content-Type
                assert send(server, path, body, {})[0] == 415, path


def test_kserve_infer_without_content_type_still_works(server):
    """tritonclient sends no Content-Type: the 415 check must leave the KServe route open to it."""
    body = kserve_score({"shape": [2], "datatype": "BYTES", "data": ["a", "b"]})
    with bounded(server, REFUSE_S):
        status, text = send(server, infer_path(server), body, {})
    assert status == 200, text[:300]


def test_foreign_host_is_refused(server):
    _, port = host_port(server.url)
    body = valid_bodies(server)["/v1/score"]
    with bounded(server, 2 * REFUSE_S):
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            status, text = send(server, "/v1/score", body, JSON | {"Host": host})
            assert status in (400, 421), (host, status, text[:200])
            status, _ = raw_request(server.url, "GET", "/v1/models", headers={"Host": host})
            assert status in (400, 421), (host, status)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            status, text = send(server, "/v1/score", body, JSON | {"Host": host})
            assert status == 200, (host, status, text[:200])


def test_foreign_origin_is_refused(server):
    """A web page's POST carries its Origin; servers and SDKs send none. The KServe route cannot
    demand a JSON Content-Type (tritonclient sends none), so the Origin check is what closes it."""
    evil = {"Origin": "http://evil.example"}
    kserve = kserve_score({"shape": [1], "datatype": "BYTES", "data": ["a"]})
    with bounded(server, REFUSE_S):
        assert send(server, infer_path(server), kserve, evil)[0] == 403
        assert send(server, "/v1/score", valid_bodies(server)["/v1/score"], JSON | evil)[0] == 403


def test_docs_need_the_api_key(keyed_server):
    url = keyed_server.url
    auth = {"Authorization": f"Bearer {KEY}"}
    with bounded(keyed_server, REFUSE_S):
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(url + path, timeout=5).status_code == 401, path
            assert httpx.get(url + path, headers=auth, timeout=5).status_code == 200, path
        for path in ("/health", "/v2/health/live", "/v2/health/ready"):  # probes stay open
            assert httpx.get(url + path, timeout=5).status_code == 200, path


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _check_key(server: ServeProcess, key: str) -> None:
    body = {"input": ["a"]}
    with bounded(server, REFUSE_S):
        assert httpx.post(server.url + "/v1/embeddings", json=body, timeout=5).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(server.url + "/v1/embeddings", json=body, headers=auth, timeout=5)
        assert r.status_code == 200, r.text
    assert key not in _cmdline(server.proc.pid)  # not visible in `ps`


def test_api_key_from_the_environment(keyed_server):
    _check_key(keyed_server, KEY)


@pytest.mark.parametrize("source", ["flag", "env"])
def test_api_key_from_a_file(tmp_path, source):
    """`--api-key-file PATH` or `BOUNDGEN_API_KEY_FILE=PATH`; the file's trailing newline is not
    part of the key."""
    path = tmp_path / "key"
    path.write_text("from-a-file\n")
    path.chmod(0o600)
    if source == "flag":
        proc = ServeProcess("--device", "cpu", "--api-key-file", str(path))
    else:
        proc = ServeProcess("--device", "cpu", env={"BOUNDGEN_API_KEY_FILE": str(path)})
    with proc:
        _check_key(proc, "from-a-file")


# ------------------------------------------------------------------------ strict request parsing


def test_kserve_binary_flags_must_be_booleans(server):
    path = infer_path(server)
    body = kserve_score({"shape": [1], "datatype": "BYTES", "data": ["a"]})
    asked = [
        body | {"parameters": {"binary_data_output": "false"}},
        body | {"outputs": [{"name": "scores", "parameters": {"binary_data": "false"}}]},
    ]
    with bounded(server, REFUSE_S):
        for req in asked:
            status, text = send(server, path, req)
            assert status == 400, (status, text[:200])
            assert "binary_data" in error_message(text), text[:300]


def test_duplicate_json_keys_are_refused(server):
    score = b'{"query": "a", "query": "b", "items": ["c"], "label_token_ids": [299]}'
    kserve = json.dumps(kserve_score({"shape": [1], "datatype": "BYTES", "data": ["a"]}))
    kserve_dup = kserve[:-1] + ', "inputs": []}'
    with bounded(server, REFUSE_S):
        for path, body in (("/v1/score", score), (infer_path(server), kserve_dup.encode())):
            status, text = send(server, path, body)
            assert status == 400, (path, status, text[:200])
            assert "duplicate" in error_message(text).lower(), text[:300]


def test_valid_requests_still_pass_the_new_checks(server):
    """Every route's ordinary request, as the official clients send it, keeps working."""
    with bounded(server, 2 * REFUSE_S):
        for path, body in valid_bodies(server).items():
            status, text = send(server, path, body)
            assert status == (400 if path == "/v1/classify" else 200), (path, text[:300])


# ------------------------------------------------------------------------------ large responses


def test_large_float_responses_do_not_stall_the_server(server):
    """4096 one-word texts embedded: 4096 × 128 floats as JSON (~10 MiB). Building that text in
    one call held the GIL ~0.15 s (OpenAI shape) or ~0.6 s (KServe JSON) on the dev CPU; written
    by orjson in slices (`server.json.encode_async`), yielding between them, it does not stall
    /health."""
    texts = ["shoes"] * 4096
    kserve = {
        "inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
        "parameters": {"task": "embed"},
    }
    for path, body in (("/v1/embeddings", {"input": texts}), (infer_path(server), kserve)):
        with bounded(server, 10.0, rss_growth_mib=256.0):
            status, text = send(server, path, body, timeout_s=30)
        assert status == 200, (path, text[:300])
