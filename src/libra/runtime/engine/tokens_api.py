"""vLLM's token-in/token-out API, `POST /inference/v1/generate`, and the engine's status answers
for the frameworks that drive an engine directly (SGLang's `/server_info`, `/v1/loads`).

SkyRL's default generator and Tinker's `sample()` generate through `/inference/v1/generate`
(skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py, `_generate_single` and
`sample`). The shapes are vLLM's (vllm/entrypoints/serve/disagg/protocol.py):

    {"token_ids": [...], "sampling_params": {vLLM's SamplingParams: n, max_tokens, min_tokens,
     temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, logprobs,
     include_stop_str_in_output, skip_special_tokens, output_kind, ...}, "model"?, "request_id"?,
     "cache_salt"?, "priority"?}
    -> {"request_id", "choices": [{"index", "token_ids", "finish_reason",
        "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} | null}],
        "prompt_logprobs": null, "kv_transfer_params": null, "weight_version"}

The sampling options are the /v1/completions request's, checked by the same model, so an option
the engine does not implement is a 400 naming it (`sampling_params.<option>`) there as here.
vLLM's `max_tokens` default is 16; a stream is refused (SkyRL never streams this endpoint).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from libra.core.errors import ConfigError
from libra.runtime.engine import protocol as p

# vLLM's SamplingParams fields that change nothing here: how much of the output a vLLM server
# streams back (`output_kind`), detokenisation switches, and the scheduler's priority.
IGNORED_SAMPLING = frozenset({"output_kind", "detokenize", "spaces_between_special_tokens", "truncate_prompt_tokens"})  # fmt: skip
VLLM_MAX_TOKENS = 16


class TokensRequest(p._Model):
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict = Field(default_factory=dict)
    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool | None = False
    cache_salt: str | None = None
    priority: int = 0
    features: object = None

    @field_validator("token_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        return p.check_token_ids(v)

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("false: the built-in engine answers /inference/v1/generate whole")
        return v

    @field_validator("features")
    @classmethod
    def _no_features(cls, v: object) -> object:
        if v is not None:
            raise ValueError("absent: the built-in engine takes no multi-modal features")
        return v

    def completion(self, served: str) -> p.CompletionRequest:
        """The same request as /v1/completions takes it (one set of checks for both)."""
        sp = {k: v for k, v in self.sampling_params.items() if k not in IGNORED_SAMPLING}
        sp.setdefault("max_tokens", VLLM_MAX_TOKENS)
        for key in ("prompt", "model", "stream"):
            if key in sp:
                raise ConfigError(
                    f"sampling_params.{key}", p.clip(sp[key]), "absent (not a sampling parameter)"
                )
        return p.parse(p.CompletionRequest, {**sp, "prompt": self.token_ids, "model": self.model or served}, "sampling_params")  # fmt: skip


def tokens_body(rid: str, choices: list[p.ChoiceState], logprobs: bool, version: str) -> dict:
    return {
        "request_id": rid,
        "choices": [
            {
                "index": c.index,
                "token_ids": c.token_ids,
                "finish_reason": c.finish,
                "logprobs": p.chat_logprobs(c.logprobs, False) if logprobs else None,
            }
            for c in choices
        ],
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "weight_version": p.last_version(choices, version),
    }


class TokensFormat:
    """`_respond`'s formatter for /inference/v1/generate (whole answers only)."""

    def __init__(self, rid: str, logprobs: bool, version):
        self.rid, self.logprobs, self.version = rid, logprobs, version

    def body(self, states: list[p.ChoiceState]) -> dict:
        return tokens_body(self.rid, states, self.logprobs, self.version())


def loads(running: int, waiting: int, kv_usage: float) -> dict:
    """SGLang's `/v1/loads` for one data-parallel rank (slime counts requests from it while it
    aborts: slime/backends/sglang_utils/server_control.py, `num_requests_from_load`)."""
    one = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
           "num_total_reqs": running + waiting, "token_usage": kv_usage}  # fmt: skip
    return {"dp_rank_count": 1, "loads": [one], "aggregate": {k: v for k, v in one.items() if k != "dp_rank"}}
