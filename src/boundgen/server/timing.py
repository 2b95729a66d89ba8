"""`Server-Timing` (W3C): where the request a task serves spent its time. `Infer` (or, in a
frontend process, the engine's reply over the link) sets `SERVER_TIMES` when the work ends; the
endpoint wrapper in the same task reads it into the header (`server_timing`)."""

from __future__ import annotations

import re
from contextvars import ContextVar

# (name, ms) entries of the request this task serves
SERVER_TIMES: ContextVar[list[tuple[str, float]] | None] = ContextVar(
    "boundgen_server_times", default=None
)


def server_timing(app_ms: float, times: list[tuple[str, float]] | None) -> str:
    """`Server-Timing` header value (W3C): `app` (the whole handler: parse, checks, model,
    response) first, then what `Infer` recorded (`runtime`, and each DAG node, or `queue` + the
    call without the runtime). A client subtracts `app` from its own latency to see time spent
    outside the server."""
    parts = [f"app;dur={app_ms:.3f}"]
    for name, ms in times or ():
        parts.append(f"{_TOKEN_UNSAFE.sub('_', name)};dur={ms:.3f}")
    return ", ".join(parts)


_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9!#$%&'*+.^_`|~-]")  # a metric name must be an HTTP token
