"""One generated sequence: its tokens, its place in the KV cache, its lifecycle and its output.

A chat request with `n` choices becomes `n` sequences. Each owns an output handler that turns
sampled tokens into what the client sees (text deltas with stop strings held back, or a tool call
announced by name and then streamed argument by argument), and the constraint that says which
tokens it may sample next. The lifecycle is an IntEnum state machine whose transitions check the
state they start from, so a double free or a resurrected sequence fails loudly in tests.
"""

from __future__ import annotations

import codecs
import random
import secrets
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache

from libra.runtime.engine.codec import BYTES, Codec, parse_hermes
from libra.runtime.engine.constraints import FreeText, ToolCallGrammar, Utf8Text, _all_but


class SeqStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    top_k: int = 0  # 0: every token (vLLM's -1 is normalised to 0 by the protocol)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SeqEvent:
    """What one step produced for one sequence; the HTTP side turns it into a chunk or a message."""

    index: int
    text: str = ""
    tool_call: tuple[str, str] | None = None  # (call id, tool name), once the name is complete
    tool_args: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the tokens sampled, in order
    versions: list[str] = field(default_factory=list)  # the weight version of each of them
    finish: str | None = None
    matched: int | str | None = None  # what ended it: the end token's id, the stop string, an abort's reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    raw: str | None = None  # a Hermes tool-call turn's whole text, markup included (see HermesOutput)


class AtLeast:
    """vLLM's `min_tokens` over another constraint: until `left` more tokens are sampled, neither
    the end token nor a stop token may be (their logits are masked, as vLLM masks them)."""

    __slots__ = ("inner", "left", "banned", "vocab_size")

    def __init__(self, inner: Utf8Text | FreeText, n: int, banned: frozenset[int], vocab_size: int):
        """`banned`: the stop tokens and the codec's end tokens."""
        self.inner, self.left, self.banned, self.vocab_size = inner, n, banned, vocab_size

    def allowed(self, budget: int) -> frozenset[int]:
        allowed = self.inner.allowed(budget)
        if self.left <= 0:
            return allowed
        return _all_but(self.vocab_size, self.banned) if allowed is None else _without(allowed, self.banned)

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.left -= 1

    @property
    def done(self) -> bool:
        return self.inner.done


@lru_cache(maxsize=256)
def _without(allowed: frozenset[int], banned: frozenset[int]) -> frozenset[int]:
    return allowed - banned


