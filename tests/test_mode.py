"""Libra's choice of pipeline: its disaggregated plan or colocated partial rollouts (`planner.mode`).

- The decision function picks the shorter predicted step, either way, and at staleness 0 partial
  rollouts are not a candidate.
- The turnover bound: a step that keeps `over` batches in flight turns its groups over faster.
- In the simulator, `libra` runs colocated partial rollouts late in R2E-Gym's training (long
  trajectories) and its plan early, carrying the choice out (no re-plan, no pool, groups carried).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from libra.costmodel.training import TrainParallel
from libra.planner import GlobalPlanner, PlanningProblem, WorkloadStats
from libra.planner.mode import (
    COLOCATED_PARTIAL,
    DISAGGREGATED,
    ColocatedPartial,
    choose_mode,
    colocated_partial_step,
    disaggregated_fill_s,
    run_step_s,
    turnover_s,
)
from libra.sim.rl.pipeline import Batches, RLSim
from libra.sim.rl.systems import make_system
from libra.sim.scenarios import load_scenario
from tests.test_planner import synthetic

COLOCATED = ColocatedPartial(tp=4, train=TrainParallel(4, 1, 12), over_provision=2.0, switch_s=20.0)


@pytest.fixture(scope="module")
def stats() -> WorkloadStats:
    return WorkloadStats.from_trajectories(synthetic(512, 1))


def _planner(catalog, staleness: int) -> GlobalPlanner:
    hw, model = catalog.hardware("a800-80g"), catalog.model("qwen3-14b")
    return GlobalPlanner(PlanningProblem(hw, 6, model, 32, 16, 40960, staleness=staleness))


def test_the_shorter_predicted_step_wins_either_way(catalog, stats):
    planner = _planner(catalog, 1)
    plan = planner.plan(stats)
    est = colocated_partial_step(planner, stats, COLOCATED)
    assert est is not None and est.rollout_s == max(est.work_s, est.turnover_s, est.staleness_s)
    assert est.step_time_s == pytest.approx(est.rollout_s + est.train_s + 2 * COLOCATED.switch_s)
    slow = replace(plan, t_train_s=10 * est.step_time_s)  # a plan whose training alone is longer
    fast = replace(plan, t_train_s=1e-3, t_rollout_s=1e-3, rollout_work_s=0.0, group_spread=())
    picked = choose_mode(planner, slow, stats, COLOCATED)
    assert picked.mode == COLOCATED_PARTIAL and picked.partial and picked.colocated_s == est.step_time_s
    kept = choose_mode(planner, fast, stats, COLOCATED)
    assert kept.mode == DISAGGREGATED and kept.disaggregated_s < kept.colocated_s == est.step_time_s
    assert choose_mode(planner, slow, stats, None).mode == DISAGGREGATED  # not offered


def test_staleness_zero_excludes_partial_rollouts(catalog, stats):
    planner = _planner(catalog, 0)
    slow = replace(planner.plan(stats), t_train_s=1e9)
    d = choose_mode(planner, slow, stats, COLOCATED)
    assert d.mode == DISAGGREGATED and math.isinf(d.colocated_s) and "staleness 0" in d.reason
    assert colocated_partial_step(planner, stats, COLOCATED) is None


def test_more_groups_in_flight_turn_over_faster():
    spread = [(k / 10, k / 10) for k in range(1, 11)]
    once, twice, thrice = (turnover_s(spread, 100.0, 10.0, o) for o in (1.0, 2.0, 3.0))
    assert once == pytest.approx(100.0, rel=1e-6)  # no over-provisioning: the slowest group
    assert thrice < twice < once


def test_a_short_run_weighs_each_pipelines_fill(catalog, stats):
    """Both step predictions are steady-state periods; a run of n steps also pays its pipeline's
    fill once. A plan whose period training bounds, 1 s shorter than the colocated step, keeps the
    plan in the steady state and over a long run, and loses over 12 steps: its first step waits for
    the first groups of two batches (R2E late, 64 prompts, k=2 on the default map: the plan's 672 s
    period against 673 s, and APRIL 1.09x the plan over 12 steps)."""
    planner = _planner(catalog, 2)
    est = colocated_partial_step(planner, stats, COLOCATED)
    assert est is not None and est.fill_s >= 0
    plan = replace(planner.plan(stats), t_train_s=est.step_time_s - 1.0)
    assert plan.step_time_s == pytest.approx(plan.t_train_s)  # training bounds the period
    fill = disaggregated_fill_s(plan)
    assert fill > est.fill_s + 12  # so that 12 steps tip it
    assert run_step_s(plan.step_time_s, fill, 12) == pytest.approx(plan.step_time_s + fill / 12)
    chosen = {n: choose_mode(planner, plan, stats, COLOCATED, n) for n in (None, 12, 10**6)}
    assert chosen[None].mode == chosen[10**6].mode == DISAGGREGATED
    assert (
        chosen[12].mode == COLOCATED_PARTIAL
        and chosen[12].steps == 12
        and "over 12 steps" in chosen[12].reason
    )
    sync = replace(plan, staleness=0)  # one batch at a time: its first step is like any other
    assert disaggregated_fill_s(sync) == pytest.approx(0.0, abs=1e-9)


def _libra(phase: int, staleness: int = 1):
    sc = load_scenario(
        "libra-r2e-48gpu",
        ["cluster.nodes=3", "split.train_gpus=12", "split.rollout_gpus=12", f"workload.first_step={phase}",
         f"pipeline.staleness={staleness}"],
    )  # fmt: skip
    return sc, make_system("libra")


def test_libra_runs_partial_rollouts_late_in_training_and_its_plan_early(catalog):
    sc, early = _libra(0)
    setup = early.setup(sc, catalog.hardware(sc.cluster.hardware))
    assert early.mode_decision.mode == DISAGGREGATED and not setup.colocated and early.controller is not None
    assert not setup.mechanisms.partial
    sc, late = _libra(100)
    sim = RLSim(sc, late, Batches(sc, 0), 2, 0)
    assert late.mode_decision.mode == COLOCATED_PARTIAL
    assert sim.setup.colocated and sim.setup.mechanisms.over_provision == sc.peers.april.over_provision
    assert late.controller is None and sim.pool is None  # no re-plan into the disaggregated mode
    sim.run()
    out = sim.summary()
    assert out["mode"]["mode"] == COLOCATED_PARTIAL and out["carried_groups"] > 0
    assert out["max_token_lag"] <= 1 and out["replans"] == 0


def test_libra_tail_chooses_alike_without_its_lane_when_colocated(catalog):
    sc, _ = _libra(100)
    system = make_system("libra+tail")
    setup = system.setup(sc, catalog.hardware(sc.cluster.hardware))
    assert system.mode_decision.partial and setup.colocated and not system.tail and not system.elastic


def test_libra_keeps_its_plan_at_staleness_zero(catalog):
    sc, late = _libra(100, staleness=0)
    setup = late.setup(sc, catalog.hardware(sc.cluster.hardware))
    assert late.mode_decision.mode == DISAGGREGATED and not setup.colocated
