"""Model shapes: the built-in presets, and the shape of any model the engine serves.

Presets are a registry of named shapes (`tiny`, `small`) so that a command line, a test and a
checkpoint agree on a model by one short name. A Hugging Face or GGUF checkpoint gets a
`ModelPreset` too, read from its own config (`sources`), so the KV cache, the context check and
the trainer's memory model size every model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    kv_heads: int | None = None  # grouped-query attention; None: one KV head per query head
    head_size: int | None = None  # None: d_model // n_heads
    arch: str = "builtin"  # builtin, or the checkpoint's model_type (llama, mistral, qwen2, qwen3)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def with_context(self, max_model_len: int) -> ModelPreset:
        return replace(self, max_model_len=max_model_len)


# `tiny` is what CI and the gateway tests run: a few hundred thousand parameters, thousands of
# tokens per second on one CPU core. `tiny8` is `libra train`'s default model: `tiny` with 8 heads
# of 16 dimensions instead of 4 of 32 (the same weights' shapes, so the same parameters and KV
# bytes); with 4 heads, one seed of ten never formed the circuit that copies the first digit of
# the tool's result into the answer (docs/train.md). A separate name, not a changed `tiny`: a
# checkpoint of either loads into the other without a shape error, and would compute garbage.
# `small` is for eyeballing batching effects with more compute.
PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", n_layers=2, d_model=128, n_heads=4, d_ff=384, max_model_len=8192),
    "tiny8": ModelPreset("tiny8", n_layers=2, d_model=128, n_heads=8, d_ff=384, max_model_len=8192),
    "small": ModelPreset("small", n_layers=4, d_model=256, n_heads=8, d_ff=768, max_model_len=8192),
}
