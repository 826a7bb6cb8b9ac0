"""Libra's planning policies: the global resource planner, the elastic hybrid pool, EARL's selector.

Why a package of its own: these are the decisions about *where GPUs go* (how many train, how many
roll out, with which parallelism, in which buckets), as opposed to where a request goes
(`libra.rollout`) or where an external action runs (`libra.actions`). They are pure policies: they
read snapshots (`PlanningProblem`, `WorkloadStats`, measured stage times) and return typed
decisions (`Plan`, `PlanDecision`, `ElasticDecision`, `ParallelismSwitch`). They import only
`libra.core` and `libra.costmodel`, so the simulator and the live runtime carry out the same
decisions, and the package never reads a clock (callers time the search).
"""

from libra.planner.config import ElasticConfig, PlannerConfig, SelectorConfig
from libra.planner.controller import ControlDecision, PlanController, PoolView, Replan, StepReport
from libra.planner.elastic import (
    ElasticController,
    ElasticDecision,
    ElasticSignals,
    EngineSlot,
    HybridReplica,
    JoinReplica,
    JoinState,
    ReleaseReplica,
    Role,
    TransitionError,
    hybrid_hosts,
    make_pool,
    phase_seconds,
)
from libra.planner.plan import (
    BucketPlan,
    InFlightBatch,
    Placement,
    Plan,
    PlanDiff,
    check_plan,
    completion_wait,
    diff,
    drain_s,
    pack,
    pipeline_period,
    place,
    reconfig_cost_s,
    restarts_engines,
)
from libra.planner.planner import (
    PLANNERS,
    GlobalPlanner,
    GreedyShiftPlanner,
    HomogeneousPlanner,
    PlanDecision,
    make_planner,
)
from libra.planner.problem import CONSUME, PlanningProblem
from libra.planner.selector import ParallelismSelector, ParallelismSwitch
from libra.planner.staleness import Finished, GroupQueue, StalenessGate
from libra.planner.stats import WorkloadStats
from libra.planner.triggers import ApplyVerdict, PipelineSignals, Trigger, check_triggers, should_apply

__all__ = [
    "CONSUME", "PLANNERS", "ApplyVerdict", "BucketPlan", "InFlightBatch", "ControlDecision", "EngineSlot", "PlanController", "PoolView", "Replan", "StepReport", "hybrid_hosts", "ElasticConfig", "ElasticController", "ElasticDecision",
    "ElasticSignals", "Finished", "GlobalPlanner", "GroupQueue", "GreedyShiftPlanner", "HomogeneousPlanner", "HybridReplica",
    "JoinReplica", "JoinState", "ParallelismSelector", "ParallelismSwitch", "PipelineSignals", "Plan",
    "Placement", "PlanDecision", "PlanDiff", "PlannerConfig", "PlanningProblem", "ReleaseReplica", "Role",
    "SelectorConfig", "StalenessGate", "TransitionError", "Trigger", "WorkloadStats", "check_plan", "check_triggers",
    "completion_wait", "diff", "drain_s", "restarts_engines", "make_planner", "make_pool", "pack", "phase_seconds", "pipeline_period", "place", "reconfig_cost_s", "should_apply",
]  # fmt: skip
