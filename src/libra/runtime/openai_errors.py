"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Clients of OpenAI-compatible servers (the `openai` package, RL frameworks' agent loops) read this
shape, so the built-in engine and the gateway both answer every 4xx/5xx with it, from this module.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from libra.runtime.jsonbody import BodyError, parse_body
from libra.runtime.serving import BodyTimeout, read_body


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


async def read_json_object(request: web.Request, empty: dict | None = None) -> tuple[dict, bytes]:
    """The request's body as a JSON object (and its raw bytes), or an ApiError in this shape.
    An empty body is `empty` where given, an error otherwise.

    `jsonbody.parse_body` refuses what `json.loads` accepts but nothing downstream can use; a body
    the client cannot even deliver (a bogus Content-Encoding, a truncated chunk) is a 400 too.
    """
    try:
        raw = await read_body(request)  # over client_max_size: 413, turned into JSON by the middleware
    except BodyTimeout as e:
        raise ApiError(408, str(e), "body_timeout_s", "body_timeout") from None
    except (aiohttp.http_exceptions.HttpProcessingError, aiohttp.web_protocol.RequestPayloadError) as e:
        why = getattr(e, "message", None) or str(e) or type(e).__name__
        raise ApiError(400, f"could not read the request body ({why})", code="invalid_body") from None
    if not raw.strip():
        if empty is not None:
            return empty, raw
        raise ApiError(400, "a JSON object body is required", code="invalid_json")
    try:
        data = parse_body(raw)
    except BodyError as e:
        if e.field is None:
            raise ApiError(400, f"request body is not valid JSON ({e})", code="invalid_json") from None
        raise ApiError(400, str(e), e.field, "invalid_value") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return data, raw
