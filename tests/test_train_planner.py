"""The planner live (issue 28): the adapter from live steps to the controller's StepReport, the
controller's decisions on real reports, the driver's mirror of the core's join states, and the
selector's refusal, without processes."""

from __future__ import annotations

import pytest

from libra.core.errors import InfeasibleError
from libra.planner import HybridReplica, JoinState, PoolView
from libra.planner.staleness import Finished
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.config import load_train_config
from libra.runtime.train.planning import (
    StageLayout,
    decide,
    decision_log,
    initial_plan,
    make_controller,
    plan_trajectory,
    rollout_makespan,
    step_report,
)
from libra.runtime.train.pool import _advance
from libra.runtime.train.rollout import Group
from libra.runtime.train.task import Problem
from libra.runtime.train.trajectory import ToolResult, Trajectory, TrajState, Turn


def _traj(i: int, t0: float, turn_s: float, tool_s: float) -> Trajectory:
    """A two-turn calculator trajectory: 5 prompt ids, 3 sampled, 4 of tool output, then 2."""
    first = Turn([1, 2, 3, 4, 5], [6, 7, 8], [-0.1] * 3, [0] * 3, "tool_calls", started=t0, ended=t0 + turn_s)
    second = Turn(list(range(1, 13)), [13, 14], [-0.2] * 2, [0] * 2, "stop",
                  started=t0 + turn_s + tool_s, ended=t0 + 2 * turn_s + tool_s)  # fmt: skip
    t = Trajectory(f"t{i}", "p0", 0, 0, [first, second], [ToolResult("42", "success", tool_s)])
    t.finish(1.0)
    return t


def _groups(train_like: float = 0.0) -> list[Finished[Group]]:
    trajs = [_traj(i, 100.0 + i * 0.1, 0.5, 0.25) for i in range(4)]
    return [Finished(0, Group(0, 0, Problem("p0", 1, "+", 2), trajs, 0))]


def test_a_live_trajectory_reads_as_the_planners():
    t = plan_trajectory(_traj(0, 0.0, 1.0, 0.5), step=3)
    assert t.prompt_tokens == 5 and t.step == 3
    assert [x.output_tokens for x in t.turns] == [3, 2]
    assert t.turns[0].tool_return_tokens == 4 and t.turns[0].tool_latency_s == 0.5
    assert not t.turns[1].has_tool
    assert t.total_tokens == 14  # the whole sequence the trainer trains


def test_step_report_measures_the_batch_makespan_and_skips_dropped():
    groups = _groups()
    groups[0].group.trajs[3].state = TrajState.DROPPED
    rep = step_report(7, groups, t_train_s=3.0, pressure=0.2)
    assert rep.step == 7 and rep.t_train_s == 3.0 and rep.rollout_pressure == 0.2
    assert rep.t_rollout_s == pytest.approx(rollout_makespan(groups)) == pytest.approx(0.3 + 1.25)
    assert len(rep.trajectories) == 3


def _pool(state: JoinState = JoinState.ROLLOUT) -> PoolView:
    r = HybridReplica("hybrid-0", 1)
    if state == JoinState.ACTIVE:
        gen = r.request_join()
        for move in (r.begin_fetch, r.state_fetched, r.propose_activation, r.activate):
            move(gen)
    return PoolView([r], core_dp=2, rollout_gpus=4, prompts_per_step=6)


ELASTIC = load_train_config(None, ["elastic.enabled=true", "planner.replan=false"])


def test_the_controller_borrows_when_training_is_slower_and_releases_when_rollout_is():
    ctrl, current = make_controller(ELASTIC), initial_plan(ELASTIC)
    groups = _groups()
    slow_train = step_report(0, groups, t_train_s=4 * rollout_makespan(groups), pressure=0.0)
    dec = decide(ctrl, slow_train, current, _pool())
    assert [j.replica for j in dec.elastic.joins] == ["hybrid-0"]
    log = decision_log(dec, slow_train)
    assert log["elastic"]["joins"] == ["hybrid-0"] and "borrow" in log["elastic"]["reason"]
    assert log["report"]["ratio"] == pytest.approx(4.0) and log["reason"]
    slow_roll = step_report(1, groups, t_train_s=0.2 * rollout_makespan(groups), pressure=0.0)
    dec = decide(ctrl, slow_roll, current, _pool(JoinState.ACTIVE))
    assert [r.replica for r in dec.elastic.releases] == ["hybrid-0"]
    # Under rollout pressure it never borrows, and says why.
    busy = step_report(2, groups, t_train_s=4 * rollout_makespan(groups), pressure=0.95)
    dec = decide(ctrl, busy, current, _pool())
    assert dec.elastic.hold and "pressure" in dec.elastic.reason


def test_without_the_pool_the_decision_still_says_why():
    cfg = load_train_config(None, [])
    assert not cfg.elastic.enabled and cfg.planner.replan
    report = step_report(0, _groups(), 1.0, 0.0)
    dec = decide(make_controller(cfg), report, initial_plan(cfg), None)
    log = decision_log(dec, report)
    assert log["elastic"] is None and log["trigger"] == "interval" and log["reason"]
    # two engines in two buckets: only the boundary can move, which costs no restart
    assert log["replan"] is None or log["replan"]["reconfig_s"] == 0.0


