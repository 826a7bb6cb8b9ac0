"""Rollout layouts: how a GPU budget becomes buckets, and what a given layout costs on a workload.

Two small strategies, registered by name in `LAYOUTS`:
- `heterogeneous`: the bucket DP of `rollout_dp` (Libra's heterogeneous TP buckets);
- `homogeneous`: one bucket, every engine of the same TP (the best single TP for the budget),
  which is what AReaL-style static systems and the `ablation:planner` rung deploy.

`RolloutEvaluator` prices any bucket list on any workload with the same range estimate the DP
uses, at the grain of single trajectories: a trajectory goes to the first bucket whose
max_context holds its final length. The planner evaluates the current plan and every candidate
this way on the same statistics, so the apply rule compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from libra.core.errors import InfeasibleError
from libra.planner.config import PlannerConfig
from libra.planner.plan import BucketPlan
from libra.planner.problem import PlanningProblem
from libra.planner.rollout_dp import EngineTables, LayoutDP, RangeArrays
from libra.planner.stats import LINES, WorkloadStats, champion_lines


class RolloutEvaluator:
    """Predicted makespan of bucket lists on one workload snapshot."""

    __slots__ = ("tables", "problem", "a", "scale", "n_steps")

    def __init__(self, tables: EngineTables, problem: PlanningProblem, stats: WorkloadStats):
        self.tables, self.problem = tables, problem
        self.a = stats.arrays(problem.batch_size)
        self.scale = problem.batch_size / stats.size
        self.n_steps = int(self.a["step"].max()) + 1

    def groups(self, max_contexts: Sequence[int]) -> RangeArrays:
        edges = np.asarray(max_contexts, dtype=np.float64)
        k = np.minimum(np.searchsorted(edges, self.a["final"], side="left"), len(edges) - 1)
        m, a, s = len(edges), self.a, self.scale
        gen = np.bincount(k, a["gen"], m) * s
        ctx = np.bincount(k, a["gen"] * a["ctx"], m) * s / np.maximum(gen, 1e-9)
        shape = (m, self.n_steps, LINES)
        lines_g, lines_t, present = np.zeros(shape), np.zeros(shape), np.zeros((m, self.n_steps))
        for b in range(m):
            members = k == b
            lines_g[b], lines_t[b], present[b] = champion_lines(
                a["gen"][members], a["tool"][members], a["step"][members], self.n_steps
            )
        count = np.bincount(k, None, m) * s
        prefill = np.bincount(k, a["prefill"], m) * s
        kv_ctx = np.bincount(k, a["final"], m) * s / np.maximum(count, 1e-9)
        tool = np.bincount(k, a["tool"], m) * s / np.maximum(count, 1e-9)
        return RangeArrays(count, gen, prefill, ctx, kv_ctx, tool, lines_g, lines_t, present, edges)

    def bucket_times(self, buckets: Sequence[BucketPlan]) -> np.ndarray:
        r = self.groups([b.max_context for b in buckets])
        ti = np.asarray([self._tp_index(b.tp) for b in buckets])
        n = np.asarray([b.instances for b in buckets], dtype=np.int64)
        pf = np.asarray([self.tables.prefill_per_token(t, r.ctx[i : i + 1])[0] for i, t in enumerate(ti)])
        times = self.tables.range_cost(ti, n, r, pf, self.tables.batch_cap(ti, r.kv_ctx))
        return np.where(r.count > 0, times, 0.0)

    def work(self, buckets: Sequence[BucketPlan]) -> float:
        """The busiest bucket's engine time per batch (the work bound alone)."""
        r = self.groups([b.max_context for b in buckets])
        ti = np.asarray([self._tp_index(b.tp) for b in buckets])
        n = np.asarray([b.instances for b in buckets], dtype=np.int64)
        pf = np.asarray([self.tables.prefill_per_token(t, r.ctx[i : i + 1])[0] for i, t in enumerate(ti)])
        work = self.tables.range_work(ti, n, r, pf, self.tables.batch_cap(ti, r.kv_ctx))
        return float(np.where(r.count > 0, work, 0.0).max()) if buckets else 0.0

    def makespan(self, buckets: Sequence[BucketPlan]) -> float:
        return float(self.bucket_times(buckets).max()) if buckets else float("inf")

    def with_times(self, buckets: Sequence[BucketPlan]) -> tuple[BucketPlan, ...]:
        times = self.bucket_times(buckets)
        return tuple(
            BucketPlan(b.tp, b.instances, b.max_context, b.min_context, float(t))
            for b, t in zip(buckets, times, strict=True)
        )

    def _tp_index(self, tp: int) -> int:
        hits = np.flatnonzero(self.tables.tps == tp)
        if not len(hits):
            raise InfeasibleError(f"TP {tp} is not a valid engine size for {self.problem.model.name}")
        return int(hits[0])


