"""The global resource planner: split, training parallelism and rollout buckets, jointly.

Objective: the asynchronous pipeline overlaps rollout of step k+1 with training of step k, so a
step takes about max(T_train, T_rollout) (exactly: `plan.pipeline_period`, which also prices a
pipeline that trains the first groups to finish); the planner minimises that over
- the split (training GPUs; the rest roll out),
- training TP/PP/DP/CP and micro-batch (`train_search`, with the context bound from EARL's
  selector so the configuration holds the longest context of the current range),
- the rollout layout for the remaining GPUs (`layouts`: the bucket DP, or one homogeneous bucket).

Only GPU counts on the training Pareto frontier are tried (a count that does not train faster
than a smaller one only takes GPUs from rollout), and every one reads its rollout time from the
same memoised DP table. The best few splits are then priced again trajectory by trajectory with
their final buckets, and the best of those is the plan.

Planners are registered by short name in `PLANNERS`:
- `libra`: heterogeneous buckets, re-planned, with the apply rule;
- `homogeneous`: the same search with one homogeneous bucket (AReaL-style static-optimal when it
  is never re-planned, the `ablation:planner` rung when it is);
- `greedy`: moves a fixed number of GPUs toward the slower stage after each step (baseline).

Everything here is pure: no clocks, no I/O. The caller measures search time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from libra.core.errors import ConfigError, InfeasibleError
from libra.core.registry import Registry
from libra.planner.config import ElasticConfig, PlannerConfig, SelectorConfig
from libra.planner.layouts import LAYOUTS, RolloutEvaluator, fill_leftover
from libra.planner.plan import (
    BucketPlan,
    InFlightBatch,
    Plan,
    check_plan,
    diff,
    drain_s,
    pipeline_period,
    reconfig_cost_s,
    restarts_engines,
)
from libra.planner.problem import PlanningProblem
from libra.planner.rollout_dp import EngineTables, fit_boundaries
from libra.planner.selector import ParallelismSelector
from libra.planner.stats import WorkloadStats
from libra.planner.train_search import TrainChoice, TrainSearch, frontier
from libra.planner.triggers import ApplyVerdict, should_apply

FINALISTS = 3  # splits priced again with their final buckets; the DP's bin-level estimate ranks them


@dataclass(frozen=True, slots=True)
class PlanDecision:
    """The planner's answer to "should we switch?": the candidate, the current plan priced on the
    same statistics, and the verdict of the apply rule."""

    candidate: Plan
    current: Plan | None
    verdict: ApplyVerdict
    # Carry the switch out by interrupting the batches in flight (they resume on the new engines,
    # recomputing their KV) rather than draining them first: the cheaper of the two (`switch_cost`).
    interrupt: bool = False

    @property
    def plan(self) -> Plan:
        """The plan to run next: the candidate if it is applied, else the current one."""
        return self.candidate if self.verdict.apply or self.current is None else self.current


# Searches remembered per planner, least recently used out first. A window of statistics each;
# 128 covers every re-plan of a 100-step run with pressure triggers (about one in two steps), so
# the later rungs of the ladder, which see the same windows, search none of them again.
PLAN_MEMO = 128
T = TypeVar("T")


def _memo(cache: dict, key, limit: int, make: Callable[[], T]) -> T:
    """`cache[key]`, made by `make()` on a miss; past `limit` entries the least recently used
    goes (the dict's order is recency: a hit is moved to the end)."""
    found = cache.pop(key, None)
    if found is None:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        found = make()
    cache[key] = found
    return found


class GlobalPlanner:
    name = "libra"
    layout = "heterogeneous"

    def __init__(
        self,
        problem: PlanningProblem,
        config: PlannerConfig | None = None,
        elastic: ElasticConfig | None = None,
        selector: SelectorConfig | None = None,
    ):
        self.problem = problem
        self.config = config or PlannerConfig()
        self.elastic = elastic or ElasticConfig()
        self.selector = ParallelismSelector(problem, selector, self.config)
        self.train_search = TrainSearch(problem, self.config)
        all_tps = [1 << k for k in range(problem.hw.gpus_per_node.bit_length())]
        self.tables = EngineTables(problem, all_tps, self.config.tail_fraction, self.config.kv_headroom)
        self._layouts: dict[tuple, object] = {}
        self._plans: dict[WorkloadStats, Plan] = {}

    # ---- search ----------------------------------------------------------------------------

    def plan(self, stats: WorkloadStats, current: Plan | None = None, floor: int = 0) -> Plan:
        """The best plan for `stats`, training contexts of at least `floor` tokens. Empty history:
        keep `current` (documented fallback), or fail.

        The search reads only the lengths, tokens, tool time and steps of `stats` (not measured
        stage times), so its result is memoised on them: systems of one simulation that share a
        planner and see the same window of finished steps search once (`memoise: false` off)."""
        if stats.is_empty:
            if current is not None:
                return current
            raise ConfigError("stats", "empty history", "at least one finished trajectory to plan from")
        if not self.config.memoise:
            return self._search(stats, floor)
        key = (stats.with_times(None, None), floor)
        return _memo(self._plans, key, PLAN_MEMO, lambda: self._search(stats, floor))

    def _search(self, stats: WorkloadStats, floor: int = 0) -> Plan:
        bound = max(floor, self.selector.context_bound(stats.max_final))
        lengths = stats.batch_lengths(self.problem.batch_size)
        trains = self._train_frontier(lengths, bound)
        spread, finals = self.spread(stats), []
        for name in self.finalist_layouts():
            layout = self._layout(stats, name)
            ranked = sorted(trains.values(), key=lambda c: self._score(c, layout, stats, spread))
            finals += [self._build(c, layout, stats, bound, spread) for c in ranked[:FINALISTS]]
        # Belt and braces: every constraint is re-derived from the cost models before a plan leaves.
        finals = [
            p for p in finals if p is not None and not check_plan(p, self.problem, self.config.min_concurrent)
        ]
        if not finals:
            raise InfeasibleError(self._no_rollout_message(trains))
        return self._pick(finals)

    def _pick(self, finals: list[Plan]) -> Plan:
        """The shortest predicted step; a split by length only if it beats the best single bucket
        by more than `split_margin` (the planner's own error would otherwise decide)."""
        key = lambda p: (p.step_time_s, p.t_train_s + p.t_rollout_s, -p.rollout_gpus)  # noqa: E731
        best = min(finals, key=key)
        single = [p for p in finals if len(p.buckets) == 1]
        if len(best.buckets) > 1 and single:
            one = min(single, key=key)
            if one.step_time_s <= best.step_time_s * (1 + self.config.split_margin):
                return one
        return best

    def _train_frontier(self, lengths: list[int], bound: int) -> dict[int, TrainChoice]:
        p = self.problem
        engines = [t for t in self.config.rollout_tp if p.tp_allowed(t)]
        if not engines:
            raise InfeasibleError(
                f"no rollout TP in {self.config.rollout_tp} is a power of two dividing both the "
                f"{p.hw.gpus_per_node} GPUs of a {p.hw.name} node and {p.model.name}'s {p.model.heads} heads"
            )
        best = self.train_search.best_per_gpus(lengths, bound, p.gpus - min(engines))
        if not best:
            raise InfeasibleError(
                f"no training configuration of {p.model.name} fits {bound}-token contexts in {p.gpus} x "
                f"{p.hw.name} with {p.prompts_per_step} GRPO groups ({self.train_search.counts.describe()})"
            )
        return frontier(best)

    def finalist_layouts(self) -> tuple[str, ...]:
        """The layout strategies whose best splits are priced in full; the shortest step wins.

        The bucket DP ranks layouts by their makespan, which is what a step waits for when it
        trains its own batch. When it trains the first groups to finish, the step also depends on
        how the groups' completions spread, which a split by length changes (short groups on
        small-TP engines) and the DP cannot see. So the heterogeneous planner also prices the best
        single-TP layouts and keeps one when it predicts the shorter step: one bucket is a layout
        like any other.
        """
        return (self.layout,) if self.layout == "homogeneous" else (self.layout, "homogeneous")

    def _layout(self, stats: WorkloadStats, name: str | None = None):
        name = name or self.layout

        def make():
            return LAYOUTS[name](self.tables, self.problem, stats, self.config)

        if not self.config.memoise:
            return make()
        key = (name, stats.final_tokens, stats.generated_tokens, stats.tool_latency_s, stats.steps)
        return _memo(self._layouts, key, 2 * len(LAYOUTS), make)

    def spread(self, stats: WorkloadStats) -> tuple[tuple[float, float], ...]:
        """The groups' latency spread the step time is priced with: empty when each step waits
        for its own batch (`consume: batch`), so the wait is the batch's makespan."""
        return stats.group_spread() if self.problem.consume == "completion" else ()

    def _score(
        self, c: TrainChoice, layout, stats: WorkloadStats, spread: tuple[tuple[float, float], ...]
    ) -> tuple[float, float]:
        rollout_gpus = self.problem.gpus - c.par.gpus
        if not self.config.memoise:  # the no-memo baseline: solve each split's rollout side afresh
            layout = type(layout)(self.tables, self.problem, stats, self.config)
        t_roll = layout.best(rollout_gpus)
        return (pipeline_period(c.time_s, t_roll, 0.0, self.problem.staleness, spread), c.time_s + t_roll)

    def _build(
        self,
        c: TrainChoice,
        layout,
        stats: WorkloadStats,
        bound: int,
        spread: tuple[tuple[float, float], ...] | None = None,
    ) -> Plan | None:
        gpus = self.problem.gpus - c.par.gpus
        try:
            buckets = layout.buckets(gpus)
        except InfeasibleError:
            return None
        ev = RolloutEvaluator(self.tables, self.problem, stats)
        buckets = ev.with_times(fill_leftover(buckets, gpus, ev))
        used = sum(b.gpus for b in buckets)
        replica_gpus = c.par.gpus // c.par.dp
        return Plan(
            total_gpus=self.problem.gpus, train_gpus=c.par.gpus, rollout_gpus=used, train=c.par,
            buckets=buckets, t_train_s=c.time_s, t_rollout_s=max(b.predicted_s for b in buckets),
            context_bound=bound, hybrid_replicas=int(self.config.hybrid_fraction * used // replica_gpus),
            planner=self.name, rollout_work_s=ev.work(buckets), staleness=self.problem.staleness,
            group_spread=self.spread(stats) if spread is None else spread,
        )  # fmt: skip

    def _no_rollout_message(self, trains: dict[int, TrainChoice]) -> str:
        p = self.problem
        left = p.gpus - min(trains)
        return (
            f"no rollout layout of {p.model.name} holds {self.config.min_concurrent} sequences of "
            f"{p.max_length} tokens on the {left} GPUs left after training ({p.hw.name}, TP in {self.config.rollout_tp})"
        )

    def rollout_layout(self, stats: WorkloadStats, gpus: int) -> list[BucketPlan]:
        """The DP's rollout buckets for `gpus` GPUs alone, leftovers to the slowest bucket: the
        layout of a system that lays its rollout out on GPUs it does not split with training
        (a colocated system)."""
        ev = RolloutEvaluator(self.tables, self.problem, stats)
        return list(ev.with_times(fill_leftover(self._layout(stats).buckets(gpus), gpus, ev)))

    # ---- pricing and switching ------------------------------------------------------------------

    def evaluate(self, plan: Plan, stats: WorkloadStats) -> Plan:
        """`plan` with its times predicted on `stats` (infinite training time if it no longer fits)."""
        if stats.is_empty:
            return plan
        bound = max(plan.context_bound, self.selector.context_bound(stats.max_final))
        cm = self.train_search.cm
        if cm.memory(plan.train, bound).fits:
            t_train = cm.step(plan.train, stats.batch_lengths(self.problem.batch_size)).step_time_s
        else:
            t_train = float("inf")
        ev = RolloutEvaluator(self.tables, self.problem, stats)
        buckets = ev.with_times(plan.buckets)
        t_roll, work = max(b.predicted_s for b in buckets), ev.work(plan.buckets)
        return replace(
            plan, t_train_s=t_train, t_rollout_s=t_roll, buckets=buckets, rollout_work_s=work,
            group_spread=self.spread(stats),
        )  # fmt: skip

    def retune(self, plan: Plan, stats: WorkloadStats) -> Plan:
        """`plan` with the bucket boundaries that suit `stats` best; engines and split unchanged."""
        if len(plan.buckets) < 2 or stats.is_empty:
            return plan
        bins = stats.bins(self.config.bins, self.problem.batch_size)
        engines = [(b.tp, b.instances) for b in plan.buckets]
        shape = self.config.bucket_shape(len(bins))
        ends = fit_boundaries(
            self.tables, bins, self.problem.max_length, engines, self.config.min_concurrent, *shape
        )
        if ends is None:
            return plan
        tops = [int(bins.final_max[i - 1]) for i in ends[:-1]] + [plan.buckets[-1].max_context]
        if tops != sorted(tops):  # the history outgrew the last bucket: only a re-plan can help
            return plan
        lows = [0, *tops[:-1]]
        buckets = tuple(
            BucketPlan(b.tp, b.instances, top, low)
            for b, top, low in zip(plan.buckets, tops, lows, strict=True)
        )
        return replace(plan, buckets=buckets)

    def decide(
        self,
        stats: WorkloadStats,
        current: Plan | None,
        in_flight: Sequence[InFlightBatch] = (),
        floor: int = 0,
        steps_left: int | None = None,
    ) -> PlanDecision:
        """Search, then apply the candidate only under the apply rule.

        The current plan is first given the bucket boundaries that suit the new statistics (free:
        they are router thresholds), so a candidate must win by what costs a restart. Sampling
        noise moves quantile boundaries every step; without this the 5% rule alone lets a
        stationary workload thrash.

        `in_flight`: the batches a switch that restarts engines waits for (empty where the
        mechanism moves engines without draining batches). The switch's cost is then the restart
        plus the drain (`plan.drain_s`), so no switch is made whose drain costs more than its
        gain over the planning horizon. `floor`: the least context bound the candidate trains
        for (`PlanController.context_floor`). `steps_left`: the steps the run has still to
        train, when it is known; the horizon is then the shorter of it and `interval_steps`,
        so a switch near the run's end must pay for itself before the end.
        """
        candidate = self.plan(stats, current, floor)
        if current is None:
            return PlanDecision(candidate, None, ApplyVerdict(True, 0.0, 0.0, 0.0, "initial plan"))
        now = min(
            (self.evaluate(current, stats), self.evaluate(self.retune(current, stats), stats)),
            key=lambda p: p.step_time_s,
        )
        change = diff(now, candidate)
        wait, interrupt, how = 0.0, False, ""
        if in_flight and restarts_engines(change):
            wait, interrupt, how = self.switch_cost(now, candidate, stats, in_flight)
        cost = reconfig_cost_s(change, self.elastic) + wait
        horizon = (
            self.config.interval_steps if steps_left is None else min(self.config.interval_steps, steps_left)
        )
        verdict = self._verdict(now, candidate, cost, horizon)
        if how:
            verdict = replace(verdict, reason=f"{verdict.reason} ({how})")
        if verdict.apply and math.isfinite(now.step_time_s):  # a plan that no longer fits must go
            verdict = self._robust(now, candidate, cost, stats, verdict, horizon)
        return PlanDecision(candidate, now, verdict, interrupt)

    def switch_cost(
        self, now: Plan, candidate: Plan, stats: WorkloadStats, in_flight: Sequence[InFlightBatch]
    ) -> tuple[float, bool, str]:
        """What switching costs beyond the restart, and how: (seconds, interrupt, in words).

        A drain waits for the slowest trajectory still to come (`plan.drain_s`) while no new batch
        starts. An interruption stops the engines at once and resumes every trajectory on the
        new ones, which first recompute the context those trajectories hold (`recompute_s`).
        `planner.switch` picks one, or the cheaper (the default)."""
        mode = self.config.switch
        drain = drain_s(in_flight, self.slowest_s(now, stats)) if mode != "interrupt" else math.inf
        redo = self.recompute_s(candidate, in_flight) if mode != "drain" else math.inf
        if redo < drain:
            return redo, True, f"interrupting: {redo:.0f} s of recompute included"
        return drain, False, f"a drain of {drain:.0f} s included"

    def recompute_s(self, plan: Plan, in_flight: Sequence[InFlightBatch]) -> float:
        """Seconds `plan`'s engines take to prefill again the context the batches in flight hold,
        each trajectory from scratch at the mean context, all engines at once (the stall an
        interruption costs; decoding beside it only makes it longer)."""
        running = sum(b.running for b in in_flight)
        tokens = sum(b.context_tokens for b in in_flight)
        if not running or not tokens:
            return 0.0
        ctx = max(1, tokens // running)
        per_s = sum(b.instances / self.problem.rollout_model(b.tp).prefill_time(ctx) for b in plan.buckets)
        return running / per_s if per_s > 0 else math.inf

    def slowest_s(self, plan: Plan, stats: WorkloadStats) -> float:
        """A batch's slowest trajectory on `plan`: the largest of the history's steps' predicted
        makespans (a drain waits for the slowest of several batches, not a typical one)."""
        parts = stats.by_step() or [stats]
        return max([plan.t_rollout_s] + [self.evaluate(plan, p).t_rollout_s for p in parts])

    def _verdict(self, now: Plan, candidate: Plan, cost: float, horizon: int) -> ApplyVerdict:
        """The apply rule over `horizon` steps; a move from one bucket to a split by length must
        also clear `split_margin`, the estimate's error on exactly that comparison (as in `_pick`)."""
        least = self.config.min_gain
        if len(candidate.buckets) > 1 and len(now.buckets) == 1:
            least = max(least, self.config.split_margin)
        if horizon < 1:
            return ApplyVerdict(False, 0.0, 0.0, cost, "the run has no step left to gain on")
        return should_apply(now, candidate, cost, horizon, least)

    def _robust(
        self,
        now: Plan,
        candidate: Plan,
        cost: float,
        stats: WorkloadStats,
        verdict: ApplyVerdict,
        horizon: int,
    ) -> ApplyVerdict:
        """Keep a switch only if it also wins on each step of the history on its own.

        The candidate was fitted to the whole window, so on that window it looks better than it
        is. A real drift shows on every recent step; a near-tie between two layouts that sampling
        noise tips one way does not.
        """
        for part in stats.by_step():
            v = self._verdict(self.evaluate(now, part), self.evaluate(candidate, part), cost, horizon)
            if not v.apply:
                reason = f"not better on step {part.steps[0]} alone ({v.reason})"
                return ApplyVerdict(False, verdict.gain_s, verdict.gain_fraction, cost, reason)
        return verdict


class HomogeneousPlanner(GlobalPlanner):
    """The same search with a single bucket of one TP (AReaL-style static / ablation:planner)."""

    name = "homogeneous"
    layout = "homogeneous"


class GreedyShiftPlanner(GlobalPlanner):
    """Baseline: after each step move `shift_gpus` (one node by default) toward the slower stage.

    It needs measured times (`stats.train_time_s`, `stats.rollout_time_s`); without them it keeps
    the current plan. Its first plan is the homogeneous planner's. Training moves to the nearest
    GPU count at least `shift_gpus` away on which a configuration fits and divides the GRPO groups
    evenly (so a move may be larger than the shift, never smaller); rollout keeps one homogeneous
    bucket on the rest.
    """

    name = "greedy"
    layout = "homogeneous"

    def plan(self, stats: WorkloadStats, current: Plan | None = None, floor: int = 0) -> Plan:
        if current is None or stats.is_empty:
            return super().plan(stats, current, floor)
        t_train, t_roll = stats.train_time_s, stats.rollout_time_s
        if t_train is None or t_roll is None or t_train == t_roll:
            return current
        shift = self.config.shift_gpus or self.problem.hw.gpus_per_node
        return self._shifted(stats, current.train_gpus, shift if t_train > t_roll else -shift) or current

    def _shifted(self, stats: WorkloadStats, now: int, shift: int) -> Plan | None:
        bound = self.selector.context_bound(stats.max_final)
        try:
            trains = self._train_frontier(stats.batch_lengths(self.problem.batch_size), bound)
        except InfeasibleError:
            return None
        if shift > 0:
            fit = [g for g in trains if g >= now + shift]
            target = min(fit, default=None)
        else:
            target = max((g for g in trains if g <= now + shift), default=None)
        return None if target is None else self._build(trains[target], self._layout(stats), stats, bound)

    def decide(
        self,
        stats: WorkloadStats,
        current: Plan | None,
        in_flight: Sequence[InFlightBatch] = (),
        floor: int = 0,
        steps_left: int | None = None,
    ) -> PlanDecision:
        candidate = self.plan(stats, current, floor)
        changed = current is None or candidate.layout_key() != current.layout_key()
        return PlanDecision(candidate, current, ApplyVerdict(changed, 0.0, 0.0, 0.0, "greedy shift"))


PLANNERS: Registry[type[GlobalPlanner]] = Registry(
    "planner", "planner", (GlobalPlanner, HomogeneousPlanner, GreedyShiftPlanner)
)


def make_planner(
    name: str, problem: PlanningProblem, config: PlannerConfig | None = None, **kw
) -> GlobalPlanner:
    """A registered planner by short name, or outside code as 'package.module:Class'."""
    return PLANNERS.build(name, problem, config, **kw)
