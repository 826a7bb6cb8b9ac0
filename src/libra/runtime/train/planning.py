"""The planner, live: the simulator's `PlanController`, fed each live step's measured report.

Why an adapter and nothing more: the decision is policy (`libra.planner.controller`), and the same
object decides in simulation and here. This module only turns what `libra train` measured into a
`StepReport` (the step's trajectories as the planner sees them, the train time, the batch's
rollout makespan, the rollout pressure) and the pool into a `PoolView`; the driver carries the
decision out at the step boundary and logs `decision.log()` in steps.json.

Re-planning, live: the planner is the `FleetPlanner` (`libra.planner.fleet`), the global planner's
search restricted to what a running fleet can change at a step boundary (how many engines serve
each bucket, and the boundaries), priced by the same tables on the built-in model's catalog entry
(`builtin-<model>` on `cpu-host`, the `libra-builtin` engine preset, each engine's KV cache as
configured). Every engine is priced at TP 1: the built-in engine runs on one core whatever its TP
label. `fleet.py` carries a re-plan out; the split moves only through the elastic pool (`pool.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from libra.core.specs import ModelSpec
from libra.core.trajectory import ToolStatus
from libra.core.trajectory import Trajectory as PlanTrajectory
from libra.core.trajectory import Turn as PlanTurn
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import Profile
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.training import TrainParallel
from libra.planner import BucketPlan, ElasticController, Plan, PlanController, PoolView, StepReport
from libra.planner.config import SelectorConfig
from libra.planner.controller import ControlDecision
from libra.planner.cpu_fit import MIB, CpuFitSelector, DenseDims
from libra.planner.fleet import FleetPlanner
from libra.planner.problem import PlanningProblem
from libra.planner.staleness import Finished
from libra.runtime.engine.sources import resolve
from libra.runtime.train import cluster as procs
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.rollout import Group
from libra.runtime.train.trajectory import Trajectory, TrajState

BUILTIN_HARDWARE, BUILTIN_ENGINE = (
    "cpu-host",
    "libra-builtin",
)  # the catalog's entries for the built-in engine


def plan_trajectory(t: Trajectory, step: int) -> PlanTrajectory:
    """A live trajectory as the planner's statistics read it: prompt, outputs, tool returns and
    latencies (a tool return is the tokens between one turn's sample and the next turn's prompt)."""
    turns = []
    for k, turn in enumerate(t.turns):
        nxt = t.turns[k + 1] if k + 1 < len(t.turns) else None
        tool = t.tools[k] if k < len(t.tools) else None
        ret = len(nxt.prompt_ids) - len(turn.prompt_ids) - len(turn.token_ids) if nxt else 0
        status = ToolStatus.SUCCESS if tool is None or tool.status == "success" else ToolStatus.FAILURE
        turns.append(PlanTurn(len(turn.token_ids), "calc" if nxt else None, max(0, ret), status,
                              tool.seconds if tool and nxt else None))  # fmt: skip
    prompt = len(t.turns[0].prompt_ids) if t.turns else 0
    return PlanTrajectory(t.id, t.problem_id, step, prompt, turns)


def rollout_makespan(groups: Sequence[Finished[Group]]) -> float:
    """The batch's rollout time: first turn started to last turn ended, over the step's groups."""
    turns = [turn for f in groups for t in f.group.trajs for turn in t.turns]
    if not turns:
        return 0.0
    return max(x.ended for x in turns) - min(x.started for x in turns)


def step_report(
    step: int, groups: Sequence[Finished[Group]], t_train_s: float, pressure: float
) -> StepReport:
    trajs = [plan_trajectory(t, step) for f in groups for t in f.group.trajs if t.state == TrajState.FINISHED]
    return StepReport(step, trajs, t_train_s, rollout_makespan(groups), pressure)


def live_problem(cfg: TrainConfig) -> PlanningProblem:
    """The planning problem of a live run: its model and engines as the cost model knows them."""
    cat, e = load_catalog(), cfg.engine
    model = catalog_model(cfg) if not e.builtin else cat.model(f"builtin-{e.model}", "engine.model")
    hw, batched = cat.hardware(BUILTIN_HARDWARE), procs.batched_tokens(cfg)
    # The cost model derives an engine's KV cache from its memory; give the host exactly the
    # memory that leaves the engine's configured --kv-cache-mb for KV.
    probe = RolloutCostModel(hw, model, 1, Profile().rollout, 1.0, batched, BUILTIN_ENGINE, e.max_num_seqs)
    memory = hw.memory_bytes - probe.kv_budget_bytes() + e.kv_cache_mb * MIB
    hw = hw.model_copy(update={"memory_gib": memory / 2**30})
    r, p = cfg.rollout, cfg.pipeline
    return PlanningProblem(hw, 1, model, r.groups_per_step, r.group_size, max(b.max_context for b in cfg.buckets),
                           e.max_num_seqs, batched, 1.0, staleness=p.staleness, consume=p.consume,
                           engine=BUILTIN_ENGINE)  # fmt: skip


def catalog_model(cfg: TrainConfig) -> ModelSpec:
    """A checkpoint model as the cost model reads it: its shape from its own config. (Priced on the
    built-in engine's CPU terms, which were fitted on the built-in model: a first estimate.)"""
    p = resolve(cfg.engine.model, cfg.engine.max_model_len, "engine.model").spec
    return ModelSpec(name=f"checkpoint-{p.arch}", layers=p.n_layers, hidden=p.d_model, heads=p.n_heads,
                     kv_heads=p.n_kv_heads, head_dim=p.head_dim, intermediate=p.d_ff, vocab=p.vocab_size,
                     bytes_per_param=4, source=cfg.engine.model)  # fmt: skip


def fleet_plan(cfg: TrainConfig, instances: Sequence[int], tops: Sequence[int]) -> Plan:
    """A layout of the live fleet as the planner reads it: bucket k of the config with
    `instances[k]` engines up to `tops[k]` tokens; every engine priced at TP 1 (one core)."""
    lows = [0, *tops[:-1]]
    buckets = tuple(BucketPlan(1, n, top, low) for n, top, low in zip(instances, tops, lows, strict=True))
    engines, dp = sum(instances), cfg.trainer.replicas
    return Plan(engines + dp, dp, engines, TrainParallel(dp=dp), buckets, 0.0, 0.0, tops[-1], planner=FleetPlanner.name,
                staleness=cfg.pipeline.staleness)  # fmt: skip


def initial_plan(cfg: TrainConfig) -> Plan:
    return fleet_plan(cfg, [b.instances for b in cfg.buckets], [b.max_context for b in cfg.buckets])


def make_controller(cfg: TrainConfig) -> PlanController:
    """The run's controller: the fleet planner (`planner.replan`), the elastic policy (`elastic`)."""
    el = cfg.elastic
    planner = FleetPlanner(live_problem(cfg), cfg.planner.policy, el.policy)
    return PlanController(planner, replan=cfg.planner.replan,
                          elastic=ElasticController(el.policy) if el.enabled else None, run_steps=cfg.steps)  # fmt: skip


def decide(ctrl: PlanController, report: StepReport, current: Plan, pool: PoolView | None) -> ControlDecision:
    return ctrl.observe(report, current, pool)


def decision_log(dec: ControlDecision, report: StepReport) -> dict:
    """steps.json's `planner`: the decision with its reason, and what it was decided on."""
    ratio = report.t_train_s / report.t_rollout_s if report.t_rollout_s > 0 else None
    measured = {"t_train_s": report.t_train_s, "t_rollout_s": report.t_rollout_s, "ratio": ratio,
                "rollout_pressure": report.rollout_pressure, "trajectories": len(report.trajectories)}  # fmt: skip
    return {**dec.log(), "report": measured}


class StageLayout:
    """EARL's selector before each training stage: the micro-batch packing for the step's context
    range (`planner.cpu_fit`, the built-in model's memory model against `trainer.memory_budget_mb`).
    Packings that would not fit are refused and logged with the reason; if none fits, the step is
    refused (`InfeasibleError`), never truncated."""

    def __init__(self, cfg: TrainConfig):
        t = cfg.trainer
        dims = DenseDims.of(resolve(cfg.engine.model, cfg.engine.max_model_len, "engine.model").spec)
        # `trainer.micro_batch_tokens` is the largest packing it may choose (the default run's).
        packings = tuple(p for p in (1 << k for k in range(8, 18)) if p <= t.micro_batch_tokens) or (
            t.micro_batch_tokens,
        )
        self.selector = CpuFitSelector(dims, t.memory_budget_mb * MIB, packings, SelectorConfig(edges=list(t.context_edges)))  # fmt: skip

    def before(self, samples: Sequence[TrainSample]) -> tuple[int, dict]:
        """(tokens per micro-batch, the log entry) for this step's longest sample."""
        longest = max((len(s.ids) for s in samples), default=1)
        fit = self.selector.choose(longest)
        changed = self.selector.observe(longest) is not None
        log = {"longest": longest, "context_bound": fit.context_bound, "micro_batch_tokens": fit.packed_tokens,
               "mib": round(fit.bytes / MIB, 1), "changed": changed, "reason": fit.reason, "refused": list(fit.refused)}  # fmt: skip
        return fit.packed_tokens, log
