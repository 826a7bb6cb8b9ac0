"""Systems whose layout comes from Libra's global planner (issue: planner, elastic pool, ladder).

Every planned system starts from a plan made on a profiling sample: the first step's batch from the
scenario's workload, as a real deployment profiles before training. After that the planner reads
only finished steps (a sliding window), never future lengths. The ablation ladder adds one
mechanism per rung:

| system | planner | layout | router | re-planned | elastic |
| --- | --- | --- | --- | --- | --- |
| static-optimal | homogeneous | one TP | least-loaded | no | no |
| greedy-heuristic | greedy shift | one TP | least-loaded | every step | no |
| ablation:planner | homogeneous | one TP | least-loaded | yes | no |
| ablation:hetero-tp | libra | TP buckets | least-loaded | yes | no |
| ablation:cmlfq | libra | TP buckets | cmlfq | yes | no |
| libra | libra | TP buckets | cmlfq | yes | yes |
| planned:ROUTER | libra | TP buckets | any registered router | yes | no |
"""

from __future__ import annotations

import random

from libra.core.specs import HardwareSpec
from libra.costmodel.catalog import load_catalog
from libra.planner import (
    PipelineSignals,
    Plan,
    PlannerConfig,
    PlanningProblem,
    WorkloadStats,
    check_triggers,
    diff,
    make_planner,
    reconfig_cost_s,
)
from libra.planner.plan import place
from libra.planner.triggers import Trigger
from libra.rollout.base import Bucket
from libra.sim.rl.config import RLScenario
from libra.sim.rl.systems import SYSTEM_FAMILIES, SYSTEMS, InstanceSpec, Setup, System

WINDOW_STEPS = 3  # finished steps the planner's statistics cover

# The ablation ladder, bottom rung first: (system, the mechanism that rung adds).
LADDER = (
    ("static-uniform", "baseline: the scenario's split, one TP, least-loaded"),
    ("ablation:planner", "+ global planner (split, parallelism, one TP), re-planned"),
    ("ablation:hetero-tp", "+ heterogeneous TP buckets (least-loaded routing)"),
    ("ablation:cmlfq", "+ C-MLFQ routing"),
    ("libra", "+ elastic hybrid pool"),
)


def problem_of(sc: RLScenario, hw: HardwareSpec) -> PlanningProblem:
    cat = load_catalog()
    w = sc.workload
    return PlanningProblem(hw, sc.cluster.nodes, cat.model(sc.model), int(w["prompts_per_step"]),
                           int(w["samples_per_prompt"]), int(w["max_length"]), sc.rollout.max_num_seqs,
                           sc.rollout.max_num_batched_tokens, sc.rollout.gpu_memory_utilization,
                           staleness=sc.pipeline.staleness, consume=sc.pipeline.consume,
                           engine=sc.rollout.engine)  # fmt: skip


def setup_of(plan: Plan, hw: HardwareSpec, router: str, params: dict, reconfig_s: float = 0.0) -> Setup:
    where = place(plan, hw.gpus_per_node)
    instances = [InstanceSpec(b.tp, i, node) for i, b in enumerate(plan.buckets) for node in where.engines[i]]
    buckets = [Bucket(f"b{i}-tp{b.tp}", b.tp, b.max_context) for i, b in enumerate(plan.buckets)]
    return Setup(False, plan.train_gpus, instances, buckets, router, plan.train, dict(params),
                 reconfig_s=reconfig_s, plan=plan)  # fmt: skip


class PlannedSystem(System):
    planner = "libra"
    replan = True
    elastic = False

    def __init__(self):
        self._planner = None
        self._last_plan_step: int | None = None
        self._last_pressure: int | None = None

    def _make(self, sc: RLScenario, hw: HardwareSpec):
        """The planner; systems of one run with the same planner share it (it keeps no state of
        its own between decisions, only memoised searches)."""
        params = dict(sc.planner) if getattr(sc, "planner", None) else {}
        shared = self.shared if self.shared is not None else {}
        key = ("planner", self.planner, repr(sorted(params.items())))
        if key not in shared:
            shared[key] = make_planner(self.planner, problem_of(sc, hw), PlannerConfig(**params))
        self._planner = shared[key]
        return self._planner

    def setup(self, sc: RLScenario, hw: HardwareSpec) -> Setup:
        planner = self._make(sc, hw)
        from libra.sim.workloads import WorkloadConfig, make_workload

        sample = make_workload(WorkloadConfig(**sc.workload)).generate(0, random.Random(12345))
        stats = WorkloadStats.from_trajectories(
            sample, default_tool_latency_s=sc.pipeline.tool_latency_default_s
        )
        plan = planner.decide(stats, None).plan
        self._last_plan_step = 0
        return setup_of(plan, hw, self.router, sc.rollout.router_params)

    def between_steps(self, sc, hw, history, current: Setup) -> Setup | None:
        if not self.replan or not history:
            return None
        last = history[-1]
        sig = PipelineSignals(step=last["step"], last_plan_step=self._last_plan_step,
                              last_pressure_step=self._last_pressure, batch_size=len(last["lengths"]),
                              t_train_s=last["train_time"], t_rollout_s=last["rollout_end"] - last["rollout_start"])  # fmt: skip
        trig = check_triggers(sig, self._planner.config)
        if trig == Trigger.NONE:
            return None
        if trig != Trigger.INTERVAL:
            self._last_pressure = last["step"]
        self._last_plan_step = last["step"]
        window = [t for r in history[-WINDOW_STEPS:] for t in r["trajs"]]
        stats = WorkloadStats.from_trajectories(window, train_time_s=last["train_time"],
                                                rollout_time_s=sig.t_rollout_s,
                                                default_tool_latency_s=sc.pipeline.tool_latency_default_s)  # fmt: skip
        dec = self._planner.decide(stats, current.plan)
        new = dec.plan
        if new == current.plan:
            return None
        cost = reconfig_cost_s(diff(current.plan, new), self._planner.elastic)
        return setup_of(new, hw, self.router, sc.rollout.router_params, reconfig_s=cost)


def _system(name: str, planner: str, router: str, replan: bool, elastic: bool = False) -> type[PlannedSystem]:
    attrs = {"name": name, "planner": planner, "router": router, "replan": replan, "elastic": elastic}
    return type(name.replace(":", "_").replace("-", "_").title(), (PlannedSystem,), attrs)


PLANNED = [
    _system("static-optimal", "homogeneous", "least-loaded", replan=False),
    _system("greedy-heuristic", "greedy", "least-loaded", replan=True),
    _system("ablation:planner", "homogeneous", "least-loaded", replan=True),
    _system("ablation:hetero-tp", "libra", "least-loaded", replan=True),
    _system("ablation:cmlfq", "libra", "cmlfq", replan=True),
    _system("libra", "libra", "cmlfq", replan=True, elastic=True),
]
SYSTEMS.update({cls.name: cls for cls in PLANNED})
# The planned systems whose planner may split the rollout into buckets by length (and may not).
BUCKETED = tuple(cls.name for cls in PLANNED if cls.planner == "libra")


def planned_with(router: str) -> PlannedSystem:
    """`planned:ROUTER`: the `ablation:hetero-tp` rung (re-planned heterogeneous buckets) with any
    router. `planned:oracle` is the ceiling of length-aware routing on the planner's layouts."""
    system = SYSTEMS["ablation:hetero-tp"]()  # an instance with its own name and router, no new class
    system.name, system.router = f"planned:{router}", router
    return system


SYSTEM_FAMILIES["planned"] = planned_with
