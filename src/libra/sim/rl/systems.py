"""Simulated systems: how each one lays out the cluster and routes, before and between steps.

A system is a small class registered by name. `setup` returns the static decisions (colocated or
disaggregated, GPU split, rollout instances and buckets, router, training parallelism);
`between_steps` may return a new setup (planners, elastic pools). The pipeline mechanism in
`libra.sim.rl.pipeline` carries these decisions out; a system never touches the clock.

`router:NAME` names the disaggregated heterogeneous layout with router NAME from
`libra.rollout.registry`, so every router is a system without registering it twice; NAME may be
an outside router's `pkg.module:Class`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec
from libra.costmodel.training import TrainParallel
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
    return [Bucket("all", tp, int(sc.workload.get("max_length", sc.rollout.buckets[-1].max_context)))]


def buckets_of(sc: RLScenario) -> list[Bucket]:
    return [Bucket(b.name, b.tp, b.max_context) for b in sc.rollout.buckets]


class System:
    """Base: a static system never changes its setup."""

    name = ""
    elastic = False  # whether the pipeline runs the elastic hybrid pool for this system
    # A run-scoped cache the driver hands to every system of one simulation, so that pure,
    # expensive helpers (a planner and its memoised searches) are built once per run.
    shared: dict | None = None
    router = "least-loaded"  # the router its setups name (`rollout.router_params` are checked against it)

    def setup(self, sc: RLScenario, hw: HardwareSpec) -> Setup:
        raise NotImplementedError  # abstract: each system defines its layout

    def between_steps(
        self, sc: RLScenario, hw: HardwareSpec, history: list[dict], current: Setup
    ) -> Setup | None:
        return None


class VerlColocated(System):
    """Synchronous: rollout on every GPU, then training on every GPU, switching each way."""

    name = "verl-colocated"

    def setup(self, sc, hw):
        total = sc.cluster.nodes * hw.gpus_per_node
        tp = sc.rollout.homogeneous_tp
        return Setup(
            True,
            total,
            homogeneous(0, total, tp, hw),
            one_bucket(sc, tp),
            self.router,
            train_parallel(sc, total),
            dict(sc.rollout.router_params),
        )


class StaticUniform(System):
    """Disaggregated and asynchronous: the scenario's fixed split, homogeneous TP, least-loaded."""

    name = "static-uniform"

    def setup(self, sc, hw):
        tr, ro, tp = sc.split.train_gpus, sc.split.rollout_gpus, sc.rollout.homogeneous_tp
        return Setup(False, tr, homogeneous(tr, ro, tp, hw), one_bucket(sc, tp), self.router,
                     train_parallel(sc, tr), dict(sc.rollout.router_params))  # fmt: skip


class RouterSystem(System):
    """The scenario's split with the heterogeneous bucket layout; only the router differs."""

    def __init__(self, router: str):
        self.router, self.name = router, f"router:{router}"

    def setup(self, sc, hw):
        tr, ro = sc.split.train_gpus, sc.split.rollout_gpus
        return Setup(False, tr, heterogeneous(sc, tr, ro, hw), buckets_of(sc), self.router,
                     train_parallel(sc, tr), dict(sc.rollout.router_params))  # fmt: skip


SYSTEMS: dict[str, type[System]] = {c.name: c for c in (VerlColocated, StaticUniform)}
# Families of systems that differ only in the router: `PREFIX:ROUTER` for every registered router.
SYSTEM_FAMILIES: dict[str, Callable[[str], System]] = {"router": RouterSystem}


def _register_planned() -> None:
    import libra.sim.rl.planned  # noqa: F401  (registers the planner-driven systems)


def known_systems() -> list[str]:
    from libra.rollout.registry import ROUTERS

    _register_planned()

    return sorted(SYSTEMS) + [f"{f}:{r}" for f in sorted(SYSTEM_FAMILIES) for r in sorted(ROUTERS)]


def make_system(name: str) -> System:
    _register_planned()
    if name in SYSTEMS:
        return SYSTEMS[name]()
    family, _, router = name.partition(":")
    if family in SYSTEM_FAMILIES:
        from libra.rollout.registry import ROUTERS, router_class

        if router in ROUTERS:
            return SYSTEM_FAMILIES[family](router)
        if ":" in router:  # a plug-in router, `router:pkg.mod:Class`: fail now if it does not import
            try:
                router_class(router)
            except ConfigError as e:
                raise ConfigError("systems", name, e.allowed) from None
            return SYSTEM_FAMILIES[family](router)
    raise ConfigError("systems", name, known_systems() + ["PREFIX:pkg.module:Class"])
