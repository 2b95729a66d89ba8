"""The API's fixed routes straight to their endpoints, in front of FastAPI's router.

Every request through FastAPI's router passes its exception middleware, an exit stack, a match
against each route in turn and the route's request handling (dependencies, body), all Python on
the event loop. Our endpoints need none of it: each parses its own body and answers its own
errors (`app.endpoint`). On the development machine that machinery took ~0.14 ms of the event
loop's CPU for each W2-sized `/v1/score` request (BENCHMARKS.md, 2026-12-02 seventh session), and
at saturation the loop's Python holds the GIL that the forward node waits for. So a request whose
method and path name a fixed route goes to that endpoint at once; anything else (routes with path
parameters, HEAD, /docs, a path served under a root path, a miss: 404/405) takes the router as
before.

Innermost of the app's middleware: the guard and CORS still see every request first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

Endpoint = Callable[[Request], Awaitable[Response]]


class FixedRoutes:
    """Pure ASGI middleware: `routes[(method, path)]` answers its requests, `app` the rest."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Endpoint]) -> None:
        for method, path in routes:
            if "{" in path:
                raise ValueError(f"{method} {path}: a route with path parameters needs the router")
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        endpoint = None
        if scope["type"] == "http" and not scope.get("root_path"):
            endpoint = self.routes.get((scope["method"], scope["path"]))
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)
