"""The OpenAI wire format: request models (validated) and response bodies (built from events).

Requests are pydantic models, so a bad field becomes one `ConfigError` naming the field, the
value (clipped: a 700 KB request never comes back in its own error) and what is allowed, which the
server returns as a 400 in OpenAI's error shape. Unknown fields are ignored, as OpenAI-compatible
servers do, but a known option the engine cannot honour (penalties, `echo`, `best_of`, a
`response_format` other than text) is refused with a 400 naming it rather than silently dropped.

vLLM's extensions that RL trainers use are honoured: `return_token_ids` (the prompt's and each
choice's token ids), `return_tokens_as_token_ids` (logprob tokens written `token_id:N`), token-id
prompts on /v1/completions, `top_k`, `min_p`, `logit_bias`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `ignore_eos` and `min_tokens` (no end token,
stop token or stop string before that many tokens; SkyRL sends 1 by default). Every response also carries
the `weight_version` that produced it (SGLang's name), and the version of each token when a
request spanned a weight update.

Also here: the rule that decides whether a chat turn is a tool call (see `tool_mode`), and the
accumulators that turn a sequence's events into a `choices[i]` entry.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from libra.core.errors import ConfigError
from libra.runtime.engine.codec import BYTES, Codec
from libra.runtime.engine.sequence import SamplingParams, SeqEvent, TextOutput, TokenLogprob
from libra.runtime.engine.tokenizer import ChatMessage, ToolCallText

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_ECHO = 60  # characters of a bad value an error repeats
# The codec of the engine serving the request being handled: its vocabulary bounds token ids, and
# it writes logprob tokens and texts. The server sets it for each request's task (a ContextVar, so
# engines of different models in one process never see each other's); the default is the built-in.
CODEC: ContextVar[Codec] = ContextVar("libra_engine_codec", default=BYTES)


def token_ids_rule() -> str:
    return f"token ids from 0 to {CODEC.get().vocab_size - 1}"


M = TypeVar("M", bound=BaseModel)


class _Clipped(str):
    """A value's repr cut to MAX_ECHO characters, shown as is inside an error message."""

    def __repr__(self) -> str:
        return str(self)


def clip(value: object) -> object:
    text = repr(value)
    if len(text) <= MAX_ECHO:
        return value
    return _Clipped(f"{text[:MAX_ECHO]}... ({len(text)} characters)")


