"""Constrained decoding: which tokens a sequence may sample next.

Two automata, both pure Python so they can be property-tested without a model:

- `Utf8Text`: plain text. Only printable, valid UTF-8 (plus the end-of-message token), and a
  multi-byte character is never started when the token budget cannot finish it. So generated
  text always round-trips exactly through JSON and back into the next prompt.
- `ToolCallGrammar`: the tool-call envelope
  `<tool_call>{"name": "<one of the tools>", "arguments": {...}}</tool_call>`. The model itself
  picks the tool name (among the declared names) and every argument character; the grammar only
  forbids tokens that would leave valid JSON matching the tool's parameter schema. It knows the
  fewest tokens it still needs and closes free-length values early when the budget runs short,
  so a call always completes when `max_tokens` allows its shortest form.

A random-weight model never emits a well-formed call on its own; this is how the built-in engine
gives real, model-generated tool calls that clients and the gateway can parse.

Allowed sets are frozensets that are reused (module constants or cached per state), so the
sampler can turn them into mask rows with one dictionary lookup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from libra.runtime.engine.tokenizer import Special

END = int(Special.END)
_PRINTABLE = frozenset({9, 10, 13} | set(range(0x20, 0x7F)))
_CONT = frozenset(range(0x80, 0xC0))

# UTF-8 automaton. State 0 is "between characters"; the others wait for continuation bytes.
# (allowed bytes, next state) for each waiting state, per RFC 3629's table of well-formed bytes.
_WAITING: dict[int, tuple[frozenset[int], int]] = {
    1: (_CONT, 0),
    2: (_CONT, 1),
    3: (frozenset(range(0xA0, 0xC0)), 1),  # after E0: no overlong forms
    4: (frozenset(range(0x80, 0xA0)), 1),  # after ED: no surrogates
    5: (_CONT, 2),
    6: (frozenset(range(0x90, 0xC0)), 2),  # after F0: no overlong forms
    7: (frozenset(range(0x80, 0x90)), 2),  # after F4: nothing past U+10FFFF
}


def _lead_state(b: int) -> int:
    if b < 0x80:
        return 0
    if b <= 0xDF:
        return 1
    return {0xE0: 3, 0xED: 4, 0xF0: 6, 0xF4: 7}.get(b, 2 if b <= 0xEF else 5)


def _char_len(b: int) -> int:
    return 1 if b < 0x80 else 2 if b <= 0xDF else 3 if b <= 0xEF else 4


_LEADS = [b for b in range(0xC2, 0xF5)]
# START[n]: what may begin when n tokens are left (a 3-byte character needs 3 of them).
_START = {n: frozenset(_PRINTABLE | {END} | {b for b in _LEADS if _char_len(b) <= n}) for n in range(1, 5)}
_START_NO_END = {n: s - {END} for n, s in _START.items()}


class Constraint(Protocol):
    def allowed(self, budget: int) -> frozenset[int]: ...

    def advance(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...


class FreeText:
    """A tokenizer's vocabulary: every token may come next (`None`: no mask), except the end
    tokens under `ignore_eos`; `done` once an end token is taken."""

    __slots__ = ("done", "_allowed", "_ends")

    def __init__(self, codec, allow_end: bool = True) -> None:
        self.done, self._ends = False, codec.end_ids
        self._allowed = None if allow_end else _all_but(codec.vocab_size, codec.end_ids)

    def allowed(self, budget: int) -> frozenset[int] | None:
        return self._allowed

    def advance(self, token: int) -> None:
        if token in self._ends:
            self.done = True


@lru_cache(maxsize=8)
def _all_but(vocab_size: int, banned: frozenset[int]) -> frozenset[int]:
    return frozenset(range(vocab_size)) - banned


class Utf8Text:
    """Printable valid UTF-8 or the end token; `done` once the end token is taken.

    `allow_end=False` is vLLM's `ignore_eos`: the text runs to max_tokens (benchmarks use it).
    """

    __slots__ = ("state", "done", "_start")

    def __init__(self, allow_end: bool = True) -> None:
        self.state, self.done = 0, False
        self._start = _START if allow_end else _START_NO_END

    def allowed(self, budget: int) -> frozenset[int]:
        if self.state:
            return _WAITING[self.state][0]
        return self._start[max(1, min(budget, 4))]

    def advance(self, token: int) -> None:
        if token == END:
            self.done = True
        elif self.state:
            self.state = _WAITING[self.state][1]
        else:
            self.state = _lead_state(token)


# ---- the tool-call grammar: a list of segments, each a tiny automaton -------------------------

_STRING_CHARS = frozenset(_PRINTABLE - {ord('"'), ord("\\"), 9, 10, 13})
_DIGITS = frozenset(range(ord("0"), ord("9") + 1))
_NONZERO = frozenset(range(ord("1"), ord("9") + 1))
EMPTY: frozenset[int] = frozenset()
MAX_STRING = 24
MAX_DIGITS = 6
MAX_DEPTH = 3
MAX_PROPERTIES = 8


@lru_cache(maxsize=512)
def _one(token: int) -> frozenset[int]:
    return frozenset((token,))


class Lit:
    """A fixed run of tokens (braces, quotes, keys, special tokens)."""

    __slots__ = ("tokens", "i", "field")

    def __init__(self, tokens: Sequence[int], field: str = "frame"):
        self.tokens, self.i, self.field = tuple(tokens), 0, field

    def allowed(self, room: int) -> frozenset[int]:
        return _one(self.tokens[self.i]) if self.i < len(self.tokens) else EMPTY

    def advance(self, token: int) -> None:
        self.i += 1

    @property
    def can_end(self) -> bool:
        return self.i == len(self.tokens)

    @property
    def min_left(self) -> int:
        return len(self.tokens) - self.i


class Chars:
    """Between `lo` and `hi` tokens, each from `first` (the first one) or `rest` (the others)."""

    __slots__ = ("first", "rest", "lo", "hi", "n", "field")

    def __init__(self, first: frozenset[int], rest: frozenset[int], lo: int, hi: int, field: str):
        self.first, self.rest, self.lo, self.hi, self.n, self.field = first, rest, lo, hi, 0, field

    def allowed(self, room: int) -> frozenset[int]:
        # Take another character only if the rest of the grammar still fits after it.
        if self.n >= self.hi or room - 1 < max(0, self.lo - self.n - 1):
            return EMPTY
        return self.first if self.n == 0 else self.rest

    def advance(self, token: int) -> None:
        self.n += 1

    @property
    def can_end(self) -> bool:
        return self.n >= self.lo

    @property
    def min_left(self) -> int:
        return max(0, self.lo - self.n)


class Choice:
    """Exactly one of `options` (byte strings), chosen token by token.

    `tails` gives, per option, the fewest tokens the grammar needs after it (a tool's arguments
    depend on which tool is named), so an option is offered only if it can still be finished.
    """

    __slots__ = ("options", "tails", "prefix", "field", "_cache")

    def __init__(self, options: Sequence[bytes], field: str, tails: dict[bytes, int] | None = None):
        self.options, self.prefix, self.field = tuple(dict.fromkeys(options)), b"", field
        self.tails = tails or {}
        self._cache: dict[tuple[bytes, int], frozenset[int]] = {}

    def _cost(self, option: bytes) -> int:
        return len(option) - len(self.prefix) + self.tails.get(option, 0)

    def _live(self) -> list[bytes]:
        return [o for o in self.options if o.startswith(self.prefix)]

    def allowed(self, room: int) -> frozenset[int]:
        key = (self.prefix, room)
        if key not in self._cache:
            k = len(self.prefix)
            fits = [o for o in self._live() if len(o) > k and self._cost(o) <= max(room, 1)]
            self._cache[key] = frozenset(o[k] for o in fits)
        return self._cache[key]

    def advance(self, token: int) -> None:
        self.prefix += bytes((token,))

    @property
    def can_end(self) -> bool:
        return self.prefix in self.options

    @property
    def min_left(self) -> int:
        return min((self._cost(o) for o in self._live()), default=0)


def _string(s: dict, depth: int) -> list:
    return [Lit(b'"', "args"), Chars(_STRING_CHARS, _STRING_CHARS, 0, MAX_STRING, "args"), Lit(b'"', "args")]


def _number(s: dict, depth: int) -> list:
    # A positive integer without leading zeros is valid for both "integer" and "number".
    return [Chars(_NONZERO, _DIGITS, 1, MAX_DIGITS, "args")]


def _boolean(s: dict, depth: int) -> list:
    return [Choice([b"true", b"false"], "args")]


def _null(s: dict, depth: int) -> list:
    return [Lit(b"null", "args")]


def _array(s: dict, depth: int) -> list:
    """One element, or none past MAX_DEPTH."""
    inner = value_segments(s.get("items"), depth + 1) if depth < MAX_DEPTH else []
    return [Lit(b"[", "args"), *inner, Lit(b"]", "args")]


def _object(s: dict, depth: int) -> list:
    return object_segments(s, depth + 1)


# JSON Schema "type" -> the segments of one value of that type. Unknown or missing types get a
# string, the most permissive choice a tool is likely to accept.
VALUE_KINDS = {
    "string": _string,
    "integer": _number,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "array": _array,
    "object": _object,
}


def value_segments(schema: object, depth: int = 0) -> list:
    """Segments that generate one JSON value matching a (subset of) JSON Schema."""
    s = schema if isinstance(schema, dict) else {}
    if isinstance(s.get("enum"), list) and s["enum"]:
        return [Choice([json.dumps(v).encode() for v in s["enum"]], "args")]
    kind = s.get("type", "object" if "properties" in s else "string")
    if isinstance(kind, list):  # ["string", "null"]: generate the non-null alternative
        kind = next((k for k in kind if isinstance(k, str) and k != "null"), "string")
    return VALUE_KINDS.get(kind if isinstance(kind, str) else "string", _string)(s, depth)


def object_segments(schema: dict, depth: int = 0) -> list:
    """`{"key": value, ...}` over the required properties (all of them if none are required)."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    listed = schema.get("required")
    required = [k for k in listed if isinstance(k, str) and k in props] if isinstance(listed, list) else []
    keys = (required or list(props))[:MAX_PROPERTIES] if depth <= MAX_DEPTH else []
    segs: list = [Lit(b"{", "args")]
    for i, key in enumerate(keys):
        sep = b", " if i else b""
        segs.append(Lit(sep + json.dumps(key).encode() + b": ", "args"))
        segs += value_segments(props[key], depth)
    segs.append(Lit(b"}", "args"))
    return _merge_literals(segs)


