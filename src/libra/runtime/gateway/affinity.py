"""Affinity without a session key: a turn that extends an earlier turn goes where that turn ran.

slime sends no session key unless its router policy is `consistent_hashing`, and verl's and
SkyRL's token-in/token-out turns often come without one, yet a multi-turn trajectory's next prompt
is the previous prompt, the previous response and what the tools returned, so its KV prefix sits
on the engine that served the previous turn. sglang-router's cache-aware policy finds it by
matching request text against a radix tree of what each worker served; this index does the same
exactly, in O(prompt length / block) per lookup:

- a served turn is recorded as the sequence prompt + response (token ids when the request and the
  response carry them; otherwise text; a chat turn as its messages plus the assistant's reply);
- a sequence is hashed in blocks of `block` units, each block's hash chained to the one before,
  so a sequence's prefixes at block boundaries have known hashes. A record is filed under the
  chained hash at its last full block, with the units after it (its tail) kept for comparison;
- a lookup hashes the new prompt the same way and walks its block boundaries from the longest
  down: a record matches when its tail continues the prompt there and the prompt is strictly
  longer (a later turn). So the first turns of a GRPO group, which share a prompt but not a
  response, never join one another: each only matches its own continuation.

Bounded: at most `capacity` block keys (least recently used go first), `per_key` records each.
The gateway only consults it for requests that name no session; a session key always wins. It
decides nothing itself: a match makes the turn's instance its current one, and the placement rule
every router shares keeps it there when it is routable and the context still fits its bucket.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from libra.runtime.gateway.conversation import text_of

Units = tuple[int, ...] | str


@dataclass(frozen=True, slots=True)
class Record:
    tail: Units
    length: int
    instance: str


def _blocks(seq: Units, block: int) -> list[int]:
    """The chained hash of `seq`'s first k blocks, for k = 0 .. len(seq) // block."""
    out = [hash(type(seq).__name__)]  # token ids never match text
    for i in range(0, len(seq) - block + 1, block):
        out.append(hash((out[-1], seq[i : i + block])))
    return out


class PrefixIndex:
    def __init__(self, block: int = 64, capacity: int = 100_000, per_key: int = 16):
        self.block, self.capacity, self.per_key = block, capacity, per_key
        self._keys: OrderedDict[int, list[Record]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, seq: Units, instance: str) -> None:
        """`seq` (a prompt and its response) was served by `instance`."""
        if not seq:
            return
        chain = _blocks(seq, self.block)
        k = len(chain) - 1
        key, tail = chain[k], seq[k * self.block :]
        records = [r for r in self._keys.pop(key, []) if r.tail != tail]
        records.append(Record(tail, len(seq), instance))
        self._keys[key] = records[-self.per_key :]
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def lookup(self, prompt: Units) -> str | None:
        """The instance that served the longest recorded sequence `prompt` strictly extends."""
        if not prompt:
            return None
        chain = _blocks(prompt, self.block)
        for k in range(len(chain) - 1, -1, -1):
            records = self._keys.get(chain[k])
            if not records:
                continue
            start = k * self.block
            hits = [
                r for r in records if r.length < len(prompt) and prompt[start : start + len(r.tail)] == r.tail
            ]
            if hits:
                self._keys.move_to_end(chain[k])
                return max(hits, key=lambda r: r.length).instance
        return None


# ---- what a request and its answer are, as sequences ---------------------------------------------


def prompt_units(kind: str, data: dict, messages: list | None) -> Units | None:
    """A request's prompt as a sequence: token ids, text, or a chat rendered as text. None for a
    batch of prompts (each is its own turn; none is followed here)."""
    if messages is not None:
        return "".join(message_text(m) for m in messages)
    prompt = {"completions": "prompt", "tokens": "token_ids"}.get(kind)
    value = data.get(prompt) if prompt else data.get("input_ids", data.get("text"))
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(x) is int for x in value):
        return tuple(value)
    return None


def message_text(m: object) -> str:
    """One chat message as text: role, content, and each tool call's name and arguments."""
    if not isinstance(m, dict):
        return ""
    parts = [str(m.get("role", "")), text_of(m.get("content"))]
    calls = m.get("tool_calls")
    for c in calls if isinstance(calls, list) else ():
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict):
            parts += [str(f.get("name", "")), str(f.get("arguments", ""))]
    return "\x1e".join(parts) + "\x1d"


def continuations(kind: str, prompt: Units, answer: object) -> list[Units]:
    """Prompt + response for each choice of a decoded answer (as the next turn would send it)."""
    if kind == "generate":
        items = [answer] if isinstance(answer, dict) else []
        return [c for c in (_extend(prompt, i.get("output_ids"), i.get("text")) for i in items) if c]
    choices = answer.get("choices") if isinstance(answer, dict) else None
    out = []
    for c in choices if isinstance(choices, list) else ():
        if not isinstance(c, dict):
            continue
        if kind == "chat":
            ext = prompt + message_text(c.get("message")) if isinstance(prompt, str) else None
        else:
            ext = _extend(prompt, c.get("token_ids"), c.get("text"))
        if ext:
            out.append(ext)
    return out


def _extend(prompt: Units, ids: object, text: object) -> Units | None:
    if isinstance(prompt, tuple):
        ok = isinstance(ids, list) and all(type(x) is int for x in ids)
        return prompt + tuple(ids) if ok else None
    return prompt + text if isinstance(text, str) else None
