"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Clients of OpenAI-compatible servers (the `openai` package, RL frameworks' agent loops) read this
shape, so the built-in engine and the gateway both answer every 4xx/5xx with it, from this module.
"""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    """Raised by a handler; the server's middleware turns it into `json_error`."""

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
