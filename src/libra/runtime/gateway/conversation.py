"""What a request's conversation tells the router: its tool-return path and its size.

Agent loops resend the whole conversation every turn, and C-MLFQ needs the trajectory's path of
tool-return states. The path is read from the messages themselves: every role=tool message is one
tool return, classified by `libra.rollout.tool_state.classify` (the same classifier the offline
tools use), with the tool's name taken from the assistant `tool_calls` entry whose id the tool
message answers. Nothing is required from the client beyond the standard OpenAI shapes.

A `Scan` keeps running totals so that each turn reads only the messages appended since the last
one: agent conversations are append-only, so this is O(new messages) per turn instead of
O(conversation). When a conversation is shorter than what was scanned (the client restarted it or
edited history) the scan starts over, so the path always describes the conversation as sent.

Anything can arrive in a message: scanning never raises, whatever the types (the HTTP layer only
checks that `messages` is a non-empty list).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from libra.rollout.base import ToolState
from libra.rollout.tool_state import SizeThresholds, classify

# Tool returns that look like a JSON object are decoded (so `{"status": "error"}` is read as a
# status, as SandboxFusion-style tools return it) up to this size; larger ones are scanned as text.
MAX_JSON_DECODE = 1 << 20


@dataclass(slots=True)
class Scan:
    """Running totals over a conversation, extended message by message."""

    n: int = 0
    chars: int = 0
    assistant_chars: int = 0
    path: list[ToolState] = field(default_factory=list)
    call_names: dict[str, str] = field(default_factory=dict)
    first_user: str | None = None


def text_of(content: object) -> str:
    """A message's text: a string, or the text parts of a content list; anything else is ''."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def scan_messages(scan: Scan, messages: list, thresholds: SizeThresholds) -> Scan:
    """Extend `scan` with the messages after `scan.n` (start over if the conversation shrank)."""
    if len(messages) < scan.n:
        scan = Scan()
    for m in messages[scan.n :]:
        if isinstance(m, dict):
            _one(scan, m, thresholds)
    scan.n = len(messages)
    return scan


def _one(scan: Scan, m: dict, th: SizeThresholds) -> None:
    role = m.get("role")
    text = text_of(m.get("content"))
    scan.chars += len(text)
    if role == "assistant":
        scan.assistant_chars += len(text) + _tool_calls(scan, m.get("tool_calls"))
    elif role == "tool":
        name = scan.call_names.get(m.get("tool_call_id")) if isinstance(m.get("tool_call_id"), str) else None
        if name is None and isinstance(m.get("name"), str):
            name = m["name"]
        scan.path.append(tool_state(name, m.get("content"), text, m.get("status"), th))
    elif role == "user" and scan.first_user is None:
        scan.first_user = text


def _tool_calls(scan: Scan, calls: object) -> int:
    """Remember each call's function name by id; returns the characters of the arguments."""
    if not isinstance(calls, list):
        return 0
    chars = 0
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            chars += len(args)
            scan.chars += len(args)
        cid, name = call.get("id"), fn.get("name")
        if isinstance(cid, str) and isinstance(name, str):
            scan.call_names[cid] = name
    return chars


def tool_state(name: str | None, raw: object, text: str, hint: object, th: SizeThresholds) -> ToolState:
    """One tool return's state. A JSON-object return is read by its fields (status, error, ...)."""
    content: object = raw if isinstance(raw, (str, dict)) else text
    if text.lstrip()[:1] == "{" and len(text) <= MAX_JSON_DECODE:
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            content = decoded
    return classify(name, content, small_max=th.small_max, medium_max=th.medium_max, unit=th.unit,
                    status_hint=hint if isinstance(hint, (str, bool)) else None)  # fmt: skip


def prompt_size(prompt: object) -> tuple[int, int | None]:
    """(characters, exact tokens or None) of a prompt: text, a batch of texts, token ids (vLLM's
    /v1/completions, SGLang's input_ids) or a batch of token-id lists. A batch is sized by its
    longest prompt: each of its sequences holds that much context, and the bucket rule is about
    the context one sequence needs. Counting only looks at lengths and types, never at values."""
    if isinstance(prompt, str):
        return len(prompt), None
    if not isinstance(prompt, list) or not prompt:
        return 0, None
    first = prompt[0]
    if isinstance(first, int):
        return 0, len(prompt)
    if isinstance(first, list):
        return 0, max((len(p) for p in prompt if isinstance(p, list)), default=0)
    return max((len(p) for p in prompt if isinstance(p, str)), default=0), None


def prompt_key(prompt: object) -> str:
    """What identifies a token-in or text-in prompt's GRPO group: its text, or its token ids
    (the samples of one prompt share their first turn's prompt)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, (str, list)):
            return prompt_key(first)
        if isinstance(first, int):
            return ",".join(map(str, prompt[:4096]))
    return ""


def prompt_id_of(text: str | None) -> str:
    """A stable id for a prompt: GRPO samples of one prompt share their first user message."""
    return hashlib.blake2b((text or "").encode("utf-8", "replace"), digest_size=8).hexdigest()
