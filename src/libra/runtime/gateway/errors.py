"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Clients of an OpenAI-compatible server (the `openai` package, the RL frameworks' agent loops) read
this shape, so every 4xx and 5xx the gateway itself produces uses it, with a message that says what
was wrong and what is allowed.
"""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def json_error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, param, code), content_type="application/json"
    )


def http_message(e: web.HTTPException, request: web.Request, max_body_mb: float) -> str:
    if e.status == 413:
        return f"request body too large; the limit is {max_body_mb:g} MiB (max_body_mb)"
    if e.status == 404:
        return f"no such endpoint: {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} not allowed on {request.path}"
    return e.text or e.reason
