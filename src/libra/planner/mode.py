"""Which pipeline a workload should run: the disaggregated plan, or colocated partial rollouts.

Why it is policy, beside the plan search: the planner's `Plan` is a disaggregated, asynchronous
pipeline (rollout and training on GPUs of their own). APRIL's mechanism (arXiv 2509.18521) is a
different pipeline: rollout on every GPU, then training on every GPU, with `over_provision` times
a step's GRPO groups in flight and the rollout stopped once the step's target has finished
(`planner.partial`). Neither wins everywhere: where a step is bound by a few long trajectories,
over-provisioning keeps every engine busy and carries the tail into the next step; where training
or the two phase switches dominate, the disaggregated overlap wins. Giving the disaggregated
pipeline partial rollouts instead does not pay (measured: it lost 15-18% and stalled in one cell,
docs/peers.md), so the choice is between the two pipelines whole.

The choice is a prediction, made once from the profiling sample with the planner's own cost model,
never from simulated or measured results: `choose_mode` prices the colocated-partial step
(`colocated_partial_step`) and compares it with the plan's `step_time_s`. Pure: no clock, no I/O.

**The colocated-partial step.** switch + rollout + switch + training, each on every GPU:
- training: the training cost model's step on the colocated parallelism, for one batch;
- switches: `switch_s` each way (offload / onload), as the colocated pipeline charges them;
- rollout R per step, the largest of three bounds, in steady state:
  - *work*: the engines' busy time for one batch's tokens at the over-provisioned concurrency
    (`over_provision` batches in flight: larger decode batches, up to the KV capacity);
  - *turnover* (Little's law, discretised): each step starts new groups at its start and stops with
    (o - 1) T groups still running (T the target, o the over-provisioning), so in steady state
    sum_{i >= 1} (1 - F(i R)) = o - 1, F the share of a batch's groups done a time after they
    started. F comes from `WorkloadStats.group_spread` as in `plan.completion_wait`: a group is
    done at the later of its latency share of the batch's makespan (the planner's estimate on all
    GPUs) and its processor-sharing share of the work bound;
  - *staleness*: with the bound k a group started at step s must be trained by step s + k, so a
    step waits for it (a strict gate), at most k + 1 rollout phases after it started. While it
    waits, the other groups in flight keep running and those that finish are trained by the next
    steps: over those k + 1 phases the steps can train their k + 1 targets plus the (o - 1) T
    groups in flight beyond a target, so per batch the rollout takes at least M / (k + o), M the
    batch's makespan. With o = 1 and k = 0 this is the synchronous pipeline's makespan.
  The colocated-partial mode needs k >= 1 (carried trajectories are trained a step after they
  started, with tokens one version old); at k = 0 it is not a candidate.

**A run of n steps** (`steps`). Both step times above are steady-state periods; a run also pays
its pipeline's fill once, so each is compared as period + fill / n (`run_step_s`):
- disaggregated: the first step trains once the first T groups are done of the two batches that
  start together on version 0 (the strict gate's lead starts at 1, `StalenessGate.lead`; one batch
  at k = 0), W0 = F^-1(1/2) with the plan's F (`plan.completion_wait`'s), and every later step
  ends a period after the one before: fill = W0 + T_train - P. Where training bounds the period
  (P = T_train) the whole first wait is fill: on R2E-Gym late, 64 prompts, k = 2, 935 s on a
  672 s period, and over 12 steps the plan ran 5,959 tok/s (`static-optimal`, 707 s a step)
  against 6,483 for APRIL's pipeline, whose periods the steady state priced alike (672 against
  673 s);
- colocated partial: the first step has no carried groups, so its rollout stops when T of the
  o T groups started together are done, R0 = F^-1(1/o) with F as in *turnover*: fill = R0 - R
  (at least 0).
Without `steps` (None) the steady state decides.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

from libra.costmodel.training import TrainParallel
from libra.planner.layouts import RolloutEvaluator, top_context
from libra.planner.plan import BucketPlan, Plan
from libra.planner.planner import GlobalPlanner
from libra.planner.stats import WorkloadStats

DISAGGREGATED = "disaggregated"
COLOCATED_PARTIAL = "colocated-partial"


@dataclass(frozen=True, slots=True)
class ColocatedPartial:
    """The colocated pipeline with partial rollouts that a workload may run instead of the plan:
    engines of one TP on every GPU, the training parallelism on every GPU, the over-provisioning,
    and the cost of each phase switch."""

    tp: int
    train: TrainParallel
    over_provision: float
    switch_s: float


@dataclass(frozen=True, slots=True)
class ColocatedEstimate:
    """The predicted colocated-partial step and its parts (seconds)."""

    step_time_s: float
    rollout_s: float
    train_s: float
    switch_s: float  # both switches of a step
    work_s: float
    turnover_s: float
    staleness_s: float
    fill_s: float = 0.0  # what a run pays once: its first rollout's excess over R (module docstring)

    def to_dict(self) -> dict:
        return {k: round(getattr(self, k), 3) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class ModeDecision:
    """The pipeline to run, both predicted step times, and why."""

    mode: str  # DISAGGREGATED or COLOCATED_PARTIAL
    disaggregated_s: float  # the plan's predicted step (steady state)
    colocated_s: float  # the colocated-partial prediction (steady state); inf when not a candidate
    reason: str
    colocated: ColocatedEstimate | None = None
    steps: int | None = None  # the run's length the choice was made for; None: the steady state
    disaggregated_fill_s: float = 0.0  # the plan's pipeline fill (module docstring)

    @property
    def partial(self) -> bool:
        return self.mode == COLOCATED_PARTIAL

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "disaggregated_step_s": round(self.disaggregated_s, 3),
            "colocated_partial_step_s": None if math.isinf(self.colocated_s) else round(self.colocated_s, 3),
            "reason": self.reason,
            "steps": self.steps,
            "disaggregated_fill_s": round(self.disaggregated_fill_s, 3),
            **({"colocated_partial": self.colocated.to_dict()} if self.colocated is not None else {}),
        }


def run_step_s(period_s: float, fill_s: float, steps: int | None) -> float:
    """The mean step of a run of `steps` steps: the period plus the fill spread over the run."""
    return period_s if not steps else period_s + fill_s / steps


def _done_at(spread: Sequence[tuple[float, float]], makespan_s: float, work_s: float) -> list[float]:
    """When each group of a batch started together is done (`plan.completion_wait`'s F), sorted;
    without group labels every group ends at the makespan."""
    return sorted(max(lat * makespan_s, shared * work_s) for lat, shared in spread) or [makespan_s]


def first_done_s(
    spread: Sequence[tuple[float, float]], makespan_s: float, work_s: float, share: float
) -> float:
    """F^-1(share): the time until `share` of the groups started together are done."""
    done_at = _done_at(spread, makespan_s, work_s)
    return done_at[max(0, math.ceil(share * len(done_at)) - 1)]


def disaggregated_fill_s(plan: Plan) -> float:
    """The plan's pipeline fill (module docstring, "A run of n steps"): the first step's wait
    for its groups, of the batches that start together, beyond what a period leaves for it."""
    together = 1 + min(plan.staleness, 1)  # the strict gate's lead starts at 1 (`StalenessGate.lead`)
    spread = plan.group_spread if plan.staleness >= 1 else ()
    first = first_done_s(spread, plan.t_rollout_s, plan.rollout_work_s, 1 / together)
    return max(0.0, first + plan.t_train_s - plan.step_time_s)


def turnover_s(spread: Sequence[tuple[float, float]], makespan_s: float, work_s: float, over: float) -> float:
    """The rollout phase R with sum_{i >= 1} (1 - F(i R)) = over - 1 (see the module's docstring):
    the least R at which a step that starts its new groups at once and stops with (over - 1)
    targets still running turns its groups over. Without group labels every group is taken to end
    at the makespan."""
    done_at = _done_at(spread, makespan_s, work_s)
    last, n = done_at[-1], len(done_at)
    if last <= 0:
        return 0.0

    def running(r: float) -> float:  # sum_{i >= 1} (1 - F(i r)): targets still running at a stop
        total, t = 0.0, r
        while t < last:
            total += 1.0 - bisect_right(done_at, t) / n
            t += r
        return total

    lo, hi = last * 1e-6, last
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if running(mid) > over - 1 else (lo, mid)
    return hi


def colocated_partial_step(
    planner: GlobalPlanner, stats: WorkloadStats, mode: ColocatedPartial
) -> ColocatedEstimate | None:
    """The predicted steady-state step of the colocated pipeline with partial rollouts on every GPU
    of `planner.problem`, or None when it cannot run (the TP is not allowed, training does not fit,
    or the staleness bound is 0)."""
    p = planner.problem
    if p.staleness < 1 or not p.tp_allowed(mode.tp) or stats.is_empty or p.gpus < mode.tp:
        return None
    bound = planner.selector.context_bound(stats.max_final)
    cm = planner.train_search.cm
    if not cm.memory(mode.train, bound).fits:
        return None
    train = cm.step(mode.train, stats.batch_lengths(p.batch_size)).step_time_s
    layout = [BucketPlan(mode.tp, p.gpus // mode.tp, top_context(p, stats))]
    makespan = RolloutEvaluator(planner.tables, p, stats).makespan(layout)
    # The over-provisioned load: `over` batches in flight; its work per batch is that over `over`.
    over = max(1.0, mode.over_provision)
    prompts = max(p.prompts_per_step, math.ceil(over * p.prompts_per_step))
    loaded = replace(p, prompts_per_step=prompts)
    work = RolloutEvaluator(planner.tables, loaded, stats).work(layout) * p.prompts_per_step / prompts
    turnover = turnover_s(stats.group_spread(), makespan, work, over)
    stale = makespan / (p.staleness + over)
    rollout = max(work, turnover, stale)
    switches = 2 * mode.switch_s
    fill = max(0.0, first_done_s(stats.group_spread(), makespan, work, 1 / over) - rollout)
    return ColocatedEstimate(
        rollout + train + switches, rollout, train, switches, work, turnover, stale, fill
    )


def choose_mode(
    planner: GlobalPlanner,
    plan: Plan,
    stats: WorkloadStats,
    colocated: ColocatedPartial | None,
    steps: int | None = None,
) -> ModeDecision:
    """The disaggregated `plan` or the colocated-partial pipeline, whichever is predicted to take
    the shorter mean step on `stats` over a run of `steps` steps (each period plus its fill over
    the run; None: the steady state). The plan wins a tie: it is what the planner searched."""
    d = plan.step_time_s
    fill = disaggregated_fill_s(plan)

    def plan_only(why: str) -> ModeDecision:  # the colocated pipeline is no candidate
        return ModeDecision(DISAGGREGATED, d, math.inf, why, None, steps, fill)

    if colocated is None:
        return plan_only("colocated partial rollouts not offered")
    if planner.problem.staleness < 1:
        return plan_only("staleness 0: partial rollouts train tokens one version old")
    est = colocated_partial_step(planner, stats, colocated)
    if est is None:
        return plan_only("colocated partial rollouts cannot run here")
    d_run, c_run = run_step_s(d, fill, steps), run_step_s(est.step_time_s, est.fill_s, steps)
    over = f" over {steps} steps" if steps else ""
    if c_run < d_run:
        why = f"colocated partial rollouts predicted {c_run:.1f} s a step{over}, the plan {d_run:.1f} s"
        return ModeDecision(COLOCATED_PARTIAL, d, est.step_time_s, why, est, steps, fill)
    why = f"the plan predicted {d_run:.1f} s a step{over}, colocated partial rollouts {c_run:.1f} s"
    return ModeDecision(DISAGGREGATED, d, est.step_time_s, why, est, steps, fill)
