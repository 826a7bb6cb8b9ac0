"""Parse an HTTP request's JSON body into values every later step can handle.

Python's `json.loads` accepts more than the services can use, and each excess failed later, as a
500 far from the request:

- an unpaired UTF-16 surrogate spelled as an escape (`"\\ud800"`) becomes a `str` that cannot be
  encoded as UTF-8, so the first file write, tokenizer call or log line raised;
- `NaN` and `Infinity` are not JSON at all (RFC 8259), and forwarding them upstream produced a body
  no other parser reads;
- nesting deep enough raised `RecursionError`.

`parse_body` refuses all three at the door and names where the bad value is, so each service can
answer 400 (malformed JSON) or 422 (a field's value) in its own error shape.
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 64  # no request shape nests deeper than a handful of levels


class BodyError(ValueError):
    """A body the service cannot use. `field` is a dotted path to the bad value, or None when the
    body is not JSON at all; `allowed` says what the value may be."""

    def __init__(self, message: str, field: str | None = None, allowed: str | None = None):
        super().__init__(message)
        self.field = None if field is None else field if len(field) <= 200 else field[:200] + "..."
        self.allowed = allowed


def _no_constant(name: str) -> float:
    raise BodyError(f"malformed JSON: {name} is not a JSON number")


def parse_body(raw: bytes | str) -> object:
    """`json.loads`, refusing what `json.loads` lets through (module docstring)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"malformed JSON: nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BodyError(f"malformed JSON: {str(e)[:200]}") from None
    if _may_need_check(raw):
        check_value(data)
    return data


# An unpaired surrogate can only come from a \uD800-\uDFFF escape (UTF-8 bytes cannot spell one),
# and nesting deeper than MAX_DEPTH needs more than MAX_DEPTH brackets: a body with neither, the
# usual case, skips the walk (it costs about as much as the parse).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_need_check(raw: bytes | str) -> bool:
    b = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    return _SURROGATE_ESCAPE.search(b) is not None or b.count(b"[") + b.count(b"{") > MAX_DEPTH


def check_value(data: object) -> None:
    """Raise BodyError for the first unencodable string (key or value) or too deep a nesting."""
    stack: list[tuple[object, str, int]] = [(data, "body", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BodyError(f"malformed JSON: nested deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, f"{path} (a key)")
                stack.append((v, f"{path}.{k}" if path != "body" else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(
            f"{path}: not valid Unicode text (an unpaired surrogate at character {e.start})",
            path,
            "text without unpaired UTF-16 surrogate escapes such as \\ud800",
        ) from None
