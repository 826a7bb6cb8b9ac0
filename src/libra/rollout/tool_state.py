"""Tool-return state: what one tool return tells the router, as a small hashable `ToolState`.

C-MLFQ keys its causal prefix tree by the sequence of these states, so the classifier must give
a *defined* state for anything a tool can hand back — None, empty text, bytes, a 100 MB log, a
structured JSON result — and never raise: a router that crashes on a weird tool output would take
the whole rollout down with it. Two entry points:

- `classify(tool, content, ...)` for live text and structured returns (the gateway);
- `from_turn(turn, thresholds)` for trace turns, which already carry token counts and a status
  (the simulator and the offline evaluator).

Both size classes come from the same `SizeThresholds`, so live and simulated states agree.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.core.config import build
from libra.core.trajectory import ToolStatus, Trajectory, Turn
from libra.rollout.base import PayloadSize, Status, ToolState

# Tokens are estimated from characters at this ratio (as the shipped traces were built), so that a
# threshold in tokens means the same thing for live text and for trace turns.
CHARS_PER_TOKEN = 4
# Tool names become tree keys; a runaway name must not bloat the tree.
MAX_TOOL_NAME = 64
UNKNOWN_TOOL = "unknown"
# Errors show up at the head ("Error: ...") or the tail (a traceback's last line) of a return.
# Scanning only these windows keeps classification O(1) on a huge log.
SCAN_CHARS = 4096

# Markers are anchored or specific on purpose: a viewed source file says `timeout=30` and
# `error = None` all the time, and must not read as a timeout or a failure.
_TIMEOUT_RE = re.compile(
    r"\btimed out\b|TimeoutError|TimeoutExpired|time limit exceeded|deadline exceeded"
    r"|TimeLimitExceeded|^\s*timeout\s*[:!]",
    re.IGNORECASE | re.MULTILINE,
)
_ERROR_RE = re.compile(
    r"Traceback \(most recent call last\)"
    r"|^\s*(?:[Ee]rror|ERROR|[Ff]atal|FATAL|[Ee]xception|EXCEPTION)\s*[:!\]]"
    r"|^\s*(?:FAILED|FAILURE)\b"
    r"|^\s*[A-Za-z_.]*(?:Error|Exception):"
    r"|command not found|[Ss]egmentation fault|exit (?:code|status):? *[1-9]",
    re.MULTILINE,
)
_TIMEOUT_WORDS = {"timeout", "timed_out", "timedout", "time_out", "timelimitexceeded", "deadline_exceeded"}
_FAILURE_WORDS = {
    "error", "failed", "failure", "fail", "sandboxerror", "exception", "crashed", "killed", "oom",
    "runtimeerror", "compileerror",
}  # fmt: skip


class SizeThresholds(BaseModel):
    """Payload-size classes: small <= small_max < medium <= medium_max < large, in `unit`s."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    small_max: int = Field(default=500, gt=0)
    medium_max: int = Field(default=5000, gt=0)
    unit: Literal["tokens", "chars"] = "tokens"

    @model_validator(mode="after")
    def _ordered(self) -> SizeThresholds:
        if self.medium_max <= self.small_max:
            raise ValueError(f"medium_max ({self.medium_max}) must be > small_max ({self.small_max})")
        return self

    def size_of_tokens(self, tokens: int) -> PayloadSize:
        amount = tokens * CHARS_PER_TOKEN if self.unit == "chars" else tokens
        return self._size(amount)

    def size_of_chars(self, chars: int) -> PayloadSize:
        amount = chars if self.unit == "chars" else -(-chars // CHARS_PER_TOKEN)
        return self._size(amount)

    def _size(self, amount: int) -> PayloadSize:
        if amount <= self.small_max:
            return PayloadSize.SMALL
        return PayloadSize.MEDIUM if amount <= self.medium_max else PayloadSize.LARGE


DEFAULT_THRESHOLDS = SizeThresholds()


@functools.lru_cache(maxsize=64)
def thresholds(small_max: int = 500, medium_max: int = 5000, unit: str = "tokens") -> SizeThresholds:
    """Validated thresholds (cached: `classify` runs on every tool return). Bad values raise a
    one-line ConfigError naming the field."""
    return build(
        SizeThresholds, {"small_max": small_max, "medium_max": medium_max, "unit": unit}, "tool_state"
    )


def tool_name(tool: object) -> str:
    """A bounded, non-empty tree key for any tool identifier (None and '' become 'unknown')."""
    if tool is None:
        return UNKNOWN_TOOL
    name = tool if isinstance(tool, str) else _safe_str(tool)
    name = name.strip()[:MAX_TOOL_NAME]
    return name or UNKNOWN_TOOL


def _safe_str(obj: object) -> str:
    try:
        return str(obj)
    except Exception:  # a hostile __str__ must not crash routing
        return type(obj).__name__


# ---- status ----------------------------------------------------------------------------------


def status_from_hint(hint: object) -> Status | None:
    """An explicit status given by the caller: a Status/ToolStatus, a word, or a bool (ok?)."""
    if hint is None:
        return None
    if isinstance(hint, bool):
        return Status.SUCCESS if hint else Status.FAILURE
    if isinstance(hint, (Status, ToolStatus)):
        return Status(int(hint))
    if isinstance(hint, str):
        return _status_word(hint)
    return None


def _status_word(word: str) -> Status | None:
    w = word.strip().lower().replace(" ", "_").replace("-", "_")
    if w in _TIMEOUT_WORDS or w.replace("_", "") in _TIMEOUT_WORDS:
        return Status.TIMEOUT
    if w in _FAILURE_WORDS or w.replace("_", "") in _FAILURE_WORDS:
        return Status.FAILURE
    if w in ("success", "ok", "finished", "succeeded", "done", "completed", "passed"):
        return Status.SUCCESS
    return None


def status_of_text(text: str) -> Status:
    """Timeout or failure when the head or tail of the text says so; success otherwise."""
    window = text if len(text) <= 2 * SCAN_CHARS else text[:SCAN_CHARS] + "\n" + text[-SCAN_CHARS:]
    if _TIMEOUT_RE.search(window):
        return Status.TIMEOUT
    return Status.FAILURE if _ERROR_RE.search(window) else Status.SUCCESS


def status_of_mapping(obj: dict, depth: int = 0) -> Status:
    """A structured return: its `status`/`error`/`timeout`/`return_code` fields, then its text.

    Nested results (SandboxFusion's `run_result` and `compile_result`) are looked into once.
    """
    worst = Status.SUCCESS
    for key in ("status", "state", "result_status"):
        s = _status_word(obj[key]) if isinstance(obj.get(key), str) else None
        worst = _worse(worst, s)
    if obj.get("timeout") is True or obj.get("timed_out") is True:
        worst = _worse(worst, Status.TIMEOUT)
    err = obj.get("error", obj.get("exception"))
    if err not in (None, False, "", {}, []):
        worst = _worse(worst, Status.FAILURE)
    code = obj.get("return_code", obj.get("exit_code", obj.get("returncode")))
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        worst = _worse(worst, Status.FAILURE)
    if depth == 0:
        for key in ("run_result", "compile_result", "result"):
            if isinstance(obj.get(key), dict):
                worst = _worse(worst, status_of_mapping(obj[key], 1))
    return worst


def _worse(a: Status, b: Status | None) -> Status:
    """Timeout outranks failure outranks success: the most telling signal wins."""
    if b is None:
        return a
    rank = {Status.SUCCESS: 0, Status.FAILURE: 1, Status.TIMEOUT: 2}
    return a if rank[a] >= rank[b] else b


# ---- size ------------------------------------------------------------------------------------


def _as_text(content: object) -> str:
    """Text for measuring and scanning. Bytes are decoded leniently; structures as compact JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, bytearray, memoryview)):
        return bytes(content).decode("utf-8", errors="replace")
    if isinstance(content, (dict, list, tuple)):
        try:
            return json.dumps(content, default=_safe_str, separators=(",", ":"))
        except (ValueError, TypeError, RecursionError):  # cycles, odd keys
            return _safe_str(content)
    return _safe_str(content)


def classify(
    tool: str | None,
    content: object,
    *,
    small_max: int = 500,
    medium_max: int = 5000,
    unit: Literal["tokens", "chars"] = "tokens",
    status_hint: object = None,
) -> ToolState:
    """The state of one live tool return. Never raises on the content; always a defined state.

    Status: an explicit `status_hint` wins; else a dict/list return is read by its fields; else the
    text's head and tail are scanned for timeout and error markers. Size counts characters of the
    text (bytes as decoded, structures as compact JSON), converted to tokens at 4 characters each
    when `unit` is tokens.
    """
    try:
        th = thresholds(small_max, medium_max, unit)
    except TypeError:  # unhashable values cannot be cached; validate them to get the ConfigError
        th = build(
            SizeThresholds, {"small_max": small_max, "medium_max": medium_max, "unit": unit}, "tool_state"
        )
    text = _as_text(content)
    status = status_from_hint(status_hint)
    if status is None and isinstance(content, dict):
        status = _worse(status_of_mapping(content), status_of_text(text[:SCAN_CHARS]))
    if status is None:
        status = status_of_text(text)
    return ToolState(tool_name(tool), th.size_of_chars(len(text)), status)


def from_turn(turn: Turn, thresholds: SizeThresholds = DEFAULT_THRESHOLDS) -> ToolState:
    """The state of a trace turn's tool return (the turn must have a tool)."""
    return _interned(turn.tool, thresholds.size_of_tokens(max(0, turn.tool_return_tokens)), turn.tool_status)


@functools.lru_cache(maxsize=4096)
def _interned(tool: str | None, size: PayloadSize, status: int) -> ToolState:
    """One shared object per state: the simulator asks for one at every tool return (a frozen
    dataclass costs ~1 us to build), and the tree's dict lookups hit on identity."""
    return ToolState(tool_name(tool), size, Status(int(status)))


def trajectory_path(
    traj: Trajectory, thresholds: SizeThresholds = DEFAULT_THRESHOLDS
) -> tuple[ToolState, ...]:
    """Every tool return of a trajectory, in order: its full path."""
    return tuple(from_turn(t, thresholds) for t in traj.turns if t.has_tool)


def failures(path: Sequence[ToolState]) -> int:
    return sum(1 for s in path if s.status != Status.SUCCESS)