class TextOutput:
    """Plain text: stop strings and stop token ids honoured; with the built-in codec, only valid
    printable UTF-8 is sampled (`Utf8Text`), with a tokenizer's vocabulary anything is (`FreeText`).

    Text is built from each token's bytes (`Codec.token_bytes`), so a character or a stop string
    split over tokens comes out whole. By default (OpenAI's and vLLM's) a stop string is cut from
    the text and never sent even in part; `include_stop` keeps it (vLLM's
    include_stop_str_in_output, SGLang's no_stop_trim), and `specials` writes the end token by its
    name (skip_special_tokens false). The token ids always hold every sampled token, so a client
    can train on exactly what was sampled. With `min_tokens` nothing ends the text before that
    many tokens: the end and stop tokens are masked and stop strings are not looked for.
    """

    __slots__ = (
        "constraint",
        "buf",
        "sent",
        "stops",
        "stop_ids",
        "include_stop",
        "specials",
        "codec",
        "_utf8",
        "_early",
    )

    def __init__(self, stops: tuple[str, ...] = (), ignore_eos: bool = False, stop_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False, specials: bool = False, min_tokens: int = 0, codec: Codec = BYTES):  # fmt: skip
        self.codec = codec
        text = Utf8Text(allow_end=not ignore_eos) if codec is BYTES else FreeText(codec, not ignore_eos)
        banned = stop_ids | codec.end_ids
        self.constraint = AtLeast(text, min_tokens, banned, codec.vocab_size) if min_tokens > 0 else text
        self._early = min_tokens  # tokens still to come before a stop string may end the text
        self.buf, self.sent = bytearray(), 0
        self.stops = [s.encode() for s in stops if s]
        self.stop_ids, self.include_stop, self.specials = stop_ids, include_stop, specials
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int, ev: SeqEvent) -> str | None:
        self.constraint.advance(token)
        if self.codec.ends_text(token) or token in self.stop_ids:
            return self._stop_token(token, ev)
        start = len(self.buf)
        self.buf += self.codec.token_bytes(token)
        self._early -= 1
        hit = self._stop_at(start) if self._early <= 0 else None
        if hit is not None:  # the earliest (so longest) stop reaching into this token's bytes
            at, stop = hit
            del self.buf[at + (len(stop) if self.include_stop else 0) :]
            ev.text += self._send(len(self.buf), final=True)
            ev.matched = stop.decode("utf-8", "replace")
            return FinishReason.STOP
        ev.text += self._send(len(self.buf) - self._held(), final=False)
        return None

    def _stop_at(self, start: int) -> tuple[int, bytes] | None:
        best = None
        for s in self.stops:
            i = self.buf.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        return best

    def _stop_token(self, token: int, ev: SeqEvent) -> str:
        if self.include_stop and not self.codec.is_special(token):
            self.buf += self.codec.token_bytes(token)
        ev.text += self._send(len(self.buf), final=True)
        if self.include_stop and self.specials and self.codec.is_special(token):
            ev.text += self.codec.label(token)
        ev.matched = token
        return FinishReason.STOP

    def flush(self, ev: SeqEvent) -> None:
        ev.text += self._send(len(self.buf), final=True)

    def _held(self) -> int:
        """Bytes at the end that could still grow into a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), held, -1):
                if self.buf.endswith(s[:k]):
                    held = k
                    break
        return held

    def _send(self, upto: int, final: bool) -> str:
        if upto <= self.sent and not final:
            return ""
        chunk = bytes(self.buf[self.sent : max(upto, self.sent)])
        self.sent = max(upto, self.sent)
        return self._utf8.decode(chunk, final=final)


class ToolOutput:
    """One tool call generated under `ToolCallGrammar`; arguments stream as they are sampled."""

    __slots__ = ("constraint", "call_id", "announced", "args")

    def __init__(self, tools: dict[str, object], call_id: str | None = None):
        self.constraint = ToolCallGrammar(tools)
        self.call_id = call_id or f"call_{secrets.token_hex(12)}"
        self.announced, self.args = False, bytearray()

    def feed(self, token: int, ev: SeqEvent) -> str | None:
        g = self.constraint
        g.advance(token)
        if not self.announced and g.name is not None:
            ev.tool_call, self.announced = (self.call_id, g.name), True
        if g.last_field == "args":
            self.args.append(token)
            ev.tool_args += chr(token)  # the grammar only writes ASCII inside arguments
        return FinishReason.TOOL_CALLS if g.done else None

    def flush(self, ev: SeqEvent) -> None:
        """Nothing is held back: a cut-off call keeps the arguments it had (finish: length)."""


class HermesOutput:
    """Text in which the model may call a tool, Hermes-style: `<tool_call>{json}</tool_call>`.

    Text before the call streams as it comes; from `<tool_call>` on it is held, and when the turn
    ends the first well-formed call becomes the choice's tool call (finish reason `tool_calls`). A
    call that does not parse stays text. The tokens are whatever the model sampled: nothing is
    forced (the grammar of `ToolOutput` is the built-in model's).
    """

    __slots__ = ("text", "constraint", "call_id", "pending", "held", "in_call", "call")

    OPEN = "<tool_call>"

    def __init__(self, text: TextOutput, call_id: str | None = None):
        self.text, self.constraint = text, text.constraint
        self.call_id = call_id or f"call_{secrets.token_hex(12)}"
        self.pending, self.held, self.in_call = "", "", False
        self.call: tuple[str, str] | None = None  # (name, arguments) once parsed

    def feed(self, token: int, ev: SeqEvent) -> str | None:
        inner = SeqEvent(ev.index)
        reason = self.text.feed(token, inner)
        ev.matched = inner.matched
        self._route(inner.text, ev)
        if reason is not None:
            return self._end(reason, ev)
        return None

    def _route(self, delta: str, ev: SeqEvent) -> None:
        if self.in_call:
            self.held += delta
            return
        self.pending += delta
        at = self.pending.find(self.OPEN)
        if at >= 0:
            ev.text += self.pending[:at]
            self.held, self.pending, self.in_call = self.pending[at:], "", True
            return
        keep = next((k for k in range(min(len(self.OPEN) - 1, len(self.pending)), 0, -1) if self.OPEN.startswith(self.pending[-k:])), 0)  # fmt: skip
        ev.text += self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]

    def _end(self, reason: str, ev: SeqEvent) -> str:
        parsed = parse_hermes(self.held) if self.in_call else None
        if parsed is None or reason != FinishReason.STOP:
            self.flush(ev)
            return reason
        _, name, args = parsed
        self.call = (name, args)
        ev.tool_call, ev.tool_args = (self.call_id, name), args
        # What the model wrote, for a client to send back verbatim as the assistant turn's content,
        # so that the next prompt holds the very tokens it sampled (a trainer needs that).
        ev.raw = self.raw
        return FinishReason.TOOL_CALLS

    def flush(self, ev: SeqEvent) -> None:
        """What was held is text after all (a cut-off or malformed call)."""
        self.text.flush(ev)
        ev.text += self.pending + self.held
        self.pending = self.held = ""

    @property
    def raw(self) -> str:
        return self.text.buf.decode("utf-8", errors="replace")


class Sequence:
    __slots__ = (
        "rid", "index", "sink", "tokens", "n_prompt", "num_computed", "status", "blocks", "row",
        "synced", "params", "output", "rng", "max_model_len", "arrived", "first_token_at",
        "finish_reason",
    )  # fmt: skip

    def __init__(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                 output: TextOutput | ToolOutput | HermesOutput, sink: object, max_model_len: int, arrived: float = 0.0):  # fmt: skip
        self.rid, self.index, self.sink = rid, index, sink
        self.tokens, self.n_prompt, self.num_computed = list(prompt), len(prompt), 0
        self.status, self.blocks, self.row, self.synced = SeqStatus.WAITING, [], -1, 0
        self.params, self.output, self.max_model_len = params, output, max_model_len
        self.rng = random.Random(params.seed)
        self.arrived, self.first_token_at, self.finish_reason = arrived, None, None

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def prefilled(self) -> bool:
        return self.num_computed == len(self.tokens) - 1 and self.n_generated > 0

    def budget(self) -> int:
        """Tokens this sequence may still generate."""
        return min(self.params.max_tokens - self.n_generated, self.max_model_len - len(self.tokens))

    def allowed(self) -> frozenset[int]:
        return self.output.constraint.allowed(self.budget())

    # ---- lifecycle -----------------------------------------------------------------------------

    def admit(self, row: int) -> None:
        self._expect(SeqStatus.WAITING, "admit")
        self.status, self.row = SeqStatus.RUNNING, row

    def preempt(self) -> None:
        """Back to waiting; its cache is dropped and recomputed (prompt + generated) on return."""
        self._expect(SeqStatus.RUNNING, "preempt")
        self.status, self.row, self.num_computed, self.synced = SeqStatus.WAITING, -1, 0, 0

    def finish(self, reason: str) -> None:
        if self.status == SeqStatus.FINISHED:
            raise RuntimeError(f"sequence {self.rid}/{self.index}: finish twice")
        self.status, self.finish_reason, self.row = SeqStatus.FINISHED, reason, -1

    def _expect(self, state: SeqStatus, action: str) -> None:
        if self.status != state:
            raise RuntimeError(f"sequence {self.rid}/{self.index}: {action} from {self.status.name}")
