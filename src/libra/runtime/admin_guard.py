"""The admin token, checked once per request for every route that changes a service's state.

Guarding each admin handler by hand left two gateway endpoints open with a token set
(`POST /steps/end` advanced the step and rebuilt routers; `POST /sessions/{id}/finish` fed the
router's tree). So the rule is a middleware, and it is default-deny: with a token set, every
request needs it except

- reads (`GET`, `HEAD`, `OPTIONS`) outside `/admin`, and
- the data plane: generation and tokenizing (`DATA_PLANE`), which clients call without a token.

A route added later is guarded without anyone remembering to; `tests/test_route_guard.py` lists
each app's routes and fails on any state-changing one a request without the token can reach.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from aiohttp import web

READS = frozenset({"GET", "HEAD", "OPTIONS"})
# What clients (agent loops, RL frameworks) call without an admin token: OpenAI's and SGLang's
# generation, vLLM's token-in generation, and tokenizing.
DATA_PLANE = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
        "/inference/v1/generate",
        "/tokenize",
        "/detokenize",
    }
)


def needs_admin(method: str, path: str, data_plane: frozenset[str] = DATA_PLANE) -> bool:
    """Whether a route (its method and canonical path) needs the token when one is set."""
    if path == "/admin" or path.startswith("/admin/"):
        return True
    if method in READS:
        return False
    return path not in data_plane


def authorized(token: str | None, request: web.Request) -> bool:
    if token is None:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def admin_middleware(token: Callable[[], str | None], refuse: Callable[[web.Request], web.StreamResponse]):
    """The middleware: `token()` is the service's admin token (None: none set), `refuse(request)`
    its 401 in the service's own error shape."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is not None and needs_admin(request.method, resource.canonical):
            if not authorized(token(), request):
                return refuse(request)
        return await handler(request)

    return guard
