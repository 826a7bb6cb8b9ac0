"""Byte-level tokenizer and the chat template of the built-in engine.

Why bytes: nothing has to be downloaded or trained, every string round-trips exactly, and the
vocabulary is tiny, so the model stays cheap on CPU. Ids 0-255 are the bytes of UTF-8 text; the
ids above are special tokens (role markers, end of message, the tool-call envelope). A special
token can never be produced by encoding text, so a user who types "<|user|>" cannot forge a turn.

The chat template, written with the special tokens shown by their names:

    <|bos|><|tools|>[...tool schemas as JSON...]<|end|>
    <|system|>You are terse.<|end|>
    <|user|>What is 2+2?<|end|>
    <|assistant|><tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call><|end|>
    <|tool|>call_1
    4<|end|>
    <|assistant|>                      <- the model continues from here

An assistant turn is its text content followed by one envelope per tool call; a tool message is
its `tool_call_id`, a newline and its content. The generation grammar in `constraints` emits
exactly the envelope format rendered here, so the model sees its own calls in the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum


class Special(IntEnum):
    BOS = 256
    END = 257
    SYSTEM = 258
    USER = 259
    ASSISTANT = 260
    TOOL = 261
    TOOLS = 262
    TOOL_CALL = 263
    TOOL_CALL_END = 264


# Padded to a multiple of 16 so the output projection has a friendly shape; ids 265-271 are unused
# and always masked out when sampling.
VOCAB_SIZE = 272
NUM_BYTES = 256

SPECIAL_TEXT = {
    Special.BOS: "<|bos|>",
    Special.END: "<|end|>",
    Special.SYSTEM: "<|system|>",
    Special.USER: "<|user|>",
    Special.ASSISTANT: "<|assistant|>",
    Special.TOOL: "<|tool|>",
    Special.TOOLS: "<|tools|>",
    Special.TOOL_CALL: "<tool_call>",
    Special.TOOL_CALL_END: "</tool_call>",
}

# "developer" is the newer OpenAI name for the system role; both render the same.
ROLE_TOKEN = {
    "system": Special.SYSTEM,
    "developer": Special.SYSTEM,
    "user": Special.USER,
    "assistant": Special.ASSISTANT,
    "tool": Special.TOOL,
}


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """The text of the byte tokens in `ids`; special tokens are dropped."""
    return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")


def render(ids: Iterable[int]) -> str:
    """Human-readable text of `ids` with special tokens shown by name (for logs and docs)."""
    out, run = [], bytearray()
    for i in ids:
        if i < NUM_BYTES:
            run.append(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run.clear()
        out.append(SPECIAL_TEXT.get(i, f"<|unused{i}|>"))
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


@dataclass(frozen=True, slots=True)
class ToolCallText:
    name: str
    arguments: str  # the JSON text of the arguments object, as OpenAI carries it


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCallText, ...] = ()
    tool_call_id: str | None = None


def tool_call_body(name: str, arguments: str) -> str:
    """The envelope body; `constraints.ToolCallGrammar` generates this exact shape."""
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}"


def render_message(m: ChatMessage) -> list[int]:
    ids = [int(ROLE_TOKEN[m.role])]
    if m.role == "tool":
        ids += encode(f"{m.tool_call_id or ''}\n")
    ids += encode(m.content)
    for call in m.tool_calls:
        ids += [Special.TOOL_CALL, *encode(tool_call_body(call.name, call.arguments)), Special.TOOL_CALL_END]
    ids.append(Special.END)
    return ids


def render_chat(messages: Sequence[ChatMessage], tools: list | None = None) -> list[int]:
    """Token ids of a conversation, ending with the open assistant turn the model continues."""
    ids = [int(Special.BOS)]
    if tools:
        ids += [Special.TOOLS, *encode(json.dumps(tools, separators=(",", ":"))), Special.END]
    for m in messages:
        ids += render_message(m)
    ids.append(Special.ASSISTANT)
    return ids


def render_prompt(text: str) -> list[int]:
    """Token ids of a plain completion prompt."""
    return [int(Special.BOS), *encode(text)]
