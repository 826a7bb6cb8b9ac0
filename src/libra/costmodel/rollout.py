"""Rollout cost model: the time of one inference-engine iteration, and KV-cache capacity.

One iteration of a vLLM-style engine runs a batch that mixes prefill chunks and decode tokens on
an instance of TP degree t (and, for a mixture-of-experts model served with expert parallelism,
EP degree e). Its time is the sum of:
- linear layers, per layer: the smooth roofline of reading this GPU's weights and doing its GEMM
  FLOPs, plus a per-layer time that does not shrink with TP (GEMM tails, norms, activation, rope),
  plus norms and residual adds over the full hidden state; the LM head for the sampled tokens;
- attention: its fixed per-layer cost plus the larger of reading the KV cache and the attention
  FLOPs, which grow with context;
- TP all-reduce, two per layer, by backend (the engine's own kernel for small messages on NVLink,
  NCCL otherwise), latency plus ring bytes; with EP, the experts' all-gather and reduce-scatter;
- CPU overhead of the engine generation: per step, per extra TP worker, per running sequence.

The GPU terms are fitted to measured kernels per GPU type and the CPU terms are engine presets
(`libra.costmodel.efficiency`). The overheads are why small TP wins at short context: they do not
shrink when t grows, while the GPU work does. The simulator and the planner call `step_time`
millions of times, so everything that does not depend on the batch is folded into a few
coefficients when the model is built.
"""

from __future__ import annotations

import math

from libra.core.specs import GIB, HardwareSpec, ModelSpec
from libra.costmodel.efficiency import DEFAULT_ENGINE, AllReduceTerms, RolloutEfficiency

KV_BLOCK = 16  # vLLM's default block size: the KV cache is handed out in blocks of 16 tokens


def roofline(a: float, b: float, p: float) -> float:
    """Smooth maximum of a memory time and a compute time: (a^p + b^p)^(1/p)."""
    if p == 2.0:
        return math.sqrt(a * a + b * b)
    return (a**p + b**p) ** (1.0 / p)


