"""Hardware and model specifications.

These are the facts the cost model reasons from: memory sizes and bandwidths of GPUs, and the
architecture of transformer models as their public configs give them. Derived quantities
(parameter counts, KV bytes per token) are computed here once so every caller agrees on them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1024**3


class HardwareSpec(BaseModel):
    """One GPU type, as its spec sheet gives it. Bandwidths are unidirectional, per GPU, in GB/s."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    name: str
    memory_gib: float = Field(gt=0, description="HBM capacity per GPU, GiB")
    memory_bw_gbps: float = Field(gt=0, description="HBM bandwidth, GB/s (1e9 bytes/s)")
    bf16_tflops: float = Field(gt=0, description="Dense bf16 tensor-core peak, TFLOP/s")
    intra_node_bw_gbps: float = Field(gt=0, description="GPU-to-GPU link in a node, per direction")
    intra_node_link: str = Field(pattern="^(nvlink|pcie)$")
    inter_node_bw_gbps: float = Field(gt=0, description="Network bandwidth per GPU across nodes")
    gpus_per_node: int = Field(gt=0, le=64)
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


class ModelSpec(BaseModel):
    """A decoder-only transformer, dense or mixture-of-experts, from its public config."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    name: str
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate: int = Field(gt=0, description="Dense MLP width (shared/dense layers)")
    vocab: int = Field(gt=0)
    tied_embeddings: bool = False
    experts: int = Field(default=0, ge=0)
    active_experts: int = Field(default=0, ge=0)
    expert_intermediate: int = Field(default=0, ge=0)
    bytes_per_param: int = Field(default=2, gt=0, description="2 for bf16 weights")
    source: str = ""

    @model_validator(mode="after")
    def _check_moe(self) -> ModelSpec:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.experts and not (0 < self.active_experts <= self.experts and self.expert_intermediate):
            raise ValueError("an MoE model needs 0 < active_experts <= experts and expert_intermediate > 0")
        return self

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attn_params_per_layer(self) -> int:
        q_out = self.heads * self.head_dim
        kv_out = 2 * self.kv_heads * self.head_dim
        return self.hidden * (q_out + kv_out) + q_out * self.hidden

    @property
    def expert_params(self) -> int:
        """Parameters of one expert's MLP (gate, up, down)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def mlp_params_per_layer(self) -> int:
        if self.is_moe:
            return self.experts * self.expert_params + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied_embeddings else self.lm_head_params
        return (
            self.layers * (self.attn_params_per_layer + self.mlp_params_per_layer)
            + self.embedding_params
            + head
        )

    @property
    def active_matmul_params(self) -> int:
        """Parameters a token multiplies through: attention, active experts, and the LM head.

        The input embedding is a row lookup, not a matmul, so it is left out.
        """
        if self.is_moe:
            mlp = self.active_experts * self.expert_params + self.hidden * self.experts
        else:
            mlp = self.mlp_params_per_layer
        return self.layers * (self.attn_params_per_layer + mlp) + self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, at the weight dtype (vLLM's kv_cache_dtype=auto)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads are split over TP ranks, and replicated when TP exceeds their number."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        return 2 * self.layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.bytes_per_param
