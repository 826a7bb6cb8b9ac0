"""SGLang's native generation API, `POST /generate`: token ids in, token ids and logprobs out.

slime, AReaL and SkyRL's SGLang backend drive rollouts through this endpoint rather than the
OpenAI routes, because it takes `input_ids` and answers with `output_ids` and per-token logprobs
in `meta_info`, so nothing is re-tokenised between the engine and the trainer. The request and
response shapes are SGLang's:

    {"input_ids": [...] | "text": "...", "sampling_params": {"max_new_tokens", "temperature",
     "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
     "no_stop_trim", "sampling_seed", "logit_bias", ...}, "return_logprob": true,
     "top_logprobs_num": 0, "return_text_in_logprobs": false, "stream": false, "rid": "..."}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|
        "abort", ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
        "e2e_latency", "output_token_logprobs": [[logprob, token_id, text|null], ...]}}

A batch (`text` or `input_ids` as a list of prompts) answers with a list. A stream sends SGLang's
cumulative chunks (each holds everything so far) and ends with `data: [DONE]`. Sampling options
are checked strictly, as SGLang's `SamplingParams(**sampling_params)` is: an unknown or
unimplemented one is a 400 naming it.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from libra.core.errors import ConfigError
from libra.runtime.engine.protocol import (
    CODEC,
    ChoiceState,
    SamplingRequest,
    check_token_ids,
    clip,
    last_version,
    parse,
    refuse_unless_neutral,
    token_text,
)
from libra.runtime.engine.sequence import FinishReason, SamplingParams, TextOutput

# SGLang's default when a request gives no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128

# Accepted with these values only: the built-in engine does not implement them otherwise.
NEUTRAL_SAMPLING: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "n": (1,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
}
NEUTRAL_REQUEST: dict[str, tuple] = {
    "logprob_start_len": (-1, None),
    "return_hidden_states": (False, None),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "lora_path": (None,),
    "session_params": (None,),
    "custom_logit_processor": (None,),
}


class GenerateSampling(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect: byte tokens carry their own spaces
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang passes these to a custom logit processor; without one (there is none here) they do
    # nothing there either, so they are accepted (slime sends return_top_p_token_ids).
    custom_params: dict | None = None
    stream_interval: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = Field(0, ge=0)
    n: int = 1
    json_schema: object = None
    regex: object = None
    ebnf: object = None
    structural_tag: object = None

    @field_validator(*NEUTRAL_SAMPLING)
    @classmethod
    def _refused(cls, v: object, info: ValidationInfo) -> object:
        return refuse_unless_neutral(v, info, NEUTRAL_SAMPLING)

    def as_openai(self) -> SamplingRequest:
        """The same options in the OpenAI request's vocabulary (one set of checks for both)."""
        data = {
            "model": "", "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "logit_bias": self.logit_bias, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "include_stop_str_in_output": self.no_stop_trim,
            "skip_special_tokens": self.skip_special_tokens, "ignore_eos": self.ignore_eos,
            "seed": self.sampling_seed, "min_tokens": self.min_new_tokens, "max_tokens": self.max_new_tokens,
        }  # fmt: skip
        return parse(SamplingRequest, data, "sampling_params")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = Field(None, min_length=1, max_length=256)
    logprob_start_len: int | None = -1
    return_hidden_states: bool | None = False
    image_data: object = None
    video_data: object = None
    audio_data: object = None
    lora_path: object = None
    session_params: object = None
    custom_logit_processor: object = None

    @field_validator(*NEUTRAL_REQUEST)
    @classmethod
    def _refused(cls, v: object, info: ValidationInfo) -> object:
        return refuse_unless_neutral(v, info, NEUTRAL_REQUEST)

    @field_validator("input_ids")
    @classmethod
    def _ids_in_range(cls, v):
        if v and isinstance(v[0], list):
            return [check_token_ids(ids) for ids in v]
        return check_token_ids(v) if v is not None else v

    @field_validator("text")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("a string or a non-empty list of strings")
        return v

    @property
    def batched(self) -> bool:
        src = self.input_ids if self.input_ids is not None else self.text
        return isinstance(src, list) and bool(src) and not isinstance(src[0], int)

    def prompts(self) -> list[list[int]]:
        """Token ids of every prompt: input_ids as given; text after the BOS token (as a
        completions prompt is rendered)."""
        if (self.text is None) == (self.input_ids is None):
            raise ConfigError("text", clip(self.text), "exactly one of text and input_ids")
        if self.input_ids is not None:
            return [list(p) for p in self.input_ids] if self.batched else [list(self.input_ids)]
        texts = self.text if isinstance(self.text, list) else [self.text]
        return [CODEC.get().prompt(t) for t in texts]

    def params(self, seed: int) -> SamplingParams:
        sp = self.sampling_params
        req = sp.as_openai()
        return req.params(sp.max_new_tokens, seed, self.return_logprob, self.top_logprobs_num)

    def text_output(self) -> TextOutput:
        return self.sampling_params.as_openai().text_output()


class GenerateFormat:
    """Bodies and stream chunks of /generate, in SGLang's shape."""

    def __init__(self, rid: str, req: GenerateRequest, prompts: list[list[int]], version):
        self.rid, self.req, self.prompts, self.version = rid, req, prompts, version
        self.started = time.monotonic()
        self.batched = req.batched

    def item(self, state: ChoiceState) -> dict:
        meta = {
            "id": self.rid if not self.batched else f"{self.rid}-{state.index}",
            "finish_reason": finish_reason(state),
            "prompt_tokens": len(self.prompts[state.index]),
            "completion_tokens": len(state.token_ids),
            "cached_tokens": 0,
            "weight_version": last_version([state], self.version()),
            "e2e_latency": round(time.monotonic() - self.started, 6),
        }
        if self.req.return_logprob:
            as_text = self.req.return_text_in_logprobs
            meta["output_token_logprobs"] = [_entry(lp.logprob, lp.token, as_text) for lp in state.logprobs]
            if self.req.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [_entry(v, t, as_text) for t, v in lp.top] for lp in state.logprobs
                ]
        if len(set(state.versions)) > 1:
            meta["output_token_weight_versions"] = state.versions
        out = {"text": "".join(state.text), "output_ids": state.token_ids, "meta_info": meta}
        return {**out, "index": state.index} if self.batched else out

    def body(self, states: list[ChoiceState]) -> dict | list:
        items = [self.item(s) for s in states]
        return items if self.batched else items[0]


def finish_reason(state: ChoiceState) -> dict | None:
    if state.finish is None:
        return None
    if state.finish == FinishReason.LENGTH:
        return {"type": "length", "length": len(state.token_ids)}
    if state.finish == FinishReason.ABORT:
        return {"type": "abort", "message": state.matched if isinstance(state.matched, str) else "aborted"}
    return {"type": "stop", "matched": state.matched}


def _entry(logprob: float, token: int, as_text: bool) -> list:
    return [logprob, token, token_text(token)[0] if as_text else None]
