"""Black-box measurements of a live `boundgen serve` process for the reliability tests: `/health`
latency sampled while a test does something else, the server's resident memory, and raw-socket HTTP
(slow clients, bodies the server must refuse before reading them)."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (VmRSS in /proc/<pid>/status), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length (what the server sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} bytes of response")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    # a bytearray: `bytes +=` copies the whole body per chunk (~800 MiB of copying for a 10 MiB
    # reply), CPU the test process would take from the server it measures
    buf = bytearray(body)
    while len(buf) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return status, bytes(buf)


class HealthProbe:
    """While active, a thread sends `GET /health` every `interval_s` on its own keep-alive socket
    and records each round trip in ms. A probe that gets no answer within `timeout_s` records
    `timeout_s` and reconnects, so a stalled server shows up as a latency, never as a hung test.

    Raw sockets rather than an HTTP client library: the probe thread must hold the GIL as little as
    possible, so that the test process's own work does not show up as server latency."""

    def __init__(self, url: str, interval_s: float = 0.02, timeout_s: float = 2.0):
        self.addr = host_port(url)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.latencies_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)
        self._request = f"GET /health HTTP/1.1\r\nHost: {self.addr[0]}:{self.addr[1]}\r\n\r\n"

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)

    @property
    def max_ms(self) -> float:
        return max(self.latencies_ms, default=0.0)

    def summary(self) -> str:
        lat = sorted(self.latencies_ms)
        if not lat:
            return "no /health probes"
        return (
            f"{len(lat)} /health probes: p50 {lat[len(lat) // 2]:.1f} ms, "
            f"max {lat[-1]:.1f} ms, {sum(x > 100 for x in lat)} over 100 ms"
        )

    def _run(self) -> None:
        sock = None
        request = self._request.encode()
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                if sock is None:
                    sock = socket.create_connection(self.addr, timeout=self.timeout_s)
                sock.settimeout(max(0.05, self.timeout_s - (time.perf_counter() - start)))
                sock.sendall(request)
                read_response(sock)
                self.latencies_ms.append((time.perf_counter() - start) * 1e3)
            except OSError:
                self.latencies_ms.append(max(self.timeout_s, time.perf_counter() - start) * 1e3)
                if sock is not None:
                    sock.close()
                sock = None
            self._stop.wait(self.interval_s)
        if sock is not None:
            sock.close()


def raw_request(
    url: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, bytes]:
    """One request on a fresh socket, headers exactly as given (`Host` defaults to the server's
    address; `Content-Length` is added for a body). Returns (status, body)."""
    host, port = host_port(url)
    head = {"Host": f"{host}:{port}", **(headers or {})}
    if body and "Content-Length" not in head:
        head["Content-Length"] = str(len(body))
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall("\r\n".join(lines).encode("latin-1") + body)
        return read_response(sock)


def wait_closed(sock: socket.socket, limit_s: float) -> tuple[float | None, bytes]:
    """Seconds until the server closed `sock` (None: still open after `limit_s`), and what it
    sent before closing."""
    start = time.monotonic()
    got = b""
    while True:
        left = limit_s - (time.monotonic() - start)
        if left <= 0:
            return None, got
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None, got
        except OSError:  # reset by the server: closed too
            return time.monotonic() - start, got
        if not chunk:
            return time.monotonic() - start, got
        got += chunk
