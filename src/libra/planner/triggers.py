"""When to re-plan, and when a new plan is worth switching to.

Re-planning is cheap (a search); switching is not (engines restart, training reshards). So the
two are separate decisions:
- `check_triggers` says *whether to search*: every K steps, and on pressure (a full rollout queue,
  a backlog of stale samples, or rollout and training out of balance, T_rollout / T_train outside
  [0.8, 1.25]). Pressure triggers have a short cooldown so one bad step does not search every step.
- `should_apply` says *whether to switch*: only when the predicted gain over the planning horizon
  exceeds the reconfiguration cost, and the per-step gain is at least 5% of the step. The 5%
  floor is what stops thrashing between near-equal plans on a stationary workload, where sampling
  noise alone makes the "best" plan wobble.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

from libra.planner.config import PlannerConfig
from libra.planner.plan import Plan


class Trigger(IntEnum):
    NONE = 0
    INTERVAL = 1
    QUEUE_PRESSURE = 2
    STALE_BACKLOG = 3
    IMBALANCE = 4


@dataclass(frozen=True, slots=True)
class PipelineSignals:
    """A snapshot of the running pipeline, as the mechanism measured it."""

    step: int
    last_plan_step: int | None = None
    last_pressure_step: int | None = None
    queue_fill: float = 0.0  # waiting rollout requests / what the engines admit, 0..1+
    stale_samples: int = 0  # finished samples too stale to train on
    batch_size: int = 1
    t_train_s: float | None = None
    t_rollout_s: float | None = None


def check_triggers(sig: PipelineSignals, cfg: PlannerConfig) -> Trigger:
    """The first reason to re-plan now, or Trigger.NONE."""
    if sig.last_plan_step is None or sig.step - sig.last_plan_step >= cfg.interval_steps:
        return Trigger.INTERVAL
    cooling = (
        sig.last_pressure_step is not None and sig.step - sig.last_pressure_step < cfg.trigger_cooldown_steps
    )
    if cooling:
        return Trigger.NONE
    if sig.queue_fill >= cfg.queue_pressure:
        return Trigger.QUEUE_PRESSURE
    if sig.stale_samples >= cfg.stale_backlog * sig.batch_size:
        return Trigger.STALE_BACKLOG
    if sig.t_train_s and sig.t_rollout_s is not None:
        ratio = sig.t_rollout_s / sig.t_train_s
        if not cfg.ratio_low <= ratio <= cfg.ratio_high:
            return Trigger.IMBALANCE
    return Trigger.NONE


@dataclass(frozen=True, slots=True)
class ApplyVerdict:
    apply: bool
    gain_s: float  # predicted step-time saving per step
    gain_fraction: float
    cost_s: float
    reason: str


def should_apply(
    current: Plan, candidate: Plan, reconfig_cost_s: float, horizon_steps: int = 10, min_gain: float = 0.05
) -> ApplyVerdict:
    """Apply `candidate` only if (gain over the horizon - cost) > 0 and the gain is >= min_gain.

    Both plans must be priced on the same workload statistics (`GlobalPlanner.evaluate`).
    """
    cur, new = current.step_time_s, candidate.step_time_s
    if current.layout_key() == candidate.layout_key():
        return ApplyVerdict(False, 0.0, 0.0, 0.0, "the candidate is the current layout")
    if math.isinf(cur) and not math.isinf(new):
        return ApplyVerdict(
            True, math.inf, 1.0, reconfig_cost_s, "the current plan no longer fits the workload"
        )
    gain = cur - new
    frac = gain / cur if cur > 0 else 0.0
    if frac < min_gain:
        return ApplyVerdict(False, gain, frac, reconfig_cost_s, f"gain {frac:.1%} < {min_gain:.0%}")
    if gain * horizon_steps - reconfig_cost_s <= 0:
        return ApplyVerdict(
            False, gain, frac, reconfig_cost_s,
            f"gain {gain * horizon_steps:.1f} s over {horizon_steps} steps <= cost {reconfig_cost_s:.1f} s",
        )  # fmt: skip
    return ApplyVerdict(
        True, gain, frac, reconfig_cost_s, f"gain {frac:.1%} per step, cost {reconfig_cost_s:.1f} s"
    )
