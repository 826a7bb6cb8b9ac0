"""The engine's configuration.

`EngineConfig` is validated when it is built, so a bad value fails at start-up with one line naming
the field, never mid-run. Its `model` is a preset, a packaged model, a Hugging Face directory or a
GGUF file (`sources.resolve`), whose shape sizes the KV cache.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from libra.core.errors import ConfigError
from libra.runtime.engine.presets import PRESETS, ModelPreset
from libra.runtime.engine.sources import ModelSource, resolve
from libra.runtime.http_limits import HttpLimitFields, RequestCapFields

__all__ = ["PRESETS", "EngineConfig", "ModelPreset"]


def _visible(v: str) -> str:
    if not v or len(v) > 256 or any(c.isspace() or not c.isprintable() for c in v):
        raise ValueError("1 to 256 visible characters (no spaces or control characters)")
    return v


Visible = Annotated[str, AfterValidator(_visible)]


class EngineConfig(HttpLimitFields, RequestCapFields):
    """Everything `libra serve engine` can be told. Field names match the CLI options (the
    connection limits and request caps are `http_limits`' fields, shared with the gateway)."""

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
    # A real checkpoint's context is often longer than a CPU's KV cache holds: this caps it.
    max_model_len: int | None = Field(None, ge=16)
    # One code path for both: the model, the KV cache and the step's tensors live on `device`.
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    _source: ModelSource = PrivateAttr()

    @field_validator("max_num_batched_tokens")
    @classmethod
    def _every_running_seq_decodes(cls, v: int, info: ValidationInfo) -> int:
        # Every running sequence must be able to decode in every step, or the back of the batch
        # would starve behind the front.
        seqs = info.data.get("max_num_seqs", 1)
        if v < seqs:
            raise ValueError(f"at least max_num_seqs ({seqs})")
        return v

    @model_validator(mode="after")
    def _resolve_and_fit(self) -> EngineConfig:
        # The model's shape comes from its checkpoint (or preset); one block is the zero "null"
        # block, and a sequence at max_model_len must fit, otherwise preemption could never make
        # room for it.
        self._source = resolve(self.model, self.max_model_len)
        spec = self._source.spec
        need = (-(-spec.max_model_len // self.block_size) + 1) * self.block_size * spec.kv_bytes_per_token(self.dtype_bytes)  # fmt: skip
        if self.kv_cache_mb * 2**20 < need:
            more = (
                ""
                if self._source.builtin
                else f" at a context of {spec.max_model_len} tokens (or a smaller max_model_len)"
            )
            raise ConfigError("kv_cache_mb", self.kv_cache_mb, f"at least {-(-need // 2**20)} MiB for model {self.model!r}{more}")  # fmt: skip
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        if (
            self.kv_cache_mb > ram
        ):  # the cache is allocated at start: more than the machine has would never start
            raise ConfigError("kv_cache_mb", self.kv_cache_mb, f"at most this machine's memory ({ram} MiB)")
        return self

    @property
    def source(self) -> ModelSource:
        return self._source

    @property
    def preset(self) -> ModelPreset:
        return self._source.spec

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.torch_dtype == "bfloat16" else 4

    @property
    def torch_dtype(self) -> str:
        """The weights' and KV cache's dtype: float32 on CPU, bfloat16 on CUDA unless told."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def served_name(self) -> str:
        return self.name or (self.model if self._source.kind != "hf" else self._source.path.name)

    def blocks_per_seq(self) -> int:
        return -(-self.preset.max_model_len // self.block_size)

    def num_blocks(self) -> int:
        per_block = self.block_size * self.preset.kv_bytes_per_token(self.dtype_bytes)
        return self.kv_cache_mb * 2**20 // per_block
