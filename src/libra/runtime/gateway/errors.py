"""The gateway's HTTP errors: OpenAI's shape (shared with the engine) plus its own messages.

Clients of an OpenAI-compatible server (the `openai` package, the RL frameworks' agent loops) read
this shape, so every 4xx and 5xx the gateway itself produces uses it, with a message that says what
was wrong and what is allowed.
"""

from __future__ import annotations

from aiohttp import web

from libra.runtime.openai_errors import ApiError, error_body, json_error

__all__ = ["ApiError", "error_body", "http_message", "json_error"]


def http_message(e: web.HTTPException, request: web.Request, max_body_mb: float) -> str:
    if e.status == 413:
        return f"request body too large; the limit is {max_body_mb:g} MiB (max_body_mb)"
    if e.status == 404:
        return f"no such endpoint: {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} not allowed on {request.path}"
    return e.text or e.reason
