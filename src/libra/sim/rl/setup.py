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
from libra.costmodel.speculative import SpecDecoding
from libra.costmodel.training import TrainParallel
from libra.planner import PlanController
from libra.planner.plan import BucketPlan, Plan, pack
from libra.rollout.base import Bucket
from libra.sim.rl.config import RLScenario


@dataclass(slots=True)
class InstanceSpec:
    tp: int
    bucket: int
    node: int


@dataclass(frozen=True, slots=True)
class Mechanisms:
    """How a system's rollout runs beyond its layout and router. Each comes from a peer's paper
    (`sim.rl.peers`); any system may combine them, and the pipeline and the rollout driver carry
    them out (`sim.rl.pipeline`, `sim.rl.driver`)."""

    # AReaL: after every training step the new weights go to the engines at once, interrupting
    # the requests in flight, which then recompute their KV (disaggregated systems).
    interrupt_updates: bool = False
    # APRIL: > 0 keeps this multiple of a step's groups in flight; the step's rollout stops once
    # its target count of groups has finished, and the unfinished ones resume in the next step.
    over_provision: float = 0.0
    chunk_tokens: int = 0  # Seer's divided rollout: at most this many output tokens per submission
    migrate_in_tool: bool = False  # Heddle: the next turn is placed, and its KV moved, during a tool call
    speculative: SpecDecoding | None = None  # Seer: speculative decoding on every engine

    @property
    def partial(self) -> bool:
        return self.over_provision > 0


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
    mechanisms: Mechanisms = field(default_factory=Mechanisms)

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


def packed(
    buckets: list[BucketPlan], hw: HardwareSpec, nodes: int
) -> tuple[list[InstanceSpec], list[Bucket]]:
    """A bucket layout's engines placed on the cluster's nodes, and its buckets."""
    sizes = [b.tp for b in buckets for _ in range(b.instances)]
    where = pack(sizes, nodes, hw.gpus_per_node)
    if where is None:
        raise ConfigError("layout", [(b.tp, b.instances) for b in buckets], f"engines that fit {nodes} nodes")
    bucket_of = [k for k, b in enumerate(buckets) for _ in range(b.instances)]
    instances = [InstanceSpec(tp, k, node) for tp, k, node in zip(sizes, bucket_of, where, strict=True)]
    return instances, [Bucket(f"b{k}-tp{b.tp}", b.tp, b.max_context) for k, b in enumerate(buckets)]


def colocated(sc: RLScenario, hw: HardwareSpec, router: str, params: dict, mech: Mechanisms) -> Setup:
    """Rollout, then training, on every GPU: engines of the scenario's homogeneous TP."""
    total = sc.cluster.nodes * hw.gpus_per_node
    tp = sc.rollout.homogeneous_tp
    return Setup(True, total, homogeneous(0, total, tp, hw), one_bucket(sc, tp), router,
                 train_parallel(sc, total), params, mechanisms=mech)  # fmt: skip


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
    # The smallest `pipeline.staleness` the system can keep (a system that trains tokens written
    # by an older policy needs at least 1), and why; the pipeline refuses a lower bound.
    min_staleness = 0
    needs_staleness = ""
    # The length of the run it is set up for (the pipeline sets it before `setup`): a choice made
    # once per run may weigh what the run pays once (`planner.mode.choose_mode`). None: unknown.
    run_steps: int | None = None
    # The batch the system profiles before training, when the run gives one (a replayed trace:
    # its first step, the data a deployment would profile on); None: the scenario's workload
    # generates one (`planned.profiling_sample`). The pipeline sets it before `setup`.
    sample: list | None = None

    def setup(self, sc: RLScenario, hw: HardwareSpec) -> Setup:
        raise NotImplementedError  # abstract: each system defines its layout

    # The planner's controller (planned systems): fed each finished step, it decides re-plans and
    # the hybrid pool's moves. None: the setup never changes.
    controller: PlanController | None = None

    def setup_for(self, plan: Plan, sc: RLScenario, hw: HardwareSpec, reconfig_s: float = 0.0) -> Setup:
        """The setup that carries out a new plan (systems with a controller)."""
        raise NotImplementedError  # abstract: only systems with a controller re-plan
