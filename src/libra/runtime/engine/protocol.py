"""The OpenAI wire format: request models (validated) and response bodies (built from events).

Requests are pydantic models, so a bad field becomes one `ConfigError` naming the field, the
value and what is allowed, which the server returns as a 400 in OpenAI's error shape. Unknown
fields are ignored, as OpenAI-compatible servers do, but a known option the engine cannot honour
(penalties, `echo`, `best_of`) is refused rather than silently dropped.

Also here: the rule that decides whether a chat turn is a tool call (see `tool_mode`), and the
accumulators that turn a sequence's events into a `choices[i]` entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.core.errors import ConfigError
from libra.runtime.engine.sequence import SeqEvent, TokenLogprob
from libra.runtime.engine.tokenizer import NUM_BYTES, SPECIAL_TEXT, ChatMessage, ToolCallText

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Model(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class FunctionDef(_Model):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None


class ToolDef(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Model):
    type: Literal["text"]
    text: str


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_needs_id(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def to_template(self) -> ChatMessage:
        calls = tuple(ToolCallText(c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return ChatMessage(self.role, self.text(), calls, self.tool_call_id)


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingRequest(_Model):
    """Fields shared by chat and completions requests."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extension: never sample the end token, so text runs to max_tokens or a stop string.
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _supported(self) -> SamplingRequest:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by the built-in engine (use 0 or omit it)")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Extension: how many tool calls an "auto" turn makes after the last user message before it
    # answers in text. Absent means the engine's --tool-rounds. See docs/engine.md.
    libra_tool_rounds: int | None = Field(None, ge=0)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_unsupported(self) -> CompletionRequest:
        if self.echo or (self.best_of or 1) > 1 or self.suffix:
            raise ValueError("echo, best_of and suffix are not supported by the built-in engine")
        return self

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


# ---- the tool-call rule ---------------------------------------------------------------------------


def tool_mode(req: ChatRequest, default_rounds: int) -> dict[str, object] | None:
    """The tools this turn must call one of, or None for a plain text turn.

    - no tools, or tool_choice "none": text;
    - tool_choice "required" or a named function: a tool call (to that function if named);
    - "auto" (the default with tools): a tool call while fewer than `rounds` assistant tool calls
      follow the last user message, then text. `rounds` is the request's `libra_tool_rounds` or
      the engine's --tool-rounds (default 1: call once, read the result, answer).
    """
    if not req.tools or req.tool_choice == "none":
        return None
    tools = {t.function.name: t.function.parameters or {} for t in req.tools}
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        if name not in tools:
            raise ConfigError("tool_choice.function.name", name, sorted(tools))
        return {name: tools[name]}
    if req.tool_choice == "required":
        return tools
    rounds = default_rounds if req.libra_tool_rounds is None else req.libra_tool_rounds
    return tools if calls_since_last_user(req.messages) < rounds else None


def calls_since_last_user(messages: list[Message]) -> int:
    n = 0
    for m in reversed(messages):
        if m.role == "user":
            break
        if m.role == "assistant" and m.tool_calls:
            n += 1
    return n


# ---- responses -------------------------------------------------------------------------------------


def token_text(token: int) -> tuple[str, list[int]]:
    if token < NUM_BYTES:
        return bytes((token,)).decode("utf-8", errors="replace"), [token]
    text = SPECIAL_TEXT.get(token, f"<|unused{token}|>")
    return text, list(text.encode())


def chat_logprob(lp: TokenLogprob) -> dict:
    text, raw = token_text(lp.token)
    top = []
    for tok, val in lp.top:
        t, b = token_text(tok)
        top.append({"token": t, "logprob": val, "bytes": b})
    return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


@dataclass(slots=True)
class ChoiceState:
    """Everything one sequence has produced so far (non-streaming responses and usage)."""

    index: int
    text: list[str] = field(default_factory=list)
    call: tuple[str, str] | None = None
    args: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, ev: SeqEvent) -> None:
        self.text.append(ev.text)
        self.call = self.call or ev.tool_call
        self.args.append(ev.tool_args)
        self.logprobs += ev.logprobs
        if ev.finish:
            self.finish, self.prompt_tokens, self.completion_tokens = (
                ev.finish,
                ev.prompt_tokens,
                ev.completion_tokens,
            )

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": "".join(self.text) if not self.call else None}
        if self.call:
            msg["tool_calls"] = [tool_call(self.call, "".join(self.args))]
        return msg


def tool_call(call: tuple[str, str], arguments: str, index: int | None = None) -> dict:
    out = {"id": call[0], "type": "function", "function": {"name": call[1], "arguments": arguments}}
    return out if index is None else {"index": index, **out}


def usage(choices: list[ChoiceState], prompt_tokens: int) -> dict:
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_body(rid: str, created: int, model: str, choices: list[ChoiceState], prompt_tokens: int, logprobs: bool) -> dict:  # fmt: skip
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": {"content": [chat_logprob(lp) for lp in c.logprobs]} if logprobs else None,
                "finish_reason": c.finish,
            }
            for c in choices
        ],
        "usage": usage(choices, prompt_tokens),
    }


def completion_logprobs(lps: list[TokenLogprob]) -> dict:
    tokens, offsets, offset = [], [], 0
    for lp in lps:
        text = token_text(lp.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t)[0]: v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceState], prompt_tokens: int, logprobs: bool) -> dict:  # fmt: skip
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs) if logprobs else None,
                "finish_reason": c.finish,
            }
            for c in choices
        ],
        "usage": usage(choices, prompt_tokens),
    }
