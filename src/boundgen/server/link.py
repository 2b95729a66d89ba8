"""The link between HTTP frontend processes and the engine's process (`--frontends`): framed
pickled messages over a Unix stream socket, one connection per frontend.

Why a second process: a server's Python threads share one GIL, and at `/v1/beam`'s and W5's
rates most of it went to HTTP — uvicorn's parsing, the guard, the body's JSON and schema, the
reply's JSON, the metrics (the event loop held the GIL in 77 % of the samples at 1,533 req/s on
an H100, BENCHMARKS.md thirty-first session). On a host whose cores run Python 2.5x slower the
loop ran out of GIL near 1,100 req/s while the GPU had room. Frontends do that part on other
cores and send the engine only what its runtime takes: a workload's name, its fields (token ids,
not text), the deadline and the admission units.

Messages are tuples, their first element their kind:

    frontend → engine                        engine → frontend
    ("hello", index)                         ("facts", EngineFacts fields, status)
    ("infer", rid, kind, fields, timeout_ms, units)
                                             ("done", rid, result, server times)
                                             ("error", rid, error)    (`error_fields`)
    ("cancel", rid)      the client went away
    ("observe", [observation, ...])          the frontend's metrics, applied in the engine
    ("query", rid, what) "metrics" | "model_stats"
                                             ("answer", rid, value)
                                             ("status", ready, unready, draining)

A frame is its length (4 bytes, little-endian) and a pickle. Both ends are this package in
processes one `boundgen serve` started (the socket lives in a directory only its user can read),
so pickle is safe here; a result's tensors cross as numpy arrays (`host_floats`), never as device
tensors a frontend would have to initialise CUDA for.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from boundgen.server import errors

log = logging.getLogger("boundgen.server")

_LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 31  # a frame's length fits the 4-byte header


@dataclass(frozen=True)
class TrieRef:
    """A frontend's stand-in for a trie the engine loaded: a beam request names it, the engine's
    side of the link puts its `Trie` in its place."""

    name: str
    depth: int


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) >= MAX_FRAME:
        raise ValueError(f"a link message of {len(body)} bytes is over the frame limit")
    return _LENGTH.pack(len(body)) + body


def read_frame(sock: socket.socket) -> tuple:
    """One message from a blocking socket (the frontend's handshake, before its event loop)."""

    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the link closed in the middle of a message")
            data += chunk
        return bytes(data)

    (n,) = _LENGTH.unpack(exactly(4))
    return pickle.loads(exactly(n))


class Wire(asyncio.Protocol):
    """One end of a link connection: `send(message)`; each whole message received goes to
    `on_message`, the connection's end to `on_close`."""

    def __init__(
        self,
        on_message: Callable[[Wire, tuple], None],
        on_close: Callable[[Wire], None] | None = None,
    ) -> None:
        self.on_message, self.on_close = on_message, on_close
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []  # frames sent this event-loop turn, written at its end
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        start = 0
        while len(buf) - start >= 4:
            (n,) = _LENGTH.unpack_from(buf, start)
            if len(buf) - start - 4 < n:
                break
            message = pickle.loads(memoryview(buf)[start + 4 : start + 4 + n])
            start += 4 + n
            try:
                self.on_message(self, message)
            except Exception:  # one bad message must not end the connection
                log.exception("link: handling %r failed", message[:1])
        if start:
            del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_close is not None:
            self.on_close(self)

    def send(self, message: tuple) -> None:
        """Queue `message`; a turn's messages go in one write (one system call, not one a reply:
        13 µs each on the development CPU under `/v1/beam` load)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._write)
        self._out.append(encode(message))

    def _write(self) -> None:
        frames, self._out = self._out, []
        if frames and not self.closed and self.transport is not None:
            self.transport.write(b"".join(frames))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# ---- results and errors across the link ---------------------------------------------------------


def has_tensors(value: Any) -> bool:
    """Whether a runtime result is a tensor or a list of them (the embeddings). A process that
    has not imported torch holds none (a frontend process, whose results come as numpy arrays):
    it is not imported for the question."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, list) and bool(value) and isinstance(value[0], torch.Tensor)


def _to_numpy(value: Any) -> Any:
    if isinstance(value, list):
        return [v.float().cpu().numpy() for v in value]
    return value.float().cpu().numpy()


async def host_floats(value: Any) -> Any:
    """A runtime result with its tensors (one, or a list: the embeddings) as float32 numpy
    arrays; a device tensor's copy waits for the GPU, so it runs off the event loop. Anything
    else (lists, arrays already on the host) as it is."""
    if not has_tensors(value):
        return value
    return await asyncio.to_thread(_to_numpy, value)


def error_fields(exc: errors.ServerError) -> tuple:
    """A `ServerError` as plain fields (its class by name): what `rebuild_error` makes again."""
    return (type(exc).__name__, exc.message, exc.code, dict(exc.headers), exc.status)


def rebuild_error(fields: tuple) -> errors.ServerError:
    name, message, code, headers, status = fields
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ServerError)):
        cls = errors.ServerError
    return cls(message, code=code, headers=headers or None, status=status)
