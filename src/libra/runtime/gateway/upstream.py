"""Talking to backends: forward a request, pass a stream through, and read `usage` on the way.

Bodies go through as bytes: the request the client sent is the request the backend gets (tools,
tool_calls, role=tool messages and any extension fields untouched), and a non-streaming response
is returned byte for byte. The only thing read from a response is its `usage` object, found by
searching for the key instead of decoding the whole body, so a large response (logprobs) costs a
byte search, not a JSON parse. Streams are written through chunk by chunk as they arrive; a chunk
is only looked into when it contains the bytes `"usage"`.

What "failed before any byte came back" means here: the backend's response headers never arrived
(refused or reset connection, or a connect timeout). Then nothing has been sent to the client and
the request can be carried out elsewhere. Once headers arrived, a failure is reported to the client
(502, or an SSE error event in a stream that already started) and never retried, because the
client may already hold part of the answer.
"""

from __future__ import annotations

import json
import re

import aiohttp

_DECODER = json.JSONDecoder()
USAGE_KEY = b'"usage"'
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class NoByteError(Exception):
    """The backend failed before any byte of a response came back; safe to send elsewhere."""

    def __init__(self, kind: str, detail: str, refused: bool):
        super().__init__(detail)
        self.kind, self.detail, self.refused = kind, detail, refused


async def post(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:  # fmt: skip
    """POST and return once response headers arrive. Failures before that raise `NoByteError`.

    A read timeout (the backend accepted the request but has not answered) is not a `NoByteError`:
    the backend may be working on it, so it is not sent a second time; it propagates as
    `asyncio.TimeoutError`.
    """
    try:
        return await http.post(url, data=body, headers=headers, timeout=timeout)
    except aiohttp.ConnectionTimeoutError as e:
        raise NoByteError("connect_timeout", f"connect timeout: {e}", refused=True) from None
    except aiohttp.ClientConnectorError as e:
        raise NoByteError("connect", f"cannot connect: {e}", refused=True) from None
    except aiohttp.ServerTimeoutError:
        raise
    except aiohttp.ClientConnectionError as e:  # reset or closed before headers
        raise NoByteError("disconnect", f"{type(e).__name__}: {e}", refused=False) from None


def usage_in_body(body: bytes) -> dict | None:
    """The top-level `usage` object of an OpenAI response body, read without decoding the body."""
    i = body.rfind(USAGE_KEY)
    while i >= 0:
        j = i + len(USAGE_KEY)
        while j < len(body) and body[j] in b" \t\r\n":
            j += 1
        if j < len(body) and body[j] == 0x3A:  # ':' so this is the key, not a string value
            try:
                obj, _ = _DECODER.raw_decode(body[j + 1 :].decode("utf-8", "replace").lstrip())
            except (ValueError, RecursionError):  # a backend's body is passed on as it is
                return None
            return obj if isinstance(obj, dict) else None
        i = body.rfind(USAGE_KEY, 0, i)
    return None


class SSEUsage:
    """Watches a passing SSE stream for a `usage` object (sent when include_usage is asked)."""

    __slots__ = ("carry", "usage")

    def __init__(self) -> None:
        self.carry = b""
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> None:
        data = self.carry + chunk if self.carry else chunk
        cut = data.rfind(b"\n") + 1
        # Only a partial last line is carried over, and only while it might hold a usage object.
        self.carry = data[cut:] if cut < len(data) else b""
        if len(self.carry) > 1 << 20:
            self.carry = b""
        if USAGE_KEY not in data[:cut]:
            return
        for line in reversed(data[:cut].split(b"\n")):
            if line.startswith(b"data:") and USAGE_KEY in line:
                try:
                    obj = json.loads(line[5:])
                except (ValueError, RecursionError):
                    continue
                u = obj.get("usage") if isinstance(obj, dict) else None
                if isinstance(u, dict):
                    self.usage = u
                    return


# SGLang's /generate reports token counts in `meta_info`, beside arrays of logprobs. The keys are
# found by bytes: inside a JSON string a quote is escaped, so `"prompt_tokens":` only matches a key.
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d{1,9})')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d{1,9})')


def generate_usage(body: bytes) -> dict | None:
    """`prompt_tokens` and `completion_tokens` of a /generate answer (its first item, for a batch)."""
    p, c = _PROMPT.search(body), _COMPLETION.search(body)
    if p is None or c is None:
        return None
    return {"prompt_tokens": int(p.group(1)), "completion_tokens": int(c.group(1))}


_TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([0-9,\s]*)\]')


def tokens_usage(body: bytes, prompt_tokens: int | None) -> dict | None:
    """The counts of a /inference/v1/generate answer, which carries no usage: its choices'
    `token_ids` (counted by bytes, not decoded) and the prompt's size, known from the request."""
    generated = sum(len(m.group(1).split(b",")) for m in _TOKEN_IDS.finditer(body) if m.group(1).strip())
    if prompt_tokens is None:
        return {"completion_tokens": generated}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated}


class GenerateUsage(SSEUsage):
    """The token counts of a streamed /generate: each chunk holds them so far; the last wins."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> None:
        data = self.carry + chunk if self.carry else chunk
        cut = data.rfind(b"\n") + 1
        self.carry = data[cut:] if cut < len(data) and len(data) - cut <= 1 << 22 else b""
        lines = data[:cut]
        if b'"completion_tokens"' not in lines:
            return
        last = lines.rfind(b"data: {")
        found = generate_usage(lines[last:]) if last >= 0 else None
        if found is not None:
            self.usage = found


def sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
