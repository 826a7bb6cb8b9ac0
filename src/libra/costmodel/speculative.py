"""Speculative decoding as a rollout cost model: what a decode token costs when drafts are verified.

Why a cost model and not an engine change: speculative decoding does not change what an engine
schedules, only how many tokens one iteration yields. A verification iteration of n sequences
with d draft tokens each runs n(d+1) query tokens through the model (reading the weights and each
sequence's KV cache once) and yields tau(d) tokens per sequence on average, where with a per-token
acceptance rate p (drafts accepted left to right, the first rejection ends the run)

    tau(d) = 1 + p + ... + p^d = (1 - p^(d+1)) / (1 - p).

The simulated engine advances decodes one token per step in closed form (`decode_coeffs`), so a
speculative step is expressed per token: a decode step of n sequences costs A'(n) + B'(n) * ctx_sum
with A' = a(n, d) / tau(d) and B' = b(d) / tau(d), a and b the verification iteration's terms.

**Adaptive draft length** (Seer, arXiv 2511.14617, section 4.3, "adaptive grouped speculative
decoding"): the draft length is chosen per batch size, the d in 0..max_draft that minimises the
time per token at a reference context. At small batches decoding is bound by reading the weights
and drafts are nearly free, so long drafts pay; at large batches the linear layers are bound by
compute, each draft token costs as much as a real one, and d falls to 0 (plain decoding).

**Grouped drafts**: Seer drafts from the other responses of the same GRPO group (a suffix tree of
their tokens), which is what makes the acceptance rate high without a draft model. Drafting is
CPU work taken as free here, and the acceptance rate is a stated parameter, not derived from the
group's text (the simulator has no tokens).

Prefill and mixed iterations are priced as without speculation (`step_time` is the base
model's): a conservative choice, and the one that keeps the limit's floor below every iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.core.specs import HardwareSpec, ModelSpec
from libra.costmodel.efficiency import DEFAULT_ENGINE, RolloutEfficiency
from libra.costmodel.rollout import RolloutCostModel


@dataclass(frozen=True, slots=True)
class SpecDecoding:
    """A speculative decoder: per-token acceptance rate, the longest draft, and the context at which
    the draft length is chosen."""

    acceptance: float
    max_draft: int
    ref_context: int = 4096

    def tokens_per_step(self, draft: int) -> float:
        """tau(d): tokens one verification yields per sequence, on average."""
        p = self.acceptance
        if p >= 1.0:
            return float(draft + 1)
        return (1.0 - p ** (draft + 1)) / (1.0 - p)


class SpeculativeCostModel(RolloutCostModel):
    """A rollout cost model whose decode steps verify drafts (see the module docstring)."""

    __slots__ = ("spec", "_spec_cache")

    def __init__(
        self,
        hw: HardwareSpec,
        model: ModelSpec,
        tp: int,
        spec: SpecDecoding,
        eff: RolloutEfficiency | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        engine: str = DEFAULT_ENGINE,
        max_num_seqs: int = 256,
    ):
        super().__init__(
            hw, model, tp, eff, gpu_memory_utilization, max_num_batched_tokens, engine, max_num_seqs
        )
        self.spec = spec
        self._spec_cache: dict[int, tuple[float, float, int]] = {}

    def _verify_terms(self, n: int, d: int) -> tuple[float, float]:
        """(a, b) of one verification iteration of n sequences with d drafts each."""
        m = n * (d + 1)
        a = (self._linear(m) + self._head(m) + self._attn_fixed_s + self._comm(m) + self._fixed_s
             + self._seq_s * n)  # fmt: skip
        flops = self._attn_flop_s * (d + 1)
        return a, (self._kv_s if self._kv_s > flops else flops)

    def _choose(self, n: int) -> tuple[float, float, int]:
        hit = self._spec_cache.get(n)
        if hit is not None:
            return hit
        best = (0.0, 0.0, -1)
        best_cost = float("inf")
        for d in range(self.spec.max_draft + 1):
            a, b = self._verify_terms(n, d)
            tau = self.spec.tokens_per_step(d)
            cost = (a + b * n * self.spec.ref_context) / tau
            if cost < best_cost:  # strict: ties keep the shorter draft
                best_cost, best = cost, (a / tau, b / tau, d)
        if len(self._spec_cache) < 65536:
            self._spec_cache[n] = best
        return best

    def draft_length(self, n: int) -> int:
        """The draft length chosen for a decode batch of n sequences."""
        return self._choose(n)[2] if n > 0 else 0

    def decode_coeffs(self, n: int) -> tuple[float, float]:
        if n <= 0:
            return 0.0, 0.0
        a, b, _ = self._choose(n)
        return a, b

    def floor_coeffs(self) -> tuple[float, float]:
        """Per-token (A, B) no decode step undercuts at any batch or draft length (the limit's)."""
        a = min(
            self._verify_terms(1, d)[0] / self.spec.tokens_per_step(d) for d in range(self.spec.max_draft + 1)
        )
        b = min(
            self._verify_terms(1, d)[1] / self.spec.tokens_per_step(d) for d in range(self.spec.max_draft + 1)
        )
        return a, b

    def fullest_batch(self) -> int:
        """The most query tokens one iteration may run: a verification of max_num_seqs sequences."""
        return max(super().fullest_batch(), self.max_num_seqs * (self.spec.max_draft + 1))


def rollout_cost(hw: HardwareSpec, model: ModelSpec, tp: int, eff: RolloutEfficiency | None, rollout,
                 spec: SpecDecoding | None = None) -> RolloutCostModel:  # fmt: skip
    """The cost model of one engine of a scenario's `rollout` section, speculative when `spec` is set."""
    args = (
        rollout.gpu_memory_utilization,
        rollout.max_num_batched_tokens,
        rollout.engine,
        rollout.max_num_seqs,
    )
    if spec is None:
        return RolloutCostModel(hw, model, tp, eff, *args)
    return SpeculativeCostModel(hw, model, tp, spec, eff, *args)
