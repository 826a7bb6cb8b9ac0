"""Model presets and the engine's configuration.

Presets are a registry of named shapes (`tiny`, `small`) so that a command line, a test and a
checkpoint agree on a model by one short name. `EngineConfig` is validated when it is built, so a
bad value fails at start-up with one line naming the field, never mid-run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from libra.runtime.engine.tokenizer import VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_model_len: int
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.n_layers * self.d_model * dtype_bytes


# `tiny` is what CI and the gateway tests run: a few hundred thousand parameters, thousands of
# tokens per second on one CPU core. `small` is for eyeballing batching effects with more compute.
PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", n_layers=2, d_model=128, n_heads=4, d_ff=384, max_model_len=8192),
    "small": ModelPreset("small", n_layers=4, d_model=256, n_heads=8, d_ff=768, max_model_len=8192),
}


def _visible(v: str) -> str:
    if not v or len(v) > 256 or any(c.isspace() or not c.isprintable() for c in v):
        raise ValueError("1 to 256 visible characters (no spaces or control characters)")
    return v


Visible = Annotated[str, AfterValidator(_visible)]


class EngineConfig(BaseModel):
    """Everything `libra serve engine` can be told. Field names match the CLI options."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    model: str = "tiny"
    checkpoint: str | None = None
    # Both are shown in /health and /v1/models, and clients send the name back: visible characters
    # only, no spaces or control characters.
    name: Visible | None = None
    tp_label: Visible = "tp1"
    max_num_seqs: int = Field(64, ge=1, le=4096)
    max_tokens_default: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(512, ge=16, validate_default=True)
    prefill_chunk: int = Field(256, ge=16)
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_mb: int = Field(256, ge=1, validate_default=True)
    seed: int = 0
    threads: int = Field(1, ge=1, le=256)
    tool_rounds: int = Field(1, ge=0)
    max_body_mb: float = Field(8.0, gt=0, le=4096)
    # The weight version reported until a trainer sets another (SGLang's --weight-version).
    weight_version: Visible = "0"
    # When set, control calls (pause, weights, flush) need `Authorization: Bearer <admin_token>`.
    admin_token: Visible | None = None
    # When set, every step's composition and CPU seconds are appended to this JSONL file (the
    # serving profile of `libra costmodel profile --model builtin-M --device cpu`).
    step_log: str | None = None
    # vLLM's --logprobs-mode: what a token's reported log-probability is taken from. raw_logprobs
    # (vLLM's default): the model's distribution; processed_logprobs: after the request's
    # temperature, top_k, top_p and min_p, the distribution it was sampled from (what an RL
    # trainer needs; `distribution.processed_logprobs`). Neither includes the grammar.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError("one of: " + ", ".join(sorted(PRESETS)))
        return v

    @field_validator("max_num_batched_tokens")
    @classmethod
    def _every_running_seq_decodes(cls, v: int, info: ValidationInfo) -> int:
        # Every running sequence must be able to decode in every step, or the back of the batch
        # would starve behind the front.
        seqs = info.data.get("max_num_seqs", 1)
        if v < seqs:
            raise ValueError(f"at least max_num_seqs ({seqs})")
        return v

    @field_validator("kv_cache_mb")
    @classmethod
    def _holds_one_full_sequence(cls, v: int, info: ValidationInfo) -> int:
        # One block is the zero "null" block, and a sequence at max_model_len must fit, otherwise
        # preemption could never make room for it.
        preset, bs = PRESETS.get(info.data.get("model", "")), info.data.get("block_size")
        if preset is None or bs is None:
            return v
        need = (-(-preset.max_model_len // bs) + 1) * bs * preset.kv_bytes_per_token()
        if v * 2**20 < need:
            raise ValueError(f"at least {-(-need // 2**20)} MiB for model {preset.name!r}")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        if v > ram:  # the cache is allocated at start: more than the machine has would never start
            raise ValueError(f"at most this machine's memory ({ram} MiB)")
        return v

    @property
    def preset(self) -> ModelPreset:
        return PRESETS[self.model]

    @property
    def served_name(self) -> str:
        return self.name or self.model

    def blocks_per_seq(self) -> int:
        return -(-self.preset.max_model_len // self.block_size)

    def num_blocks(self) -> int:
        per_block = self.block_size * self.preset.kv_bytes_per_token()
        return self.kv_cache_mb * 2**20 // per_block
