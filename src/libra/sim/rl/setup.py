"""What a simulated system decides before the first step: its `Setup`, and the base `System`.

A `Setup` is the static part of a system's decisions (colocated or disaggregated, GPU split,
rollout instances and buckets, router, training parallelism). A system whose layout changes
between steps (the planned ones) also has a `controller`, the planner's pure `PlanController`;
the pipeline (`libra.sim.rl.pipeline`) feeds it each step's report and carries its decisions out.
A system never touches the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec
from libra.costmodel.training import TrainParallel
from libra.planner import PlanController
from libra.planner.plan import Plan
from libra.rollout.base import Bucket
from libra.sim.rl.config import RLScenario


@dataclass(slots=True)
class InstanceSpec:
    tp: int
    bucket: int
    node: int


@dataclass(slots=True)
class Setup:
    colocated: bool
    train_gpus: int
    instances: list[InstanceSpec]
    buckets: list[Bucket]
    router: str
    train: TrainParallel
    router_params: dict = field(default_factory=dict)
    reconfig_s: float = 0.0  # what switching to this setup costs (planned systems)
    plan: object = None  # the planner's Plan behind this setup, if any

    @property
    def rollout_gpus(self) -> int:
        return sum(i.tp for i in self.instances)


def train_parallel(sc: RLScenario, gpus: int) -> TrainParallel:
    t = sc.train
    per_replica = t.tp * t.pp * t.cp
    if gpus % per_replica:
        raise ConfigError("split.train_gpus", gpus, f"a multiple of tp*pp*cp = {per_replica}")
    return TrainParallel(t.tp, t.pp, gpus // per_replica, t.cp, t.micro_batch, t.recompute)


def homogeneous(first_gpu: int, gpus: int, tp: int, hw: HardwareSpec) -> list[InstanceSpec]:
    return [InstanceSpec(tp, 0, (first_gpu + g) // hw.gpus_per_node) for g in range(0, gpus - tp + 1, tp)]


def heterogeneous(sc: RLScenario, first_gpu: int, gpus: int, hw: HardwareSpec) -> list[InstanceSpec]:
    """`layout_per_node` on every rollout node; each instance serves the bucket of its TP."""
    by_tp = {}
    for i, b in enumerate(sc.rollout.buckets):
        by_tp.setdefault(b.tp, i)
    out = []
    for node in range(first_gpu // hw.gpus_per_node, (first_gpu + gpus) // hw.gpus_per_node):
        for tp in sc.rollout.layout_per_node:
            if tp not in by_tp:
                raise ConfigError(
                    "rollout.layout_per_node", tp, f"a TP that some bucket has: {sorted(by_tp)}"
                )
            out.append(InstanceSpec(tp, by_tp[tp], node))
    missing = set(range(len(sc.rollout.buckets))) - {i.bucket for i in out}
    if missing:
        raise ConfigError(
            "rollout.buckets", sc.rollout.buckets[min(missing)].name, "a bucket with at least one instance"
        )
    return out


def one_bucket(sc: RLScenario, tp: int) -> list[Bucket]:
    return [Bucket("all", tp, sc.workload.max_length)]


def buckets_of(sc: RLScenario) -> list[Bucket]:
    return [Bucket(b.name, b.tp, b.max_context) for b in sc.rollout.buckets]


class System:
    """Base: a static system never changes its setup."""

    name = ""
    elastic = False  # whether the pipeline runs the elastic hybrid pool for this system
    tail = False  # whether its router runs the tail lane (`libra.rollout.tail`)
    # A run-scoped cache the driver hands to every system of one simulation, so that pure,
    # expensive helpers (a planner and its memoised searches) are built once per run.
    shared: dict | None = None
    router = "least-loaded"  # the router its setups name (`rollout.router_params` are checked against it)

    def setup(self, sc: RLScenario, hw: HardwareSpec) -> Setup:
        raise NotImplementedError  # abstract: each system defines its layout

    # The planner's controller (planned systems): fed each finished step, it decides re-plans and
    # the hybrid pool's moves. None: the setup never changes.
    controller: PlanController | None = None

    def setup_for(self, plan: Plan, sc: RLScenario, hw: HardwareSpec, reconfig_s: float = 0.0) -> Setup:
        """The setup that carries out a new plan (systems with a controller)."""
        raise NotImplementedError  # abstract: only systems with a controller re-plan
