"""The ASGI guard: what every HTTP request must pass before routing, each check answered before
the work of the next one (docs/security.md).

    Host (400) → Origin (403) → API key (401) → Content-Type (415) → declared Content-Length (413)
    → the body, counted as it arrives (413) and whole within `body_timeout_s` of the head (408,
    connection closed) → the app

The app gets the body replayed from memory, and a watcher on the connection: when the client
goes away before its response has started, the request's task is cancelled, so that its work
(`Infer`) is cancelled too instead of running for nobody. The health probes pass unchecked.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hmac
import ipaddress
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from boundgen.server.config import ServerConfig
from boundgen.server.errors import (
    BadRequest,
    Forbidden,
    RequestTimeout,
    ServerError,
    TooLarge,
    Unauthorized,
    UnsupportedMediaType,
)

# Health probes answer without a key or a Host check: orchestrators cannot always send a key,
# and they address a pod by its IP.
OPEN_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
# Pages a browser opens itself: a 401 there asks for HTTP Basic (any user, the key as password).
BROWSER_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json"})
_KSERVE_INFER = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/infer$")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# tritonclient sends KServe bodies as octet-stream or with no Content-Type at all.
_KSERVE_TYPES = frozenset({"application/json", "application/octet-stream", ""})

Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


class Guard:
    """Pure ASGI middleware, outermost. `api_key`: the resolved key (None: no key);
    `on_refuse(status, error_type)` is told of every request the guard answers itself."""

    def __init__(
        self,
        app: Any,
        config: ServerConfig,
        api_key: str | None,
        on_refuse: Callable[[int, str], None] | None = None,
    ):
        self.app = app
        self.max_body_bytes = config.max_body_bytes
        self.max_request_tokens = config.max_request_tokens
        self.body_timeout_s = config.body_timeout_s
        self.allowed_hosts = frozenset(h.lower() for h in config.allowed_hosts)
        self.allowed_origins = frozenset(o.lower().rstrip("/") for o in config.allowed_origins)
        self.cors = bool(config.allowed_origins)
        self.api_key = api_key.encode() if api_key else None
        self.on_refuse = on_refuse

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        has_body = scope["method"] in _BODY_METHODS
        body = None
        try:
            self._check_host(scope, headers)
            self._check_origin(headers)
            if not (self.cors and _is_preflight(scope, headers)):  # a preflight carries no key
                self._check_key(scope, headers)
            self._check_length(headers)
            if has_body:
                self._check_content_type(scope, headers)
                body = await self._read_body(receive)
        except ServerError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if not has_body:
            await self.app(scope, receive, send)
        elif body is not None:  # None: the client left while sending it
            await self._run(scope, receive, send, body)

    # ---- checks ---------------------------------------------------------------------------------

    def _check_host(self, scope: dict, headers: dict[str, str]) -> None:
        raw = headers.get("host", "")
        name = _host_name(raw)
        if self.allowed_hosts:
            if "*" in self.allowed_hosts or name in self.allowed_hosts:
                return
        elif not _is_loopback(scope.get("server")) or _is_loopback_name(name):
            # Auto: a connection to a loopback address must name this machine (DNS rebinding
            # points a foreign name at 127.0.0.1); on another address the names clients use are
            # not known in advance.
            return
        shown = repr(raw[:60]) if raw else "missing"
        raise BadRequest(
            f"Host {shown} is not allowed here (server option allowed_hosts; on a loopback "
            "address only localhost and loopback IPs are)"
        )

    def _check_origin(self, headers: dict[str, str]) -> None:
        origin = headers.get("origin")
        if origin is None:  # servers and SDKs send none; a browser always does cross-origin
            return
        origin = origin.lower().rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return
        if _same_origin(origin, headers.get("host", "")):
            return
        raise Forbidden(
            f"requests from web pages of origin {origin[:60]!r} are not allowed "
            "(server option allowed_origins)"
        )

    def _check_key(self, scope: dict, headers: dict[str, str]) -> None:
        if self.api_key is None:
            return
        given = _given_key(headers)
        if given and hmac.compare_digest(given.encode(), self.api_key):
            return
        if scope["path"] in BROWSER_PATHS:
            challenge = 'Basic realm="boundgen", charset="UTF-8"'
        else:
            challenge = "Bearer"
        raise Unauthorized(
            "missing or wrong API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": challenge},
        )

    def _check_length(self, headers: dict[str, str]) -> None:
        declared = headers.get("content-length")
        if declared is None:
            return
        try:
            n = int(declared)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if n > self.max_body_bytes:
            raise TooLarge(self._too_large(f"request body is {n} bytes"))

    def _check_content_type(self, scope: dict, headers: dict[str, str]) -> None:
        given = headers.get("content-type", "")
        media = given.partition(";")[0].strip().lower()
        if not given and _empty_body(headers):
            return  # nothing to interpret (tritonclient's POST /v2/repository/index sends none)
        if _KSERVE_INFER.match(scope["path"]):
            if media in _KSERVE_TYPES:
                return
            want = "application/json or application/octet-stream"
        elif media == "application/json":
            return
        else:
            want = "application/json"
        got = repr(given[:60]) if given else "none"
        raise UnsupportedMediaType(f"Content-Type must be {want}; got {got}")

    def _too_large(self, what: str) -> str:
        return (
            f"{what}; the limit is {self.max_body_bytes} bytes (server option max_body_bytes), "
            f"and a request may have at most {self.max_request_tokens} tokens "
            "(max_request_tokens)"
        )

    # ---- the body -------------------------------------------------------------------------------

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise TooLarge(self._too_large(f"request body is at least {size} bytes"))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.body_timeout_s:g} s of its head "
                "(server option body_timeout_s)",
                headers={"Connection": "close"},
            ) from None

    async def _run(self, scope: dict, receive: Receive, send: Send, body: bytes) -> None:
        """The app with `body` replayed, cancelled if the client leaves before the response."""
        task = asyncio.current_task()
        gone = asyncio.Event()
        state = {"started": False, "cancelled": False}

        async def replay() -> dict[str, Any]:
            nonlocal body
            if body is not None:
                message = {"type": "http.request", "body": body, "more_body": False}
                body = None
                return message
            await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            # After the body only `http.disconnect` comes: the client left, or the response is
            # complete (then there is nothing left to cancel).
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not state["started"] and task is not None:
                state["cancelled"] = True
                task.cancel()

        async def send_watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        watcher = asyncio.create_task(watch())
        try:
            await self.app(scope, replay, send_watched)
        except asyncio.CancelledError:
            if not state["cancelled"]:
                raise
            task.uncancel()  # the client is gone: nobody to answer
        finally:
            watcher.cancel()

    async def _refuse(self, exc: ServerError, scope: dict, receive: Receive, send: Send) -> None:
        if self.on_refuse is not None:
            self.on_refuse(exc.status, exc.type)
        kserve = scope["path"].startswith("/v2/")
        await exc.response(kserve)(scope, receive, send)


def _headers(scope: dict) -> dict[str, str]:
    # The first of repeated headers counts (a proxy appends, it does not prepend).
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return out


def _host_name(host: str) -> str:
    """The name in a Host header, without port and brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