def _merge_literals(segs: list) -> list:
    out: list = []
    for s in segs:
        if out and isinstance(s, Lit) and isinstance(out[-1], Lit) and s.field == out[-1].field:
            out[-1] = Lit(out[-1].tokens + s.tokens, s.field)
        else:
            out.append(s)
    return out


def min_length(segs: Sequence) -> int:
    return sum(s.min_left for s in segs)


class ToolCallGrammar:
    """One tool call: the envelope, a tool name from `tools`, and arguments for that tool.

    `tools` maps each allowed name to its parameters schema. The argument segments are added only
    once the name is chosen, because each tool has its own schema.
    """

    __slots__ = ("tools", "segs", "i", "name", "last_field")

    def __init__(self, tools: dict[str, object]):
        if not tools:
            raise ValueError("a tool call needs at least one tool")
        self.tools = tools
        # Names carry their closing quote, so no option is a prefix of another and the name is
        # final exactly when its segment is done.
        names = [n.encode() + b'"' for n in tools]
        args_min = {n.encode() + b'"': min_length(object_segments(_as_object(s))) for n, s in tools.items()}
        self.segs: list = [
            Lit([int(Special.TOOL_CALL), *b'{"name": "']),
            Choice(names, "name", tails=args_min),
            Lit(b', "arguments": '),
            None,  # the chosen tool's arguments, filled in when the name is complete
            Lit([ord("}"), int(Special.TOOL_CALL_END)]),
        ]
        self.i, self.name, self.last_field = 0, None, "frame"

    @property
    def done(self) -> bool:
        return self.i >= len(self.segs)

    def min_left(self) -> int:
        # The arguments placeholder counts 0: until the name is chosen, the name's Choice counts
        # them in its tails.
        return sum(s.min_left for s in self.segs[self.i :] if s is not None)

    def allowed(self, budget: int) -> frozenset[int]:
        if self.done:
            return EMPTY
        # Past the point where the shortest completion still fits, keep writing the shortest
        # completion anyway: the token limit then cuts the call and the finish reason says so.
        return self._allowed(budget) or self._allowed(1 << 30)

    def _allowed(self, budget: int) -> frozenset[int]:
        seg, after = self.segs[self.i], self.min_left() - self.segs[self.i].min_left
        here = seg.allowed(budget - after)
        if seg.can_end and self.i + 1 < len(self.segs):
            nxt = self._segment(self.i + 1)
            here = here | nxt.allowed(budget - (after - nxt.min_left))
        return here

    def advance(self, token: int) -> None:
        seg = self.segs[self.i]
        if token not in seg.allowed(1 << 30):
            self._next()
            seg = self.segs[self.i]
        seg.advance(token)
        self.last_field = seg.field
        if seg.can_end and not seg.allowed(1 << 30):
            self._next()

    def _next(self) -> None:
        seg = self.segs[self.i]
        if seg.field == "name":
            self.name = seg.prefix[:-1].decode()
        self.i += 1
        self._segment(self.i)

    def _segment(self, i: int):
        """Segment i, expanding the arguments placeholder into real segments once it is reached."""
        if i < len(self.segs) and self.segs[i] is None:
            args = object_segments(_as_object(self.tools[self.name]))
            self.segs[i : i + 1] = args
        return self.segs[i] if i < len(self.segs) else None


def _as_object(schema: object) -> dict:
    return schema if isinstance(schema, dict) else {}
