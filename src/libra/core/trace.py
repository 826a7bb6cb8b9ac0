"""The JSONL trajectory trace: read, validate and write.

One trajectory per line, as documented in the README (section "Trace format"). A malformed line is
never skipped silently: reading raises `TraceError` naming file:line and the field, so the CLI can
exit 2 with that message. LLMServingSim's agentic-session JSONL is imported here too, so that
traces from that simulator replay unchanged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from libra.core.config import build, regular_file
from libra.core.errors import ConfigError, TraceError
from libra.core.trajectory import ToolStatus, Trajectory, Turn

# No model serves a context this long; a larger token count is a corrupt line, and replaying it
# would keep the simulator decoding for hours.
MAX_TOKENS = 1 << 24
MAX_TOOL_LATENCY_S = 86_400.0  # a day


def _int_field(
    rec: dict, key: str, where: tuple[str, int], minimum: int = 0, default=None, maximum: int = MAX_TOKENS
) -> int:
    if key not in rec:
        if default is not None:
            return default
        raise TraceError(*where, key, "is missing")
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise TraceError(*where, key, f"must be an integer from {minimum} to {maximum}, got {v!r}")
    return v


def _parse_turn(d: object, where: tuple[str, int], k: int, last: bool) -> Turn:
    name = f"turns[{k}]"
    if not isinstance(d, dict):
        raise TraceError(*where, name, f"must be an object, got {type(d).__name__}")
    out = _int_field(d, "output_tokens", where, 0)
    tool = d.get("tool")
    if tool is None:
        if not last:
            raise TraceError(*where, f"{name}.tool", "only the last turn may have no tool")
        return Turn(output_tokens=out)
    if last:
        raise TraceError(*where, f"{name}.tool", "the last turn must not call a tool")
    if not isinstance(tool, str) or not tool:
        raise TraceError(*where, f"{name}.tool", f"must be a non-empty string, got {tool!r}")
    try:
        status = ToolStatus.parse(d.get("tool_status", "success"))
    except (ValueError, AttributeError) as e:
        raise TraceError(*where, f"{name}.tool_status", str(e)) from None
    lat = d.get("tool_latency_s")
    if lat is not None and (
        isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat <= MAX_TOOL_LATENCY_S
    ):
        raise TraceError(
            *where,
            f"{name}.tool_latency_s",
            f"must be a number from 0 to {MAX_TOOL_LATENCY_S:g}, got {lat!r}",
        )
    ret = _int_field(d, "tool_return_tokens", where, 0, default=0)
    return Turn(out, tool, ret, status, None if lat is None else float(lat))


def parse_trajectory(rec: object, where: tuple[str, int]) -> Trajectory:
    if not isinstance(rec, dict):
        raise TraceError(*where, "<line>", "must be a JSON object")
    turns_raw = rec.get("turns")
    if not isinstance(turns_raw, list) or not turns_raw:
        raise TraceError(*where, "turns", "must be a non-empty list")
    turns = [_parse_turn(t, where, k, k == len(turns_raw) - 1) for k, t in enumerate(turns_raw)]
    for key in ("id", "prompt_id"):
        if not isinstance(rec.get(key), str) or not rec[key]:
            raise TraceError(*where, key, f"must be a non-empty string, got {rec.get(key)!r}")
    return _checked(
        Trajectory(
            id=rec["id"],
            prompt_id=rec["prompt_id"],
            step=_int_field(rec, "step", where, 0, default=0, maximum=2**62),
            prompt_tokens=_int_field(rec, "prompt_tokens", where, 1),
            turns=turns,
        ),
        where,
    )


def _checked(t: Trajectory, where: tuple[str, int]) -> Trajectory:
    if t.total_tokens > MAX_TOKENS:
        raise TraceError(*where, "turns", f"add up to {t.total_tokens} tokens; at most {MAX_TOKENS}")
    return t


M = TypeVar("M", bound=BaseModel)
MAX_LINE = 64 << 20  # bytes in one JSONL line: a trajectory is far smaller


def json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line. Read as bytes, so a line that is not
    UTF-8 is an error naming the line, and a regular file only (/dev/zero would never end)."""
    try:
        regular_file(path)
        fh = path.open("rb")
    except ValueError:
        raise TraceError(str(path), 0, "<file>", "is not a regular file") from None
    except OSError as e:
        raise TraceError(str(path), 0, "<file>", f"cannot be read: {e.strerror}") from None
    with fh:
        n = 0
        while line := fh.readline(MAX_LINE + 1):
            n += 1
            if len(line) > MAX_LINE:
                raise TraceError(str(path), n, "<line>", f"is longer than {MAX_LINE >> 20} MiB")
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
                raise TraceError(str(path), n, "<line>", f"is not valid JSON ({str(e)[:200]})") from None


