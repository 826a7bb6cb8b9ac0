"""The planner's controller: one object per run that turns each finished step into a decision.

Why it is here and pure: re-planning and borrowing are policy, and "the same policy code runs in
the simulator and live" must hold for them as it does for routing. The simulator feeds this object
simulated step reports and `libra train` feeds it live ones; neither adapter decides anything.

Per step it answers, in this order:
1. **Elastic**: should hybrid replicas join training or go back to rollout? (`ElasticController`,
   hysteresis on T_train / T_rollout), with the hosts of each replica chosen by `hybrid_hosts`.
2. **Re-plan**: is there a reason to search (`check_triggers`: every K steps, or pressure), and is
   the new plan worth switching to (the planner's gain-versus-cost rule, `should_apply`)? The
   search reads the statistics window: the last `window_steps` finished steps, never future
   lengths.

The first plan comes from a profiling sample (`initial`), as a real deployment profiles before
training. Everything is pure: no clock, no I/O; reports carry measured times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from libra.core.trajectory import Trajectory
from libra.planner.elastic import ElasticController, ElasticDecision, ElasticSignals, HybridReplica
from libra.planner.plan import InFlightBatch, Plan, diff, reconfig_cost_s
from libra.planner.planner import GlobalPlanner
from libra.planner.stats import WorkloadStats
from libra.planner.triggers import PipelineSignals, Trigger, check_triggers

WINDOW_STEPS = 3  # finished steps the planner's statistics cover


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a mechanism measured of one finished (trained) step."""

    step: int
    trajectories: Sequence[Trajectory]  # the step's trained trajectories: lengths and tool latencies
    t_train_s: float
    t_rollout_s: float  # the batch's rollout makespan
    rollout_pressure: float = 0.0  # waiting requests / what the engines admit, 0..1+
    stale_samples: int = 0  # finished samples too stale to train on
    # The batches still running that a switch restarting engines would wait for; empty where the
    # mechanism moves engines without draining batches (live, engines drain turn by turn).
    in_flight: tuple[InFlightBatch, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolView:
    """The hybrid pool as the elastic decision needs it: the replicas (whose state the mechanism
    drives), the core's DP size, and the GPUs serving rollout now."""

    replicas: Sequence[HybridReplica]
    core_dp: int
    rollout_gpus: int
    prompts_per_step: int = 0


@dataclass(frozen=True, slots=True)
class Replan:
    """Switch to `plan`; the switch costs `reconfig_s` (engines restart, training reshards)."""

    plan: Plan
    reconfig_s: float
    trigger: Trigger
    reason: str
    interrupt: bool = False  # interrupt the batches in flight instead of draining them first


@dataclass(frozen=True, slots=True)
class ControlDecision:
    step: int
    elastic: ElasticDecision | None = None
    replan: Replan | None = None
    trigger: Trigger = Trigger.NONE
    reason: str = ""  # why the planner did (or did not) switch

    def log(self) -> dict:
        """The decision as steps.json records it (the simulator and `libra train` alike)."""
        el, rp = self.elastic, self.replan
        return {
            "step": self.step,
            "trigger": self.trigger.name.lower(),
            "reason": self.reason,
            "replan": None
            if rp is None
            else {
                "trigger": rp.trigger.name.lower(),
                "reconfig_s": rp.reconfig_s,
                "interrupt": rp.interrupt,
                "reason": rp.reason,
                "instances": [b.instances for b in rp.plan.buckets],
                "boundaries": list(rp.plan.boundaries),
            },  # fmt: skip
            "elastic": None
            if el is None
            else {
                "joins": [j.replica for j in el.joins],
                "releases": [r.replica for r in el.releases],
                "reason": el.reason,
            },  # fmt: skip
        }


class PlanController:
    """Owns the triggers' bookkeeping, the statistics window and the apply rule for one run."""

    def __init__(
        self,
        planner: GlobalPlanner,
        replan: bool = True,
        elastic: ElasticController | None = None,
        default_tool_latency_s: float = 0.0,
        window_steps: int = WINDOW_STEPS,
        run_steps: int | None = None,
    ):
        self.planner, self.replan, self.elastic = planner, replan, elastic
        self.run_steps = run_steps  # the run's length, when known: a switch must pay before its end
        self.default_tool_latency_s = default_tool_latency_s
        self.window: deque[StepReport] = deque(maxlen=window_steps)
        self.last_plan_step: int | None = None
        self.last_pressure_step: int | None = None

    def initial(self, sample: Sequence[Trajectory]) -> Plan:
        """The first plan, from a profiling sample of the workload."""
        stats = WorkloadStats.from_trajectories(sample, default_tool_latency_s=self.default_tool_latency_s)
        self.last_plan_step = 0
        # The sample stays in the window until trained steps push it out: under completion order
        # the first steps train only the groups that finished first, the shortest of their
        # batches, and a window of those alone would plan for a workload shorter than it is.
        self.window.append(StepReport(-1, tuple(sample), 0.0, 0.0))
        return self.planner.decide(stats, None).plan

    def observe(
        self, report: StepReport, current: Plan | None, pool: PoolView | None = None
    ) -> ControlDecision:
        """The decision after step `report.step` has trained."""
        self.window.append(report)
        elastic = self._elastic(report, pool)
        if not self.replan or current is None:
            return ControlDecision(report.step, elastic, reason="this system does not re-plan")
        trigger = self._trigger(report)
        if trigger == Trigger.NONE:
            return ControlDecision(report.step, elastic, reason="no trigger")
        return self._replan(report, current, elastic, trigger)

    def _elastic(self, report: StepReport, pool: PoolView | None) -> ElasticDecision | None:
        if self.elastic is None or pool is None or not pool.replicas:
            return None
        sig = ElasticSignals(report.t_train_s, report.t_rollout_s, report.rollout_pressure, pool.core_dp,
                             pool.rollout_gpus, pool.prompts_per_step, step=report.step)  # fmt: skip
        return self.elastic.decide(sig, pool.replicas)

    def _trigger(self, report: StepReport) -> Trigger:
        sig = PipelineSignals(step=report.step, last_plan_step=self.last_plan_step,
                              last_pressure_step=self.last_pressure_step, stale_samples=report.stale_samples,
                              batch_size=len(report.trajectories), t_train_s=report.t_train_s,
                              t_rollout_s=report.t_rollout_s)  # fmt: skip
        trigger = check_triggers(sig, self.planner.config)
        if trigger not in (Trigger.NONE, Trigger.INTERVAL):
            self.last_pressure_step = report.step
        if trigger != Trigger.NONE:
            self.last_plan_step = report.step
        return trigger

    def context_floor(self, current: Plan) -> int:
        """The least context bound a re-plan may train for: EARL's rule for shrinking applied to
        the planner's search. Growth is at once; a bound below the current plan's only once the
        window holds `selector.down_patience` trained steps (the window's longest trajectory then
        spans that many steps). Without it a plan fitted to the first short step of a run is
        forced back as soon as a longer trajectory arrives, and each switch drains the batches in
        flight (at R2E-Gym's start, staleness 2: 2,264 against 4,242 tok/s, docs/gaps.md)."""
        patience = self.planner.selector.config.down_patience
        return 0 if len(self.window) >= patience else current.context_bound

    def _replan(self, report: StepReport, current: Plan, elastic, trigger: Trigger) -> ControlDecision:
        window = [t for r in self.window for t in r.trajectories]
        stats = WorkloadStats.from_trajectories(window, train_time_s=report.t_train_s,
                                                rollout_time_s=report.t_rollout_s,
                                                default_tool_latency_s=self.default_tool_latency_s)  # fmt: skip
        left = None if self.run_steps is None else self.run_steps - report.step - 1
        dec = self.planner.decide(stats, current, report.in_flight, self.context_floor(current), left)
        reason = dec.verdict.reason
        if dec.plan == current:
            return ControlDecision(report.step, elastic, trigger=trigger, reason=reason)
        cost = reconfig_cost_s(diff(current, dec.plan), self.planner.elastic)
        replan = Replan(dec.plan, cost, trigger, reason, dec.interrupt and dec.plan is dec.candidate)
        return ControlDecision(report.step, elastic, replan, trigger, reason)
