"""Systems whose layout comes from Libra's global planner, through its controller (`libra.planner`).

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
| libra | libra, or colocated partial rollouts | TP buckets | cmlfq | yes | yes |
| libra+tail | as libra | TP buckets | cmlfq, with the tail lane | yes | yes |
| planned:ROUTER | libra | TP buckets | any registered router | yes | no |
| libra+interrupt | as libra | TP buckets | cmlfq | yes | yes |
| libra+heddle | as libra | TP buckets | heddle | yes | yes |

`libra+interrupt` and `libra+heddle` are `libra` with a peer's rollout mechanisms on its plan
(`PEER_TAKES`): AReaL's interruptible weight updates, and Heddle's progressive priority with
migration during tool calls (which happens only where its router moves a trajectory to another
bucket: never on a one-bucket plan). They measure whether Libra should take them (docs/peers.md, "What
Libra takes"): a mechanism that pays on no cell of the map is not one the planner chooses.

`libra` also chooses its pipeline (`planner.mode.choose_mode`): before the first step it predicts,
from the profiling sample and the planner's cost model, the step of its disaggregated plan and
that of a colocated pipeline with partial rollouts (APRIL's mechanism: engines of the scenario's
homogeneous TP on every GPU, `peers.april.over_provision` times a step's groups in flight,
least-loaded routing), and runs the shorter over the run's length (each steady-state period plus
its pipeline's fill spread over the run's steps, `System.run_steps`). The choice is made once: a run that starts colocated
stays colocated (no re-plan, no elastic pool; the planner's re-plans are disaggregated plans, and a
switch between the two pipelines is not priced). At `pipeline.staleness` 0 only the plan is a
candidate. `libra+tail` chooses the same way; its tail lane runs only in the disaggregated mode.
Live, `libra train --set pipeline.mode=colocated-partial` runs the same pipeline with the same
`PartialRollout` object (`runtime/train/partial.py`); there the mode is set, not chosen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from libra.core.specs import HardwareSpec
from libra.costmodel.catalog import load_catalog
from libra.planner import ElasticController, Plan, PlanController, make_planner
from libra.planner.mode import ColocatedPartial, ModeDecision, choose_mode
from libra.planner.plan import place
from libra.planner.stats import WorkloadStats
from libra.rollout.base import Bucket
from libra.sim.rl.config import RLScenario, problem_of
from libra.sim.rl.setup import InstanceSpec, Mechanisms, Setup, System, colocated, train_parallel
from libra.sim.workloads import make_workload

# The profiling sample the first plan is made from: step 0 of the workload on a stream of its
# own (a deployment profiles before training; the sample is not a batch any system runs).
PROFILE_SEED = 12345


@dataclass(frozen=True, slots=True)
class Rung:
    """One rung of the ablation ladder: its system, the mechanism it adds (a short name for the
    gains map's tables and plots), and what that is in words."""

    system: str
    mechanism: str
    adds: str


# The ablation ladder, bottom rung first.
LADDER = (
    Rung("static-uniform", "baseline", "baseline: the scenario's split, one TP, least-loaded"),
    Rung("ablation:planner", "planner", "+ global planner (split, parallelism, one TP), re-planned"),
    Rung("ablation:hetero-tp", "hetero-tp", "+ heterogeneous TP buckets (least-loaded routing)"),
    Rung("ablation:cmlfq", "cmlfq", "+ C-MLFQ routing"),
    # `libra` also chooses its pipeline (`planner.mode`): where it runs colocated partial rollouts,
    # this rung's gain is that choice, not the pool (which the colocated mode does not run).
    Rung("libra", "elastic", "+ elastic hybrid pool, or colocated partial rollouts"),
    Rung("libra+tail", "tail", "+ tail lane: stragglers on engines of their own as the batch drains"),
)


def shared_planner(shared: dict | None, name: str, sc: RLScenario, hw: HardwareSpec):
    """The planner `name` for this scenario; systems of one run with the same planner share it
    through the run's `System.shared` (it keeps no state of its own between decisions, only
    memoised searches)."""
    shared = shared if shared is not None else {}
    key = ("planner", name, sc.planner.model_dump_json())
    if key not in shared:
        problem = problem_of(sc, hw, load_catalog())
        shared[key] = make_planner(name, problem, sc.planner, elastic=sc.elastic, selector=sc.selector)
    return shared[key]


def profiling_sample(sc: RLScenario, system: System | None = None) -> list:
    """The batch a system profiles before training: the run's (`System.sample`, a replayed
    trace's first step) or else step 0 of the workload on a stream of its own."""
    if system is not None and system.sample is not None:
        return list(system.sample)
    return make_workload(sc.workload).generate(0, random.Random(PROFILE_SEED))


def setup_of(plan: Plan, hw: HardwareSpec, router: str, params: dict, reconfig_s: float = 0.0) -> Setup:
    where = place(plan, hw.gpus_per_node)
    instances = [InstanceSpec(b.tp, i, node) for i, b in enumerate(plan.buckets) for node in where.engines[i]]
    buckets = [Bucket(f"b{i}-tp{b.tp}", b.tp, b.max_context) for i, b in enumerate(plan.buckets)]
    return Setup(False, plan.train_gpus, instances, buckets, router, plan.train, dict(params),
                 reconfig_s=reconfig_s, plan=plan)  # fmt: skip


class PlannedSystem(System):
    """A system whose layout the planner's controller decides, before the first step and after each."""

    planner = "libra"
    replan = True
    elastic = False
    # Whether the planner may run colocated partial rollouts instead of its plan (`choose_mode`),
    # and what it chose (None for a system that does not choose).
    modes = False
    mode_decision: ModeDecision | None = None
    # A peer's rollout mechanisms this system runs on its plan (a key of `PEER_TAKES`), or "".
    takes = ""

    def setup(self, sc: RLScenario, hw: HardwareSpec) -> Setup:
        elastic = ElasticController(sc.elastic) if self.elastic else None
        planner = shared_planner(self.shared, self.planner, sc, hw)
        self.controller = PlanController(planner, self.replan, elastic, sc.pipeline.tool_latency_default_s,
                                         run_steps=self.run_steps)  # fmt: skip
        sample = profiling_sample(sc, self)
        plan = self.controller.initial(sample)
        if self.modes:
            stats = WorkloadStats.from_trajectories(
                sample, default_tool_latency_s=sc.pipeline.tool_latency_default_s
            )
            option = colocated_partial(sc, hw)
            self.mode_decision = choose_mode(planner, plan, stats, option, self.run_steps)
            if self.mode_decision.partial:
                # Colocated for the whole run: no re-plans into the disaggregated mode, no pool.
                self.controller, self.elastic, self.tail = None, False, False
                mech = Mechanisms(over_provision=option.over_provision)
                return colocated(sc, hw, "least-loaded", dict(sc.rollout.router_params), mech)
        return self.setup_for(plan, sc, hw)

    def setup_for(self, plan: Plan, sc: RLScenario, hw: HardwareSpec, reconfig_s: float = 0.0) -> Setup:
        if not self.takes:
            return setup_of(plan, hw, self.router, sc.rollout.router_params, reconfig_s)
        router, params, mech = PEER_TAKES[self.takes](sc)
        setup = setup_of(plan, hw, router or self.router, {**sc.rollout.router_params, **params}, reconfig_s)
        setup.mechanisms = mech
        return setup


def _interrupt(sc: RLScenario) -> tuple[str | None, dict, Mechanisms]:
    """AReaL's: every weight update interrupts the requests in flight, which recompute their KV
    (`peers.areal.interrupt`)."""
    return None, {}, Mechanisms(interrupt_updates=sc.peers.areal.interrupt)


def _heddle(sc: RLScenario) -> tuple[str | None, dict, Mechanisms]:
    """Heddle's: engine queues by predicted remaining length (its router), and the next turn
    placed, its KV moving, while the tool runs; options from `peers.heddle`."""
    cfg = sc.peers.heddle
    return (
        "heddle",
        {"priority": cfg.priority, "oracle": cfg.oracle},
        Mechanisms(migrate_in_tool=cfg.migrate_in_tool),
    )


# A peer's rollout mechanisms, one definition each, for the peer itself (`sim.rl.peers`) and for a
# planned system that takes them: (router or None to keep its own, router params, mechanisms).
PEER_TAKES = {"interrupt": _interrupt, "heddle": _heddle}


def colocated_partial(sc: RLScenario, hw: HardwareSpec) -> ColocatedPartial:
    """The colocated pipeline with partial rollouts `libra` may run instead of its plan: what
    `colocated` lays out, with APRIL's over-provisioning, and the scenario's switch cost."""
    total = sc.cluster.nodes * hw.gpus_per_node
    return ColocatedPartial(sc.rollout.homogeneous_tp, train_parallel(sc, total),
                            sc.peers.april.over_provision, sc.pipeline.switch_s)  # fmt: skip


def _system(name: str, planner: str, router: str, replan: bool, elastic: bool = False,
            tail: bool = False, modes: bool = False, takes: str = "") -> type[PlannedSystem]:  # fmt: skip
    attrs = {
        "takes": takes,
        "name": name,
        "planner": planner,
        "router": router,
        "replan": replan,
        "elastic": elastic,
        "tail": tail,
        "modes": modes,
    }
    return type(name.replace(":", "_").replace("-", "_").title(), (PlannedSystem,), attrs)


PLANNED = (
    _system("static-optimal", "homogeneous", "least-loaded", replan=False),
    _system("greedy-heuristic", "greedy", "least-loaded", replan=True),
    _system("ablation:planner", "homogeneous", "least-loaded", replan=True),
    _system("ablation:hetero-tp", "libra", "least-loaded", replan=True),
    _system("ablation:cmlfq", "libra", "cmlfq", replan=True),
    _system("libra", "libra", "cmlfq", replan=True, elastic=True, modes=True),
    _system("libra+tail", "libra", "cmlfq", replan=True, elastic=True, tail=True, modes=True),
    _system("libra+interrupt", "libra", "cmlfq", replan=True, elastic=True, modes=True, takes="interrupt"),
    _system("libra+heddle", "libra", "cmlfq", replan=True, elastic=True, modes=True, takes="heddle"),
)
# The planned systems whose planner may split the rollout into buckets by length (and may not).
BUCKETED = tuple(cls.name for cls in PLANNED if cls.planner == "libra")


def planned_with(router: str) -> PlannedSystem:
    """`planned:ROUTER`: the `ablation:hetero-tp` rung (re-planned heterogeneous buckets) with any
    router. `planned:oracle` is the ceiling of length-aware routing on the planner's layouts."""
    system = next(cls for cls in PLANNED if cls.name == "ablation:hetero-tp")()  # its own name and router
    system.name, system.router = f"planned:{router}", router
    return system
