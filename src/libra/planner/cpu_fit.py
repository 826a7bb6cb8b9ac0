"""EARL's selector for the live CPU trainer: the micro-batch packing that fits the context range.

The cluster-scale selector (`selector.py`) picks TP/PP/DP/CP from the catalog's GPUs. The live
trainer of this project trains the built-in model on CPU processes, where the knob is how many
tokens one micro-batch packs (several short sequences, or one long one) against a memory budget.
The rule is EARL's: contexts fall into ranges (the same `SelectorConfig.edges`); for the range
holding the longest context seen, pick the largest packing that the memory model says fits, and
never one that does not: a refused configuration comes back with the reason, for the caller to
log; if nothing fits the range, the decision is a refusal (`InfeasibleError`), never a truncation.

Memory model (fp32, AdamW, the cache-free training forward of a pre-norm decoder):
- state: weights + gradients + two AdamW moments = 16 bytes per parameter;
- activations kept for backward, per packed token and layer: the residual input, two norms, q/k/v,
  the attention output, the gate/up projection and the SwiGLU product
  (`6 * d_model + 3 * d_ff` floats);
- attention scores: CPU SDPA materialises [heads, T, T] per sequence, for the longest sequence of
  the micro-batch (`n_heads * T^2` floats per layer, kept for backward);
- logits and their gradient: 2 * vocab floats per packed token.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.core.errors import InfeasibleError
from libra.planner.config import SelectorConfig
from libra.planner.selector import range_edge

FLOAT = 4
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class DenseDims:
    """The shape of a dense pre-norm decoder (the built-in model's preset has these fields)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int

    @classmethod
    def of(cls, preset) -> DenseDims:
        return cls(preset.n_layers, preset.d_model, preset.n_heads, preset.d_ff, preset.vocab_size)

    def params(self) -> int:
        per_layer = 2 * self.d_model + 4 * self.d_model**2 + 3 * self.d_model * self.d_ff
        # Three vocabulary tables: the embedding, the output head, and the previous-token
        # embedding (one row more, for a sequence's first position); then the final norm.
        tables = (3 * self.vocab_size + 1) * self.d_model
        return self.n_layers * per_layer + tables + self.d_model


def train_bytes(dims: DenseDims, packed_tokens: int, longest: int) -> int:
    """Peak bytes of one training micro-batch of `packed_tokens` tokens, no sequence over `longest`."""
    state = 16 * dims.params()
    per_token = dims.n_layers * (6 * dims.d_model + 3 * dims.d_ff) + 2 * dims.vocab_size
    scores = dims.n_layers * dims.n_heads * longest * longest
    return state + FLOAT * (per_token * packed_tokens + scores)


@dataclass(frozen=True, slots=True)
class CpuFit:
    """Decision: train the range up to `context_bound` with micro-batches of `packed_tokens`."""

    context_bound: int
    packed_tokens: int
    bytes: int
    reason: str
    refused: tuple[str, ...]  # the larger packings that would not fit, each with why


class CpuFitSelector:
    """Pick the micro-batch packing per context range; pure: the caller logs the refusals."""

    __slots__ = ("dims", "budget_bytes", "packings", "config", "current")

    def __init__(
        self,
        dims: DenseDims,
        budget_bytes: int,
        packings: tuple[int, ...] = (),
        config: SelectorConfig | None = None,
    ):
        self.dims, self.budget_bytes, self.config = dims, budget_bytes, config or SelectorConfig()
        self.packings = tuple(sorted(set(packings or (1 << k for k in range(10, 18))), reverse=True))
        self.current: CpuFit | None = None

    def choose(self, longest: int) -> CpuFit:
        """The largest packing that holds a whole `bound`-token sequence and fits the budget."""
        bound = range_edge(self.config.edges, longest)
        refused = []
        for packed in self.packings:
            if packed < bound:
                continue  # a sequence is never split across micro-batches, nor truncated
            need = train_bytes(self.dims, packed, bound)
            if need <= self.budget_bytes:
                why = f"context {longest} -> range <= {bound}: {packed} tokens per micro-batch, {need / MIB:.0f} MiB"
                return CpuFit(bound, packed, need, why, tuple(refused))
            refused.append(self._why(packed, bound, need))
        raise InfeasibleError(
            f"no micro-batch holds a {bound}-token sequence within {self.budget_bytes / MIB:.0f} MiB: "
            + "; ".join(refused or [f"no packing of at least {bound} tokens in {list(self.packings)}"])
        )

    def observe(self, longest: int) -> CpuFit | None:
        """Between steps: a new decision when the range changes (growth at once), else None."""
        fit = self.choose(longest)
        if self.current is not None and fit.context_bound == self.current.context_bound:
            return None
        self.current = fit
        return fit

    def _why(self, packed: int, bound: int, need: int) -> str:
        scores = train_bytes(self.dims, 0, bound) - train_bytes(self.dims, 0, 0)
        return (
            f"{packed} tokens per micro-batch needs {need / MIB:.0f} MiB (attention scores of a {bound}-token "
            f"sequence {scores / MIB:.0f} MiB) > budget {self.budget_bytes / MIB:.0f} MiB"
        )
