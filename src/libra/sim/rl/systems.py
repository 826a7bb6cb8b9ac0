"""The simulated systems compared by `libra simulate`, listed here by name.

Static systems (`verl-colocated`, `static-uniform`, `router:NAME`, `colocated:NAME`) are defined
in this module; the planner-driven ones (the ablation ladder, `planned:NAME`) in `planned.py`; the
peers a team would pick instead (`areal`, `april`, `seer`, `heddle`) in `peers.py`. `router:NAME`
names the disaggregated heterogeneous layout with router NAME from `libra.rollout.registry`, and
`colocated:NAME` verl-colocated with router NAME, so every router is a system without registering
it twice; NAME may be an outside router's `pkg.module:Class`.
"""

from __future__ import annotations

from collections.abc import Callable

from libra.core.errors import ConfigError
from libra.core.registry import Registry
from libra.sim.rl.peers import PEERS
from libra.sim.rl.planned import PLANNED, planned_with
from libra.sim.rl.setup import (
    Setup,
    System,
    buckets_of,
    heterogeneous,
    homogeneous,
    one_bucket,
    train_parallel,
)


class VerlColocated(System):
    """Synchronous: rollout on every GPU, then training on every GPU, switching each way."""

    name = "verl-colocated"

    def __init__(self, router: str | None = None):
        if router is not None:  # `colocated:ROUTER`: the same pipeline, another dispatch
            self.router, self.name = router, f"colocated:{router}"

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


SYSTEMS: Registry[type[System]] = Registry(
    "system", "systems", (VerlColocated, StaticUniform, *PLANNED, *PEERS), outside=False
)
# Families of systems that differ only in the router: `PREFIX:ROUTER` for every registered router.
SYSTEM_FAMILIES: Registry[Callable[[str], System]] = Registry(
    "system family",
    "systems",
    {"router": RouterSystem, "planned": planned_with, "colocated": VerlColocated},
    outside=False,
)


def known_systems() -> list[str]:
    from libra.rollout.registry import ROUTERS

    return sorted(SYSTEMS) + [f"{f}:{r}" for f in sorted(SYSTEM_FAMILIES) for r in sorted(ROUTERS)]


def make_system(name: str) -> System:
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
