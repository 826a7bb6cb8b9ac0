"""Re-planning a running fleet: how many of its engines serve each bucket, and where the boundaries lie.

Why a planner of its own: `GlobalPlanner` searches the split, the training parallelism and the
buckets' TP degrees together, which a running live fleet cannot change in place: its trainers are a
fixed gloo group whose size moves only through the elastic pool, and an engine of another TP is
another process. What a fleet *can* change at a step boundary is where each engine serves: moving
an engine to another bucket is a drain and an add in the gateway, and a boundary is a router
threshold. So this planner keeps the buckets (their number and TP) and the engine count, prices
every way of dealing the engines over the buckets with the global planner's own tables, boundary
fit (`fit_boundaries`) and evaluator, and answers with a `PlanDecision` under the same apply rule
and the same per-step robustness check (it is a `GlobalPlanner` whose search space is the fleet's).
`PlanController` drives it exactly as it drives the global planner.

The training time is the measured one (`stats.train_time_s`): the split is not searched here, so
training is priced by what it took, not by a cost model of a machine it does not run on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from libra.core.errors import ConfigError, InfeasibleError
from libra.planner.config import ElasticConfig, PlannerConfig
from libra.planner.layouts import RolloutEvaluator
from libra.planner.plan import InFlightBatch, Plan
from libra.planner.planner import GlobalPlanner, PlanDecision
from libra.planner.problem import PlanningProblem
from libra.planner.stats import WorkloadStats
from libra.planner.triggers import ApplyVerdict


def deals(engines: int, buckets: int) -> Iterator[tuple[int, ...]]:
    """Every way to deal `engines` over `buckets` with at least one each (compositions)."""
    if buckets == 1:
        yield (engines,)
        return
    for first in range(1, engines - buckets + 2):
        for rest in deals(engines - first, buckets - 1):
            yield (first, *rest)


class FleetPlanner(GlobalPlanner):
    """The global planner's search restricted to a fleet: `current`'s buckets and engine count."""

    name = "fleet"

    def __init__(self, problem: PlanningProblem, config: PlannerConfig | None = None,
                 elastic: ElasticConfig | None = None):  # fmt: skip
        super().__init__(problem, config, elastic)
        self.fleet: Plan | None = None  # the layout whose engines are dealt (set by `decide`)

    def decide(
        self,
        stats: WorkloadStats,
        current: Plan | None,
        in_flight: Sequence[InFlightBatch] = (),
        floor: int = 0,
        steps_left: int | None = None,
    ) -> PlanDecision:
        if current is None:
            raise ConfigError(
                "current", None, "the fleet's running layout (a fleet planner re-plans a fleet)"
            )
        self.fleet = current
        try:
            return super().decide(stats, current, in_flight, floor, steps_left)
        except InfeasibleError as e:  # keep the fleet as it is, and say why
            return PlanDecision(current, current, ApplyVerdict(False, 0.0, 0.0, 0.0, str(e)))

    def _search(self, stats: WorkloadStats, floor: int = 0) -> Plan:
        fleet = self.fleet
        assert fleet is not None  # decide() sets it before the memoised search runs
        engines = sum(b.instances for b in fleet.buckets)
        found = [p for n in deals(engines, len(fleet.buckets)) if (p := self._deal(fleet, n, stats))]
        if not found:
            raise InfeasibleError(f"no way to deal {engines} engines over {len(fleet.buckets)} buckets holds "
                                  f"{self.config.min_concurrent} sequences of each bucket's max context")  # fmt: skip
        return min(found, key=lambda p: (p.step_time_s, p.t_rollout_s))

    def plan(self, stats: WorkloadStats, current: Plan | None = None, floor: int = 0) -> Plan:
        # The memo key must name the fleet too: the same window dealt over another fleet differs.
        if stats.is_empty:
            return super().plan(stats, current, floor)
        return self._search(stats)

    def _deal(self, fleet: Plan, instances: Sequence[int], stats: WorkloadStats) -> Plan | None:
        """`fleet` with `instances` engines per bucket and the boundaries that suit them best;
        None if a bucket's KV cannot hold `min_concurrent` sequences of its max context."""
        dealt = tuple(replace(b, instances=n) for b, n in zip(fleet.buckets, instances, strict=True))
        plan = self.retune(replace(fleet, buckets=dealt), stats)
        return self.evaluate(plan, stats) if self._fits(plan) else None

    def _fits(self, plan: Plan) -> bool:
        cap = self.tables.kvcap[[int((self.tables.tps == b.tp).argmax()) for b in plan.buckets]]
        return all(c >= self.config.min_concurrent * b.max_context for c, b in zip(cap, plan.buckets, strict=True))  # fmt: skip

    def evaluate(self, plan: Plan, stats: WorkloadStats) -> Plan:
        """`plan` priced on `stats`: rollout by the evaluator, training as measured."""
        if stats.is_empty:
            return plan
        ev = RolloutEvaluator(self.tables, self.problem, stats)
        buckets = ev.with_times(plan.buckets)
        t_train = stats.train_time_s if stats.train_time_s is not None else plan.t_train_s
        return replace(plan, buckets=buckets, t_train_s=t_train, t_rollout_s=max(b.predicted_s for b in buckets),
                       rollout_work_s=ev.work(plan.buckets), group_spread=self.spread(stats), planner=self.name)  # fmt: skip
