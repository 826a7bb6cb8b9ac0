"""EARL's parallelism selector: pick each stage's parallelism for the current context-length range.

Context grows as the policy learns (the paper's R2E mean went from 2.5K to 11.5K tokens). A
configuration chosen for short contexts is the fastest there but runs out of memory later; one
chosen for the longest possible context wastes throughput early. EARL switches between steps:
- contexts fall into ranges with fixed upper edges (4K, 8K, 16K, ...); past the last edge the
  range is the next power of two, so there is always a range;
- for rollout, the TP with the most decode throughput per GPU at the range's typical context,
  among TPs whose KV cache holds `PlannerConfig.min_concurrent` sequences at the range's upper
  edge (the planner's buckets obey the same rule);
- for training, the fastest TP/PP/DP/CP on the given GPUs that the memory model says fits the
  upper edge; CP enters only when TP alone cannot hold the context, so long contexts are
  *lengthened by parallelism, never truncated*;
- growth into a higher range switches at once (the next step must fit); shrinking waits
  `down_patience` steps.

The planner uses the same `context_bound` for its training search, so the selector's rule is part
of what the planner searches; `observe` is the step-by-step form a mechanism calls between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.core.errors import InfeasibleError
from libra.costmodel.training import TrainParallel
from libra.planner.config import PlannerConfig, SelectorConfig
from libra.planner.problem import PlanningProblem
from libra.planner.train_search import TrainSearch


@dataclass(frozen=True, slots=True)
class ParallelismSwitch:
    """Decision: from the next step, run rollout at `rollout_tp` and training at `train`."""

    context_bound: int
    rollout_tp: int
    train: TrainParallel
    reason: str


def range_edge(edges: list[int], context: int) -> int:
    """Upper edge of the range holding `context`: the first edge >= it, else the next power of two."""
    for e in edges:
        if context <= e:
            return e
    return 1 << max(0, int(context) - 1).bit_length()


class ParallelismSelector:
    __slots__ = ("problem", "config", "planner_config", "search", "bound", "rollout", "train", "_below")

    def __init__(
        self,
        problem: PlanningProblem,
        config: SelectorConfig | None = None,
        planner_config: PlannerConfig | None = None,
    ):
        self.problem, self.config = problem, config or SelectorConfig()
        self.planner_config = planner_config or PlannerConfig()
        self.search = TrainSearch(problem, self.planner_config)
        self.bound = 0
        self.rollout: int | None = None
        self.train: TrainParallel | None = None
        self._below = 0

    def context_bound(self, observed: int) -> int:
        """The length the stages must hold: the range edge, but no more than can occur."""
        return min(range_edge(self.config.edges, observed), max(self.problem.max_length, observed))

    # ---- the two choices ----------------------------------------------------------------------

    def rollout_tp(self, bound: int) -> int:
        p = self.problem
        best: tuple[float, int] | None = None
        for tp in self.planner_config.rollout_tp:
            if not p.tp_allowed(tp):
                continue
            m = p.rollout_model(tp)
            if m.kv_capacity_tokens() < self.planner_config.min_concurrent * bound:
                continue
            per_gpu = m.throughput(p.max_num_seqs, max(1, bound // 2)) / tp
            if best is None or per_gpu > best[0]:
                best = (per_gpu, tp)
        if best is None:
            raise InfeasibleError(
                f"no rollout TP in {self.planner_config.rollout_tp} holds {self.planner_config.min_concurrent} "
                f"sequences of {bound} tokens of {p.model.name} on {p.hw.name}"
            )
        return best[1]

    def train_parallel(self, bound: int, gpus: int, lengths: list[int] | None = None) -> TrainParallel:
        """Fastest configuration on at most `gpus` that fits `bound` tokens per sequence."""
        lengths = lengths or [max(1, bound // 2)] * self.problem.batch_size
        best = self.search.best_per_gpus(lengths, bound, gpus)
        if not best:
            raise InfeasibleError(
                f"no training configuration of {self.problem.model.name} fits {bound}-token contexts on "
                f"{gpus} x {self.problem.hw.name} ({self.search.counts.describe()})"
            )
        return min(best.values(), key=lambda c: (c.time_s, c.par.gpus)).par

    # ---- step by step --------------------------------------------------------------------------

    def observe(self, observed: int, gpus: int, lengths: list[int] | None = None) -> ParallelismSwitch | None:
        """Call between steps with the longest context seen; a switch when the range changes."""
        want = self.context_bound(observed)
        if want > self.bound or self.train is None:
            return self._switch(want, gpus, lengths, f"context {observed} needs range <= {want}")
        if want < self.bound:
            self._below += 1
            if self._below >= self.config.down_patience:
                return self._switch(want, gpus, lengths, f"context stayed <= {want} for {self._below} steps")
        else:
            self._below = 0
        return None

    def _switch(self, bound: int, gpus: int, lengths: list[int] | None, reason: str) -> ParallelismSwitch:
        train = self.train_parallel(bound, gpus, lengths)
        tp = self.rollout_tp(bound)
        self.bound, self.rollout, self.train, self._below = bound, tp, train, 0
        return ParallelismSwitch(bound, tp, train, reason)