def parse(model: type[M], data: dict, prefix: str = "") -> M:
    """Validate a request body; the first problem becomes a ConfigError naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e.get("loc", ()))
        where = f"{prefix}.{loc}" if prefix and loc else (loc or prefix or "body")
        raise ConfigError(
            where, clip(e.get("input")), e.get("msg", "invalid").removeprefix("Value error, ")
        ) from None


def check_token_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError(f"a non-empty list of {token_ids_rule()}")
    if min(ids) < 0 or max(ids) >= CODEC.get().vocab_size:
        raise ValueError(token_ids_rule())
    return ids


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


# Options the engine does not implement, with the values that mean "off": anything else is a 400
# naming the option (never silently dropped).
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
}


def refuse_unless_neutral(v: object, info: ValidationInfo, neutral: dict[str, tuple]) -> object:
    """A field validator's check for an option the engine does not implement: only the values
    that mean "off" pass; anything else is refused naming the option."""
    if v not in neutral[info.field_name]:
        allowed = " or ".join("absent" if x is None else repr(x) for x in neutral[info.field_name])
        raise ValueError(f"{allowed}: the built-in engine does not implement {info.field_name}")
    return v


class SamplingRequest(_Model):
    """Fields shared by chat and completions requests."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # vLLM's extension: never sample the end token, so text runs to max_tokens or a stop string.
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    response_format: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    structured_outputs: object = None

    @field_validator(*NEUTRAL)
    @classmethod
    def _refused(cls, v: object, info: ValidationInfo) -> object:
        return refuse_unless_neutral(v, info, NEUTRAL)

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, v: int | None, info: ValidationInfo) -> int | None:
        most = info.data.get("max_tokens")
        if v and most is not None and v > most:
            raise ValueError(f"at most max_tokens ({most})")
        return v

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        return check_token_ids(v) if v else v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or int(key) >= CODEC.get().vocab_size or not -100 <= bias <= 100:
                raise ValueError(f"a mapping of {token_ids_rule()} (as strings) to biases from -100 to 100")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "text":
            raise ValueError('absent or {"type": "text"}: the built-in engine has no JSON mode')
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v > CODEC.get().vocab_size:
            raise ValueError(f"at most the vocabulary size ({CODEC.get().vocab_size}); 0 or -1: off")
        return v

    def params(self, max_tokens: int, seed: int, logprobs: bool, top: int) -> SamplingParams:
        bias = tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())
        return SamplingParams(max_tokens, self.temperature, self.top_p, self.stops(), seed, logprobs, top,
                              max(0, self.top_k), self.min_p, bias)  # fmt: skip

    def text_output(self) -> TextOutput:
        return TextOutput(self.stops(), self.ignore_eos, frozenset(self.stop_token_ids or ()),
                          self.include_stop_str_in_output, not self.skip_special_tokens, self.min_tokens or 0,
                          codec=CODEC.get())  # fmt: skip


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
    # Text, a batch of texts, token ids (vLLM) or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _ids_in_range(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], int):
            return check_token_ids(v)
        if isinstance(v, list) and v and isinstance(v[0], list):
            return [check_token_ids(ids) for ids in v]
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TokenizeRequest(_Model):
    """vLLM's /tokenize: a `prompt`, or chat `messages` (and `tools`) rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        return check_token_ids(v) if v else v


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
            raise ConfigError("tool_choice.function.name", clip(name), sorted(tools))
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


@dataclass(frozen=True, slots=True)
class ReplyOptions:
    """What a response carries beyond the text: logprobs, token ids, logprob tokens as ids."""

    logprobs: bool = False
    token_ids: bool = False
    as_ids: bool = False


def token_text(token: int, as_ids: bool = False) -> tuple[str, list[int]]:
    """A token as logprobs show it: its text and its bytes (a special token by its name)."""
    if as_ids:  # vLLM's return_tokens_as_token_ids: unambiguous even for partial UTF-8 bytes
        return f"token_id:{token}", list(f"token_id:{token}".encode())
    codec = CODEC.get()
    if not codec.is_special(token):
        raw = codec.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = codec.label(token)
    return text, list(text.encode())


def chat_logprob(lp: TokenLogprob, as_ids: bool = False) -> dict:
    text, raw = token_text(lp.token, as_ids)
    top = []
    for tok, val in lp.top:
        t, b = token_text(tok, as_ids)
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
    token_ids: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw: str | None = None

    def add(self, ev: SeqEvent) -> None:
        self.raw = ev.raw or self.raw
        self.text.append(ev.text)
        self.call = self.call or ev.tool_call
        self.args.append(ev.tool_args)
        self.logprobs += ev.logprobs
        self.token_ids += ev.token_ids
        self.versions += ev.versions
        if ev.finish:
            self.finish, self.matched = ev.finish, ev.matched
            self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens

    def message(self) -> dict:
        text = "".join(self.text)
        msg: dict = {"role": "assistant", "content": (text or None) if self.call else text}
        if self.call:
            msg["tool_calls"] = [tool_call(self.call, "".join(self.args))]
        if self.raw is not None:  # Libra's: a Hermes call's text as the model wrote it
            msg["raw_content"] = self.raw
        return msg

    def ids_fields(self, opts: ReplyOptions) -> dict:
        """`token_ids` (and each token's weight version when they differ), as asked."""
        if not opts.token_ids:
            return {}
        out: dict = {"token_ids": self.token_ids}
        if len(set(self.versions)) > 1:
            out["token_weight_versions"] = self.versions
        return out


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


def last_version(choices: list[ChoiceState], current: str) -> str:
    """The weight version a response reports: that of its newest tokens (the engine's current one
    if any choice ended on it), or the engine's when it generated nothing."""
    last = [c.versions[-1] for c in choices if c.versions]
    return current if not last or current in last else last[-1]


def chat_logprobs(lps: list[TokenLogprob], as_ids: bool) -> dict:
    return {"content": [chat_logprob(lp, as_ids) for lp in lps]}


def completion_logprobs(lps: list[TokenLogprob], as_ids: bool = False) -> dict:
    tokens, offsets, offset = [], [], 0
    for lp in lps:
        text = token_text(lp.token, as_ids)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t, as_ids)[0]: v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_body(rid: str, created: int, model: str, choices: list[ChoiceState], prompt: list[int], opts: ReplyOptions, version: str) -> dict:  # fmt: skip
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": chat_logprobs(c.logprobs, opts.as_ids) if opts.logprobs else None,
                "finish_reason": c.finish,
                **c.ids_fields(opts),
            }
            for c in choices
        ],
        "usage": usage(choices, len(prompt)),
        "weight_version": version,
    }
    if opts.token_ids:
        body["prompt_token_ids"] = prompt
    return body


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceState], prompts: list[list[int]], opts: ReplyOptions, version: str) -> dict:  # fmt: skip
    """`prompts[i]` is the prompt of choice i. With `return_token_ids`, each choice carries its
    prompt's ids (vLLM), and a single-prompt request also carries them at the top level."""
    per = len(choices) // len(prompts)
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs, opts.as_ids) if opts.logprobs else None,
                "finish_reason": c.finish,
                **({"prompt_token_ids": prompts[c.index // per]} if opts.token_ids else {}),
                **c.ids_fields(opts),
            }
            for c in choices
        ],
        "usage": usage(choices, sum(len(p) for p in prompts)),
        "weight_version": version,
    }
    if opts.token_ids and len(prompts) == 1:
        body["prompt_token_ids"] = prompts[0]
    return body