class RolloutCostModel:
    """Iteration time and memory for one engine instance (`tp` GPUs) of `model` on `hw`."""

    __slots__ = (
        "hw", "model", "tp", "ep", "eff", "gpu", "overhead", "engine", "gpu_memory_utilization",
        "max_num_batched_tokens", "max_num_seqs", "_lw_s", "_lf_s", "_ew_s", "_ef_s", "_local_experts",
        "_k", "_k_over_e", "_p", "_layer_s", "_norm_s", "_hw_s", "_hf_s", "_kv_s", "_attn_flop_s",
        "_fixed_s", "_seq_s", "_ar", "_ar_custom", "_ar_ep", "_ar_bytes", "_lin_cache", "_comm_cache", "_layers", "_attn_fixed_s",
    )  # fmt: skip

    def __init__(
        self,
        hw: HardwareSpec,
        model: ModelSpec,
        tp: int,
        eff: RolloutEfficiency | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        engine: str = DEFAULT_ENGINE,
        max_num_seqs: int = 256,
        ep: int = 1,
    ):
        self.hw, self.model, self.tp, self.ep, self.engine = hw, model, tp, ep if model.is_moe else 1, engine
        self.eff = eff = eff or RolloutEfficiency()
        self.gpu, self.overhead = eff.gpu(hw.name), eff.engine(engine)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self._lin_cache: dict[int, float] = {}
        self._comm_cache: dict[int, float] = {}
        self._linear_terms()
        self._attention_terms()
        self._comm_terms()
        o = self.overhead
        self._fixed_s = o.base_overhead_s + o.tp_overhead_s * (tp - 1)
        self._seq_s = o.per_seq_overhead_s + o.tp_seq_overhead_s * (tp - 1)

    # ---- folding the constants ------------------------------------------------------------------

    def _rates(self) -> tuple[float, float]:
        return self.hw.memory_bw_gbps * 1e9 * self.gpu.bw, self.hw.bf16_tflops * 1e12 * self.gpu.compute

    def _linear_terms(self) -> None:
        m, g, tp, bpp = self.model, self.gpu, self.tp, self.model.bytes_per_param
        bw, flops = self._rates()
        dense = m.attn_params_per_layer + (m.hidden * m.experts if m.is_moe else m.mlp_params_per_layer)
        self._layers = m.layers
        self._lw_s, self._lf_s = dense * bpp / tp / bw, 2 * dense / tp / flops
        self._ew_s, self._ef_s = m.expert_params * bpp / tp / bw, 2 * m.expert_params / tp / flops
        self._local_experts = m.experts / self.ep
        self._k, self._k_over_e = m.active_experts, (m.active_experts / m.experts if m.is_moe else 0.0)
        self._p, self._norm_s = g.roofline_p, g.norm_s * m.hidden
        self._layer_s = g.layer_fixed_s * self.overhead.layer_kernel_fraction
        self._attn_fixed_s = m.layers * g.attn_fixed_s
        self._hw_s, self._hf_s = m.lm_head_params * bpp / tp / bw, 2 * m.lm_head_params / tp / flops

    def _attention_terms(self) -> None:
        m = self.model
        bw, flops = self._rates()
        self._kv_s = m.kv_bytes_per_token_per_gpu(self.tp) / bw
        # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per head dim, per attended token.
        self._attn_flop_s = 4 * m.layers * m.heads * m.head_dim / self.tp / flops

    def _comm_terms(self) -> None:
        g, o, nvlink = self.gpu, self.overhead, self.hw.intra_node_link == "nvlink"
        self._ar = self._ar_custom = self._ar_ep = None
        self._ar_bytes = self.model.hidden * self.model.bytes_per_param
        if self.tp > 1:
            self._ar = g.allreduce("nccl", self.tp) if nvlink else None
            if nvlink and o.custom_allreduce and self.tp <= 8:
                self._ar_custom = g.allreduce("custom", self.tp)
        if self.ep > 1 and nvlink:
            self._ar_ep = g.allreduce("nccl", self.ep)

    # ---- the pieces of a step -------------------------------------------------------------------

    def _linear(self, tokens: int) -> float:
        """All transformer layers' linear work for `tokens` tokens (cached: a few hundred sizes)."""
        hit = self._lin_cache.get(tokens)
        if hit is not None:
            return hit
        w, f = self._lw_s, self._lf_s * tokens
        if self._local_experts:
            # Expert-parallel peers run in lockstep with batches of about this size: their tokens
            # reach this GPU's experts too. The busiest rank sets the pace (balls into bins).
            seen = tokens * self.ep
            w += self._ew_s * self._local_experts * (1.0 - (1.0 - self._k_over_e) ** seen)
            assigned = seen * self._k / self.ep
            f += self._ef_s * (
                assigned + math.sqrt(2.0 * assigned * math.log(self.ep)) if self.ep > 1 else assigned
            )
        t = self._layers * (roofline(w, f, self._p) + self._layer_s + self._norm_s * tokens)
        if len(self._lin_cache) < 65536:
            self._lin_cache[tokens] = t
        return t

    def layer_time(self, tokens: int) -> float:
        """One transformer layer's linear and elementwise kernels for `tokens` tokens (what the
        Vidur profiles measure)."""
        return self._linear(tokens) / self._layers

    def _head(self, seqs: int) -> float:
        return roofline(self._hw_s, self._hf_s * seqs, self._p) if seqs else 0.0

    def allreduce_time(self, nbytes: float) -> float:
        """One TP all-reduce of `nbytes`, by the engine's backend for that size."""
        if self._ar_custom is not None and nbytes <= self.overhead.custom_allreduce_max_bytes:
            return self._ar_custom.time(nbytes, self.tp)
        return self._group_allreduce(self._ar, nbytes, self.tp)

    def _group_allreduce(self, terms: AllReduceTerms | None, nbytes: float, group: int) -> float:
        if terms is not None:
            return terms.time(nbytes, group)
        e, nvlink = self.eff, self.hw.intra_node_link == "nvlink"
        link = self.hw.intra_node_bw_gbps * 1e9 * (e.link if nvlink else e.pcie_link)
        latency = e.allreduce_latency_s if nvlink else e.pcie_allreduce_latency_s
        return latency + 2 * (group - 1) / group * nbytes / link

    def _comm(self, tokens: int) -> float:
        """All-reduces of a step of `tokens` tokens (cached like `_linear`: the band lookup is slow)."""
        hit = self._comm_cache.get(tokens)
        if hit is not None:
            return hit
        t = self._comm_uncached(tokens)
        if len(self._comm_cache) < 65536:
            self._comm_cache[tokens] = t
        return t

    def _comm_uncached(self, tokens: int) -> float:
        t = 0.0
        if self.tp > 1:
            t += 2 * self._layers * self.allreduce_time(tokens * self._ar_bytes)
        if self.ep > 1:  # all-gather + reduce-scatter of every peer's tokens = one all-reduce
            t += self._layers * self._group_allreduce(self._ar_ep, tokens * self.ep * self._ar_bytes, self.ep)
        return t

    # ---- step time ------------------------------------------------------------------------------

    def step_time(
        self, prefill_tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: float,
        pad_to: int = 0,
    ) -> float:  # fmt: skip
        """Seconds for one iteration.

        prefill_tokens: tokens prefilled this step (all chunks together).
        prefill_attn: sum over those tokens of the context each attends to (for a chunk of c tokens
            starting at position p, c*p + c*(c+1)/2).
        decode_seqs, decode_ctx: decoding sequences and the sum of their context lengths.
        pad_to: the linear layers and the collectives run on at least this many tokens (a
            data-parallel rank of an MoE model pads its batch to the largest rank's; 0: none).
        """
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0 and pad_to <= 0:
            return 0.0
        tokens = max(tokens, pad_to)
        seqs = decode_seqs + (1 if prefill_tokens else 0)
        kv = self._kv_s * (decode_ctx + prefill_tokens)
        af = self._attn_flop_s * (decode_ctx + prefill_attn)
        return (
            self._linear(tokens) + self._head(seqs) + self._attn_fixed_s + (kv if kv > af else af)
            + self._comm(tokens) + self._fixed_s + self._seq_s * seqs
        )  # fmt: skip

    def decode_coeffs(self, n: int) -> tuple[float, float]:
        """(A, B) with decode-only step time = A + B * ctx_sum for `n` sequences, exactly.

        With no prefill both attention terms are proportional to the context sum, so their
        roofline is too; everything else depends on n only. The simulator uses this to advance
        many identical-composition decode steps in closed form.
        """
        if n <= 0:
            return 0.0, 0.0
        a = (
            self._linear(n)
            + self._head(n)
            + self._attn_fixed_s
            + self._comm(n)
            + self._fixed_s
            + self._seq_s * n
        )
        b = self._kv_s if self._kv_s > self._attn_flop_s else self._attn_flop_s
        return a, b

    def floor_coeffs(self) -> tuple[float, float]:
        """Per-token (A, B) that no decode step of this engine undercuts: a sequence decoding alone
        (`decode_coeffs(1)`); a speculative model lowers both (`costmodel.speculative`)."""
        return self.decode_coeffs(1)

    def fullest_batch(self) -> int:
        """The most tokens one iteration runs: the budget, or one decode token per sequence."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)

    def decode_time(self, batch: int, context: float) -> float:
        """One decode iteration of `batch` sequences, each at `context` tokens."""
        return self.step_time(0, 0.0, batch, batch * context)

    # ---- memory ---------------------------------------------------------------------------------

    def weight_bytes_per_gpu(self) -> float:
        """Dense weights split over TP; experts over TP x EP (vLLM shards the vocabulary too)."""
        m = self.model
        experts = m.layers * m.experts * m.expert_params if m.is_moe else 0
        return ((m.total_params - experts) / self.tp + experts / (self.tp * self.ep)) * m.bytes_per_param

    def activation_bytes(self) -> float:
        """Peak torch memory of vLLM's profiling run, per GPU: the larger of a forward pass of
        max_num_batched_tokens tokens (where the MLP's gate and up projections dominate: tokens x 2
        x intermediate / t at bf16, plus a few hidden-sized buffers) and the dummy sampling of
        max_num_seqs requests that follows it, beside the forward's output hidden states."""
        m, mem = self.model, self.overhead.memory
        tokens = self.max_num_batched_tokens
        width = m.expert_intermediate * m.active_experts if m.is_moe else m.intermediate
        forward = tokens * (2 * width / self.tp + 4 * m.hidden) * m.bytes_per_param
        reqs = min(self.max_num_seqs, tokens)
        sampler = tokens * m.hidden * m.bytes_per_param + reqs * m.vocab * mem.sampler_bytes_per_logit
        return max(forward, sampler)

    def non_torch_bytes(self) -> float:
        """Allocations outside torch: workspaces, and the communicators' buffers in a TP/EP group."""
        mem = self.overhead.memory
        return (mem.non_torch_gib + (mem.collective_gib if self.tp * self.ep > 1 else 0.0)) * GIB

    def cudagraph_bytes(self) -> float:
        """The CUDA-graph memory the engine subtracts before sizing its cache (0 where it does not)."""
        mem = self.overhead.memory
        return mem.cudagraphs(self.max_num_seqs) * mem.cudagraph_mib * 2**20

    def memory_breakdown(self) -> dict[str, float]:
        """Bytes per GPU by what holds them, as vLLM's startup profile accounts them (KV last)."""
        usable = self.hw.memory_bytes * self.gpu_memory_utilization
        parts = {
            "weights": self.weight_bytes_per_gpu(),
            "activation_peak": self.activation_bytes(),
            "non_torch": self.non_torch_bytes(),
            "cudagraphs": self.cudagraph_bytes(),
            "other": self.eff.fixed_workspace_gib * GIB,
        }
        parts["kv_cache"] = usable - sum(parts.values())
        return parts

    def kv_budget_bytes(self) -> float:
        return self.memory_breakdown()["kv_cache"]

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds on this instance, in whole blocks as vLLM allocates it
        (0 when the weights do not fit)."""
        per_block = KV_BLOCK * self.model.kv_bytes_per_token_per_gpu(self.tp)
        return max(0, int(self.kv_budget_bytes() // per_block) * KV_BLOCK)

    def fits(self) -> bool:
        return self.kv_capacity_tokens() > 0

    def max_batch(self, context: int, requested: int) -> int:
        """How many sequences of `context` tokens run at once: the request, capped by max_num_seqs
        and by KV capacity."""
        return max(0, min(requested, self.max_num_seqs, self.kv_capacity_tokens() // max(1, context)))

    def throughput(self, batch: int, context: int) -> float:
        """Steady decode tokens/s with `batch` sequences at `context`, capped as in max_batch."""
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