def test_the_driver_mirrors_the_cores_join_state_forward_only():
    r = HybridReplica("hybrid-0", 1)
    r.request_join()
    _advance(r, JoinState.ROLLOUT)  # the trainer has not connected yet
    assert r.state == JoinState.REQUESTED
    _advance(r, JoinState.ZERO_SYNC)
    assert r.state == JoinState.ZERO_SYNC
    _advance(r, JoinState.FETCHING_STATE)  # a late view never moves it back
    assert r.state == JoinState.ZERO_SYNC
    _advance(r, JoinState.ACTIVE)
    assert r.state == JoinState.ACTIVE


def test_the_elastic_demo_config_is_embedded():
    cfg = load_train_config("elastic-demo", [])
    assert cfg.elastic.enabled and cfg.rollout.groups_per_step % (cfg.trainer.replicas + 1) == 0
    off = load_train_config("elastic-demo", ["elastic.enabled=false"])
    assert not off.elastic.enabled


def _sample(n: int) -> TrainSample:
    return TrainSample(ids=[1] * n, mask=[1] * n, logprobs=[0.0] * n)


def test_the_selector_picks_what_fits_and_logs_what_it_refused():
    layout = StageLayout(load_train_config(None, ["trainer.memory_budget_mb=100"]))
    packing, log = layout.before([_sample(100), _sample(120)])
    assert log["longest"] == 120 and log["context_bound"] == 256 and packing == log["micro_batch_tokens"]
    assert packing < 8192 and log["refused"] and all("> budget 100 MiB" in r for r in log["refused"])
    assert log["mib"] <= 100
    with pytest.raises(InfeasibleError, match="4096-token"):
        StageLayout(load_train_config(None, ["trainer.memory_budget_mb=8"])).before([_sample(3000)])


def _record(step: int, step_s: float, elastic: dict | None) -> dict:
    """A steps.json object with just what the summary, the table and the plot read."""
    return {"step": step, "success": 0.5, "reward": 0.5, "step_time_s": step_s, "rollout_wait_s": 1.0,
            "train_s": step_s - 1.5, "publish_s": 0.5, "tokens": {"total": 100}, "trained": 8,
            "dropped": {"trajectories": 0}, "weight_version": step + 1, "elastic": elastic}  # fmt: skip


def _counts(joins: int, releases: int, rollbacks: int, active: int) -> dict:
    return {"joins": joins, "releases": releases, "rollbacks": rollbacks, "hybrid_active": active}


# a borrow at step 1, counted at steps 3-4, released (back in rollout) at step 5, a rollback at step 6
POOL_RUN = [_record(0, 10.0, _counts(0, 0, 0, 0)), _record(1, 10.0, _counts(1, 0, 0, 0)),
            _record(2, 10.0, _counts(1, 0, 0, 0)), _record(3, 8.0, _counts(1, 0, 0, 1)),
            _record(4, 6.0, _counts(1, 0, 0, 1)), _record(5, 10.0, _counts(1, 1, 0, 0)),
            _record(6, 10.0, _counts(2, 1, 1, 0))]  # fmt: skip


def test_the_summary_and_the_table_show_the_pool():
    from libra.cli.train import summary_table
    from libra.runtime.train.report import pool_changes, summarize

    s = summarize(POOL_RUN)
    assert s["elastic"] == {"joins": 2, "releases": 1, "rollbacks": 1, "hybrid_active_steps": 2,
                            "mean_step_s_hybrid_active": 7.0, "mean_step_s_no_hybrid": 10.0}  # fmt: skip
    assert pool_changes(POOL_RUN) == {"joins": [1, 6], "releases": [5], "rollbacks": [6]}
    labels = list(summary_table(s).columns[0].cells)
    values = dict(zip(labels, summary_table(s).columns[1].cells, strict=True))
    assert values["hybrid pool: joins / releases / rollbacks"] == "2 / 1 / 1"
    assert values["  steps with a hybrid replica active"] == "2"
    # without the pool (elastic.enabled false: no `elastic` in the records) the rows are absent
    plain = summarize([{**r, "elastic": None} for r in POOL_RUN])
    assert "elastic" not in plain
    assert not any("hybrid" in c for c in summary_table(plain).columns[0].cells)


def test_the_split_plot_marks_the_pool(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from libra.runtime.train.report import _plot_pool, plot

    fig, ax = plt.subplots()
    _plot_pool(ax, POOL_RUN)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["hybrid replica counted", "borrow", "released", "rollback"]
    shaded = [p.get_x() for p in ax.patches]  # one band per step with a counted hybrid replica
    assert shaded == pytest.approx([2.5, 3.5])
    assert [t.get_text() for t in ax.texts] == ["+1", "+1"]
    plt.close(fig)
    plot(POOL_RUN, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 0