def build_line(model: type[M], rec: object, path: Path | str, line: int) -> M:
    """Validate one JSONL record into `model`; a bad value is a TraceError naming file:line and
    the field."""
    if not isinstance(rec, dict):
        raise TraceError(str(path), line, "<line>", "must be a JSON object")
    try:
        return build(model, rec)
    except ConfigError as e:
        raise TraceError(str(path), line, e.field, f"got {e.value!r}; allowed: {e.allowed}") from None


def _looks_like_llmservingsim(rec: object) -> bool:
    return isinstance(rec, dict) and "sub_requests" in rec and "session_id" in rec


def read_trace(path: str | Path) -> list[Trajectory]:
    """Read a Libra trace or an LLMServingSim agentic-session file; the format is detected per line."""
    path = Path(path)
    out, line_of = [], {}
    for n, rec in json_lines(path):
        where = (str(path), n)
        t = (
            parse_llmservingsim(rec, where)
            if _looks_like_llmservingsim(rec)
            else parse_trajectory(rec, where)
        )
        if t.id in line_of:  # routers and the simulator key trajectories by id
            raise TraceError(
                *where, "id", f"{t.id!r} is already the id of line {line_of[t.id]}; ids must be unique"
            )
        line_of[t.id] = n
        out.append(t)
    if not out:
        raise TraceError(str(path), 0, "<file>", "holds no trajectories")
    return out


def parse_llmservingsim(rec: dict, where: tuple[str, int]) -> Trajectory:
    """One LLMServingSim session: sub-requests are turns; each input is the whole context so far.

    A sub-request's `input_toks` is its full prompt, so the tool return between two sub-requests is
    what the next input adds beyond the previous context and output.
    """
    subs = rec.get("sub_requests")
    if not isinstance(subs, list) or not subs:
        raise TraceError(*where, "sub_requests", "must be a non-empty list")
    ins = [_int_field(s if isinstance(s, dict) else {}, "input_toks", where, 1) for s in subs]
    outs = [_int_field(s, "output_toks", where, 0) for s in subs]
    turns = []
    for k in range(len(subs)):
        if k == len(subs) - 1:
            turns.append(Turn(outs[k]))
            continue
        ret = max(0, ins[k + 1] - ins[k] - outs[k])
        dur = subs[k].get("tool_duration_ns", 0) or 0
        if isinstance(dur, bool) or not isinstance(dur, (int, float)) or dur < 0:
            raise TraceError(*where, f"sub_requests[{k}].tool_duration_ns", f"must be >= 0, got {dur!r}")
        turns.append(Turn(outs[k], "tool", ret, ToolStatus.SUCCESS, dur / 1e9))
    sid = str(rec["session_id"])
    return _checked(
        Trajectory(
            id=sid, prompt_id=sid, step=int(rec.get("step", 0) or 0), prompt_tokens=ins[0], turns=turns
        ),
        where,
    )


def write_trace(trajs: list[Trajectory], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for t in trajs:
            fh.write(json.dumps(t.to_dict(), separators=(",", ":")) + "\n")


def deal_prompts(trajs: list[Trajectory], seed: int) -> list[Trajectory]:
    """The same trajectories with their prompts dealt to the trace's steps in another random order
    (seed 0: the trace's own order). A small trace's figures depend on which prompts share a step,
    so evaluations report the mean over several deals."""
    if seed == 0:
        return trajs
    prompts = sorted({t.prompt_id for t in trajs})
    n_steps = len({t.step for t in trajs})
    random.Random(seed).shuffle(prompts)
    step = {p: i * n_steps // len(prompts) for i, p in enumerate(prompts)}
    return [replace(t, step=step[t.prompt_id]) for t in trajs]