@functools.lru_cache(maxsize=256)  # a handful of names a server is called by: parsed once each
def _is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_loopback(server: tuple[str, int] | None) -> bool:
    """Whether the connection arrived on a loopback address (`scope["server"]`)."""
    return server is not None and _is_loopback_name(str(server[0]).lower())


def _same_origin(origin: str, host: str) -> bool:
    """Whether a page of `origin` addressed this server by its own name and port (`Host`). The
    scheme is not compared: behind a TLS proxy the page is https and the server sees http."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    default = 443 if parts.scheme == "https" else 80
    name, _, own_port = host.strip().lower().rpartition(":")
    if not name or "]" in own_port:  # no port given: the page's default one
        name, own_port = host.strip().lower(), str(default)
    return parts.hostname == _host_name(name) and str(port or default) == own_port


def _is_preflight(scope: dict, headers: dict[str, str]) -> bool:
    return scope["method"] == "OPTIONS" and "access-control-request-method" in headers


def _given_key(headers: dict[str, str]) -> str:
    """The key a request sent: `Authorization: Bearer K`, `x-api-key: K`, or HTTP Basic with K as
    the password (what a browser sends for /docs)."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return decoded.partition(":")[2]
    return headers.get("x-api-key", "")


def _empty_body(headers: dict[str, str]) -> bool:
    """The request declares no body: Content-Length 0, or neither a length nor chunked encoding."""
    length = headers.get("content-length")
    if length is not None:
        return length.strip() == "0"
    return "transfer-encoding" not in headers
