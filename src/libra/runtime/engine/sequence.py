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

from libra.runtime.engine.constraints import END, ToolCallGrammar, Utf8Text
from libra.runtime.engine.tokenizer import NUM_BYTES, SPECIAL_TEXT


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
    """A sampled token's log-probability under the policy's processed distribution
    (`distribution.processed_logprobs`); `forced`: the constraint chose it, not the policy."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    forced: bool = False


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
    kv_versions: list[str] = field(default_factory=list)  # the oldest weights in the KV each one read
    finish: str | None = None
    matched: int | str | None = None  # what ended it: the end token's id, the stop string, an abort's reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class TextOutput:
    """Plain text: valid UTF-8, stop strings and stop token ids honoured.

    By default (OpenAI's and vLLM's) a stop string is cut from the text and never sent even in
    part; `include_stop` keeps it (vLLM's include_stop_str_in_output, SGLang's no_stop_trim), and
    `specials` writes the end token by its name (skip_special_tokens false). The token ids always
    hold every sampled token, so a client can train on exactly what was sampled.
    """

    __slots__ = ("constraint", "buf", "sent", "stops", "stop_ids", "include_stop", "specials", "_utf8")

    def __init__(self, stops: tuple[str, ...] = (), ignore_eos: bool = False, stop_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False, specials: bool = False):  # fmt: skip
        self.constraint = Utf8Text(allow_end=not ignore_eos)
        self.buf, self.sent = bytearray(), 0
        self.stops = [s.encode() for s in stops if s]
        self.stop_ids, self.include_stop, self.specials = stop_ids, include_stop, specials
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int, ev: SeqEvent) -> str | None:
        self.constraint.advance(token)
        if token == END or token >= NUM_BYTES or token in self.stop_ids:
            return self._stop_token(token, ev)
        self.buf.append(token)
        hit = max((s for s in self.stops if self.buf.endswith(s)), key=len, default=b"")
        if hit:  # the longest stop ending here, so no part of any stop is left in the text
            if not self.include_stop:
                del self.buf[-len(hit) :]
            ev.text += self._send(len(self.buf), final=True)
            ev.matched = hit.decode("utf-8", "replace")
            return FinishReason.STOP
        ev.text += self._send(len(self.buf) - self._held(), final=False)
        return None

    def _stop_token(self, token: int, ev: SeqEvent) -> str:
        if self.include_stop and token < NUM_BYTES:
            self.buf.append(token)
        ev.text += self._send(len(self.buf), final=True)
        if self.include_stop and self.specials and token >= NUM_BYTES:
            ev.text += SPECIAL_TEXT.get(token, "")
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


class Sequence:
    __slots__ = (
        "rid", "index", "sink", "tokens", "n_prompt", "num_computed", "status", "blocks", "row",
        "synced", "params", "output", "rng", "max_model_len", "arrived", "first_token_at",
        "finish_reason", "kv_version",
    )  # fmt: skip

    def __init__(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                 output: TextOutput | ToolOutput, sink: object, max_model_len: int, arrived: float = 0.0):  # fmt: skip
        self.rid, self.index, self.sink = rid, index, sink
        self.tokens, self.n_prompt, self.num_computed = list(prompt), len(prompt), 0
        self.status, self.blocks, self.row, self.synced = SeqStatus.WAITING, [], -1, 0
        self.params, self.output, self.max_model_len = params, output, max_model_len
        self.rng = random.Random(params.seed)
        self.arrived, self.first_token_at, self.finish_reason = arrived, None, None
        self.kv_version = ""  # the weight version its KV cache was first computed with (set at prefill)

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
