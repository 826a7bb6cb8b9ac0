"""Rollout cost model: the time of one inference-engine iteration, and KV-cache capacity.

One iteration of a vLLM-style engine runs a batch that mixes prefill chunks and decode tokens on
an instance of TP degree t. Its time is the sum of:
- linear layers: the larger of reading this GPU's weights and doing its GEMM FLOPs (roofline);
- attention: the larger of reading the KV cache and the attention FLOPs, which grow with context;
- TP all-reduce: two per layer, latency plus ring bytes over the link;
- CPU overhead: a fixed part, a part that grows with t, and a part per running sequence.

The overheads are why small TP wins at short context: they do not shrink when t grows, while the
GPU work does. The simulator and the planner call `step_time` millions of times, so everything that
does not depend on the batch is folded into a few coefficients when the model is built.
"""

from __future__ import annotations

from libra.core.specs import GIB, HardwareSpec, ModelSpec
from libra.costmodel.efficiency import RolloutEfficiency


class RolloutCostModel:
    """Iteration time and memory for one engine instance (`tp` GPUs) of `model` on `hw`."""

    __slots__ = (
        "hw", "model", "tp", "eff", "_w_s", "_moe_w_s", "_lin_flop_s", "_kv_s", "_attn_flop_s",
        "_ar_fixed_s", "_ar_tok_s", "_fixed_s", "_seq_s", "_experts", "_k_over_e", "_expert_w_s",
        "gpu_memory_utilization", "max_num_batched_tokens",
    )  # fmt: skip

    def __init__(
        self,
        hw: HardwareSpec,
        model: ModelSpec,
        tp: int,
        eff: RolloutEfficiency | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
    ):
        self.hw, self.model, self.tp = hw, model, tp
        self.eff = eff = eff or RolloutEfficiency()
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_batched_tokens = max_num_batched_tokens
        bw = hw.memory_bw_gbps * 1e9 * eff.bw
        flops = hw.bf16_tflops * 1e12 * eff.compute
        m = model
        # Seconds per unit: weight bytes read per step, FLOPs per token, KV bytes per context token.
        dense_w = m.weight_bytes - m.embedding_params * m.bytes_per_param * (0 if m.tied_embeddings else 1)
        if m.is_moe:
            dense_w -= m.layers * m.experts * m.expert_params * m.bytes_per_param
        self._w_s = dense_w / tp / bw
        self._experts = m.experts
        self._k_over_e = (m.active_experts / m.experts) if m.is_moe else 0.0
        self._expert_w_s = m.layers * m.expert_params * m.bytes_per_param / tp / bw
        self._lin_flop_s = 2 * m.active_matmul_params / tp / flops
        self._kv_s = m.kv_bytes_per_token_per_gpu(tp) / bw
        # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per head dim, per attended token.
        self._attn_flop_s = 4 * m.layers * m.heads * m.head_dim / tp / flops
        nvlink = hw.intra_node_link == "nvlink"
        link = hw.intra_node_bw_gbps * 1e9 * (eff.link if nvlink else eff.pcie_link)
        latency = eff.allreduce_latency_s if nvlink else eff.pcie_allreduce_latency_s
        n_ar = 2 * m.layers
        self._ar_fixed_s = 0.0 if tp == 1 else n_ar * latency
        ring = 2 * (tp - 1) / tp
        self._ar_tok_s = 0.0 if tp == 1 else n_ar * ring * m.hidden * m.bytes_per_param / link
        self._fixed_s = eff.base_overhead_s + eff.tp_overhead_s * (tp - 1)
        self._seq_s = eff.per_seq_overhead_s

    def step_time(
        self, prefill_tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: float
    ) -> float:
        """Seconds for one iteration.

        prefill_tokens: tokens prefilled this step (all chunks together).
        prefill_attn: sum over those tokens of the context each attends to (for a chunk of c tokens
            starting at position p, c*p + c*(c+1)/2).
        decode_seqs, decode_ctx: decoding sequences and the sum of their context lengths.
        """
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        w = self._w_s
        if self._experts:
            touched = self._experts * (1.0 - (1.0 - self._k_over_e) ** tokens)
            w += self._expert_w_s * touched
        lin = self._lin_flop_s * tokens
        linear = w if w > lin else lin
        kv = self._kv_s * (decode_ctx + prefill_tokens)
        af = self._attn_flop_s * (decode_ctx + prefill_attn)
        attn = kv if kv > af else af
        comm = self._ar_fixed_s + self._ar_tok_s * tokens
        seqs = decode_seqs + (1 if prefill_tokens else 0)
        return linear + attn + comm + self._fixed_s + self._seq_s * seqs

    def decode_coeffs(self, n: int) -> tuple[float, float]:
        """(A, B) with decode-only step time = A + B * ctx_sum for `n` sequences, exactly.

        With no prefill both attention terms are proportional to the context sum, so their
        roofline is too; everything else depends on n only. The simulator uses this to advance
        many identical-composition decode steps in closed form.
        """
        if n <= 0:
            return 0.0, 0.0
        w = self._w_s
        if self._experts:
            w += self._expert_w_s * self._experts * (1.0 - (1.0 - self._k_over_e) ** n)
        lin = self._lin_flop_s * n
        a = (w if w > lin else lin) + self._ar_fixed_s + self._ar_tok_s * n + self._fixed_s + self._seq_s * n
        b = self._kv_s if self._kv_s > self._attn_flop_s else self._attn_flop_s
        return a, b

    def decode_time(self, batch: int, context: float) -> float:
        """One decode iteration of `batch` sequences, each at `context` tokens."""
        return self.step_time(0, 0.0, batch, batch * context)

    # ---- memory -------------------------------------------------------------------------------

    def activation_bytes(self) -> float:
        """Peak activation of vLLM's profiling run at max_num_batched_tokens, per GPU.

        The MLP's gate and up projections dominate: tokens x 2 x intermediate / t at bf16, plus
        a few hidden-sized buffers, plus the sampler's fp32 logits for up to 256 sequences.
        """
        m = self.model
        width = m.expert_intermediate * m.active_experts if m.is_moe else m.intermediate
        per_tok = (2 * width / self.tp + 4 * m.hidden) * m.bytes_per_param
        logits = 256 * m.vocab * 4 / self.tp
        return self.max_num_batched_tokens * per_tok + logits

    def kv_budget_bytes(self) -> float:
        usable = self.hw.memory_bytes * self.gpu_memory_utilization
        return (
            usable
            - self.model.weight_bytes / self.tp
            - self.eff.fixed_workspace_gib * GIB
            - self.activation_bytes()
        )

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds on this instance (0 when the weights do not fit)."""
        return max(0, int(self.kv_budget_bytes() / self.model.kv_bytes_per_token_per_gpu(self.tp)))

    def fits(self) -> bool:
        return self.kv_capacity_tokens() > 0

    def max_batch(self, context: int, requested: int) -> int:
        """How many sequences of `context` tokens run at once: the request, capped by KV capacity."""
        return max(0, min(requested, self.kv_capacity_tokens() // max(1, context)))

    def throughput(self, batch: int, context: int) -> float:
        """Steady decode tokens/s with `batch` sequences at `context`, capped by KV capacity."""
        b = self.max_batch(context, batch)
        return b / self.decode_time(b, context) if b else 0.0

    def kv_transfer_time(self, tokens: int, inter_node: bool) -> float:
        """Seconds to move `tokens` of KV between instances (resharded by head for the target TP)."""
        bw = (self.hw.inter_node_bw_gbps if inter_node else self.hw.intra_node_bw_gbps) * 1e9 * self.eff.link
        # Each of the t target GPUs receives its heads; sources send in parallel over t links.
        return tokens * self.model.kv_bytes_per_token / (bw * self.tp) + 2e-3

    def prefill_time(self, tokens: int, chunk: int | None = None) -> float:
        """Seconds to prefill `tokens` from scratch in chunks of max_num_batched_tokens."""
        chunk = chunk or self.max_num_batched_tokens
        t, done = 0.0, 0
        while done < tokens:
            c = min(chunk, tokens - done)
            t += self.step_time(c, c * done + c * (c + 1) / 2, 0, 0.0)
            done += c
        return t