class Layout(Protocol):
    """A rollout layout strategy: the best time and the buckets for a GPU budget."""

    def best(self, gpus: int) -> float: ...

    def buckets(self, gpus: int) -> list[BucketPlan]: ...


class HeterogeneousLayout:
    """Buckets of different TP over contiguous length ranges, from the memoised DP."""

    name = "heterogeneous"

    def __init__(
        self, tables: EngineTables, problem: PlanningProblem, stats: WorkloadStats, cfg: PlannerConfig
    ):
        bins = stats.bins(cfg.bins, problem.batch_size)
        self.final_max = bins.final_max
        self.max_length = top_context(problem, stats)
        shape = cfg.bucket_shape(len(bins))
        self.dp = LayoutDP(tables, bins, self.max_length, cfg.min_concurrent, cfg.rollout_tp, *shape)

    def best(self, gpus: int) -> float:
        return self.dp.best(gpus)

    def buckets(self, gpus: int) -> list[BucketPlan]:
        out: list[BucketPlan] = []
        for tp, n, _j, i in self.dp.ranges(gpus):
            top = self.max_length if i == len(self.final_max) else int(self.final_max[i - 1])
            out.append(BucketPlan(tp, n, top, out[-1].max_context if out else 0))
        return out


# Within this share of each other the estimate cannot tell two single-TP layouts apart, and the
# larger TP is kept: its engines decode each token faster, which an agent workload's slowest
# trajectories need and the estimate underprices. Late in R2E-Gym's training (32 x 16, 32 / 16
# GPUs) it priced TP2 x 8 and TP4 x 4 0.4% apart; the simulator ran TP4 10% faster.
TP_TIE = 0.03


class HomogeneousLayout:
    """One bucket up to the length limit, all engines of the single best TP for the budget."""

    name = "homogeneous"

    def __init__(
        self, tables: EngineTables, problem: PlanningProblem, stats: WorkloadStats, cfg: PlannerConfig
    ):
        self.ev = RolloutEvaluator(tables, problem, stats)
        self.problem, self.top = problem, top_context(problem, stats)
        cap = {int(t): c for t, c in zip(tables.tps, tables.kvcap, strict=True)}
        self.tps = [t for t in cfg.rollout_tp if t in cap and cap[t] >= cfg.min_concurrent * self.top]
        self._memo: dict[int, tuple[float, list[BucketPlan]]] = {}

    def _solve(self, gpus: int) -> tuple[float, list[BucketPlan]]:
        if gpus not in self._memo:
            best: tuple[float, list[BucketPlan]] = (float("inf"), [])
            for t in self.tps:  # ascending: a larger TP within TP_TIE of the best so far wins
                layout = [BucketPlan(t, gpus // t, self.top)] if gpus >= t else []
                if layout and self.ev.makespan(layout) <= best[0] * (1 + TP_TIE):
                    best = (min(best[0], self.ev.makespan(layout)), layout)
            self._memo[gpus] = best
        return self._memo[gpus]

    def best(self, gpus: int) -> float:
        return self._solve(gpus)[0]

    def buckets(self, gpus: int) -> list[BucketPlan]:
        t, b = self._solve(gpus)
        if not b:
            raise InfeasibleError(f"no single TP holds {self.top}-token contexts on {gpus} GPUs")
        return list(b)


def top_context(problem: PlanningProblem, stats: WorkloadStats) -> int:
    """What the last bucket must hold: the length limit, or more if the history already went past it
    (a trace from a run with a larger limit); buckets must never hold less than was seen."""
    return max(problem.max_length, stats.max_final)


LAYOUTS: dict[str, type] = {cls.name: cls for cls in (HeterogeneousLayout, HomogeneousLayout)}


def fill_leftover(buckets: list[BucketPlan], gpus: int, ev: RolloutEvaluator) -> list[BucketPlan]:
    """Give GPUs the layout left unused to the slowest bucket that an extra engine fits in."""
    out = list(buckets)
    left = gpus - sum(b.gpus for b in out)
    while out:
        times = ev.bucket_times(out)
        fits = [k for k in range(len(out)) if out[k].tp <= left]
        if not fits:
            break
        k = max(fits, key=lambda k: (times[k], -out[k].tp))
        b = out[k]
        out[k] = BucketPlan(b.tp, b.instances + 1, b.max_context, b.min_context)
        left -= b.tp
    return out
