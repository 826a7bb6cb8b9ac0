"""The elastic hybrid pool: the join state machine (every transition, rollback, stale generations)
and the hysteresis controller."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.planner import (
    ElasticConfig,
    ElasticController,
    ElasticSignals,
    HybridReplica,
    JoinReplica,
    JoinState,
    ReleaseReplica,
    TransitionError,
    make_pool,
    phase_seconds,
)

S = JoinState


def joined(replica: HybridReplica) -> int:
    gen = replica.request_join()
    assert replica.begin_fetch(gen) and replica.state_fetched(gen)
    assert replica.propose_activation(gen) and replica.activate(gen)
    return gen


# ---- the state machine ---------------------------------------------------------------------------


def test_join_path_and_what_each_state_contributes():
    r = HybridReplica("h0", gpus=4)
    seen = [(r.state, r.serves_rollout, r.sends_zero_gradients, r.contributes_gradients)]
    gen = r.request_join()
    seen.append((r.state, r.serves_rollout, r.sends_zero_gradients, r.contributes_gradients))
    for step in (r.begin_fetch, r.state_fetched, r.propose_activation, r.activate):
        assert step(gen)
        seen.append((r.state, r.serves_rollout, r.sends_zero_gradients, r.contributes_gradients))
    assert seen == [
        (S.ROLLOUT, True, False, False),
        (S.REQUESTED, False, False, False),
        (S.FETCHING_STATE, False, False, False),
        (S.ZERO_SYNC, False, True, False),  # in the all-reduce, adding zeros: training never waits
        (S.ACTIVATING, False, True, False),  # still zeros until the core commits the membership
        (S.ACTIVE, False, False, True),  # only now does it contribute
    ]


def test_release_path():
    r = HybridReplica("h0", gpus=4)
    gen = joined(r)
    assert r.release(gen) and r.state == S.RELEASING and r.in_transition
    assert r.released(gen) and r.state == S.ROLLOUT and not r.in_transition


@pytest.mark.parametrize("depth", [0, 1, 2, 3])  # cancel in REQUESTED, FETCHING_STATE, ZERO_SYNC, ACTIVATING
@pytest.mark.parametrize("how", ["cancel", "fail"])
def test_cancel_or_failure_before_active_rolls_the_whole_replica_back(depth, how):
    r = HybridReplica("h0", gpus=8)
    gen = r.request_join()
    for step in [r.begin_fetch, r.state_fetched, r.propose_activation][:depth]:
        assert step(gen)
    assert getattr(r, how)(gen)
    assert r.state == S.ROLLOUT and r.serves_rollout and r.rollbacks == 1
    assert r.generation == gen + 1
    # Late callbacks of the abandoned join are refused and change nothing.
    for late in (r.begin_fetch, r.state_fetched, r.propose_activation, r.activate, r.cancel):
        assert late(gen) is False
    assert r.state == S.ROLLOUT and r.stale_refusals == 5


@pytest.mark.parametrize("state_after", ["active", "releasing"])
def test_failure_after_active_returns_to_rollout(state_after):
    r = HybridReplica("h0", gpus=8)
    gen = joined(r)
    if state_after == "releasing":
        r.release(gen)
    assert r.fail(gen) and r.state == S.ROLLOUT and r.rollbacks == 1


def test_stale_generation_cannot_move_a_newer_join():
    r = HybridReplica("h0", gpus=4)
    old = r.request_join()
    r.begin_fetch(old)
    r.cancel(old)
    new = r.request_join()
    assert new > old
    assert r.begin_fetch(old) is False and r.state == S.REQUESTED  # the old join's callback
    assert r.begin_fetch(new) and r.state == S.FETCHING_STATE


@pytest.mark.parametrize(
    "prepare,call",
    [
        ([], "activate"),  # ROLLOUT -> ACTIVE skips the join
        (["request_join"], "activate"),  # no activation without the handshake
        (["request_join"], "propose_activation"),
        (["request_join"], "state_fetched"),  # REQUESTED cannot skip FETCHING_STATE
        (["request_join"], "release"),
        (["join"], "cancel"),  # cancel is for joins in flight; an ACTIVE replica is released
        (["join"], "begin_fetch"),
        ([], "released"),
        ([], "cancel"),
    ],
)
def test_wrong_starting_state_raises(prepare, call):
    r = HybridReplica("h0", gpus=4)
    for p in prepare:
        joined(r) if p == "join" else r.request_join()
    state = r.state
    with pytest.raises(TransitionError) as e:
        getattr(r, call)(r.generation)
    assert r.state == state and call in str(e.value)
    if state == S.ACTIVE:
        with pytest.raises(TransitionError):
            r.request_join()


# The reference model the property test checks against: from-state -> to-state per transition.
TABLE = {
    "begin_fetch": ({S.REQUESTED}, S.FETCHING_STATE),
    "state_fetched": ({S.FETCHING_STATE}, S.ZERO_SYNC),
    "propose_activation": ({S.ZERO_SYNC}, S.ACTIVATING),
    "activate": ({S.ACTIVATING}, S.ACTIVE),
    "release": ({S.ACTIVE}, S.RELEASING),
    "released": ({S.RELEASING}, S.ROLLOUT),
    "cancel": ({S.REQUESTED, S.FETCHING_STATE, S.ZERO_SYNC, S.ACTIVATING}, S.ROLLOUT),
    "fail": ({S.REQUESTED, S.FETCHING_STATE, S.ZERO_SYNC, S.ACTIVATING, S.ACTIVE, S.RELEASING}, S.ROLLOUT),
}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*TABLE, "request_join"]), st.integers(-2, 0)), max_size=40))
def test_state_machine_against_its_table(ops):
    r = HybridReplica("h", gpus=2)
    for name, offset in ops:
        state, gen = r.state, r.generation
        if name == "request_join":
            if state == S.ROLLOUT:
                assert r.request_join() == gen + 1 and r.state == S.REQUESTED
            else:
                with pytest.raises(TransitionError):
                    r.request_join()
            continue
        allowed, target = TABLE[name]
        if offset != 0:  # a stale generation: refused, nothing moves
            assert getattr(r, name)(gen + offset) is False
            assert (r.state, r.generation) == (state, gen)
        elif state in allowed:
            assert getattr(r, name)(gen) is True and r.state == target
            assert r.generation == gen + (name in ("cancel", "fail"))
        else:
            with pytest.raises(TransitionError):
                getattr(r, name)(gen)
            assert (r.state, r.generation) == (state, gen)
        assert r.contributes_gradients == (r.state == S.ACTIVE)


def test_published_transition_costs():
    c = ElasticConfig()
    assert (c.train_to_rollout_s, c.rollout_to_train_s) == (pytest.approx(10.8), pytest.approx(8.0))
    assert phase_seconds(S.FETCHING_STATE) == pytest.approx(3.6)
    assert phase_seconds(S.ZERO_SYNC) == pytest.approx(4.4)
    assert phase_seconds(S.RELEASING) == pytest.approx(10.8)
    assert phase_seconds(S.ACTIVE) == 0.0
    custom = ElasticConfig(snapshot_s=1.0, restore_s=2.0, train_to_rollout_s=5.0)
    assert custom.rollout_to_train_s == 3.0 and phase_seconds(S.RELEASING, custom) == 5.0


@pytest.mark.parametrize("data", [{"borrow_ratio": 0.9}, {"release_ratio": 1.1}, {"snapshot_s": -1}])
def test_bad_elastic_config(data):
    with pytest.raises(ConfigError):
        build(ElasticConfig, data, "elastic")


# ---- the controller ------------------------------------------------------------------------------


def pool(n: int = 4, gpus: int = 4) -> list[HybridReplica]:
    return [HybridReplica(f"h{k}", gpus) for k in range(n)]


def sig(t_train: float, t_roll: float = 100.0, pressure: float = 0.0, core_dp: int = 4, prompts: int = 0):
    """Signals without a measured rollout work: the predicted step is max(T_train, T_rollout)."""
    return ElasticSignals(t_train, t_roll, pressure, core_dp, 32, prompts)


def test_hysteresis_band():
    """The paper's controller: a step is max(T_train, T_rollout) when the rollout work is unknown."""
    ctl = ElasticController()
    replicas = pool()
    assert ctl.decide(sig(114.0), replicas).hold  # r = 1.14: inside the band
    d = ctl.decide(sig(116.0), replicas)  # r = 1.16 >= 1.15
    assert d.joins and all(isinstance(j, JoinReplica) for j in d.joins)
    for j in d.joins:
        joined(next(r for r in replicas if r.id == j.replica))
    for ratio in (1.14, 1.0, 0.91):  # back inside the band: nothing is given back
        assert ctl.decide(sig(100 * ratio), replicas).hold
    # r = 0.89 is past the threshold, but giving a replica back (dp 5 -> 4) would make training
    # 111 s against rollout's 89 s: longer than now, and over 1.15 again. No overshoot, no move.
    assert "no release shortens" in ctl.decide(sig(89.0), replicas).reason
    d = ctl.decide(sig(70.0), replicas)  # r = 0.70: releasing one predicts max(87.5, 88.9) < 100
    assert d.releases and all(isinstance(x, ReleaseReplica) for x in d.releases)
    active = {r.id: r.generation for r in replicas if r.state == S.ACTIVE}
    assert all(active[x.replica] == x.generation for x in d.releases)


def test_release_weighs_both_stages_at_staleness_one():
    """With the rollout work measured (40 s of a 100 s makespan: tools dominate), a step at
    staleness 1 is max(T_train, (T_rollout + T_train) / 2, work), so giving a replica back pays only
    if rollout gains more than training loses."""
    ctl = ElasticController()

    def measured(core_dp):
        return ElasticSignals(70.0, 100.0, 0.0, core_dp, 32, 0, staleness=1, rollout_work_s=40.0)

    few = pool(1)
    joined(few[0])  # core dp 4 + 1: dp 5 -> 4 costs training 25%
    assert ctl.decide(measured(4), few).hold  # (100 + 70) / 2 = 85 < (88.9 + 87.5) / 2
    assert ctl.decide(sig(70.0, core_dp=4), few).releases  # unmeasured work: max(87.5, 88.9) < 100
    many = pool(1)
    joined(many[0])  # core dp 8 + 1: dp 9 -> 8 costs training 12.5%
    assert ctl.decide(measured(8), many).releases  # (88.9 + 78.75) / 2 = 83.8 < 85


def test_a_schedule_holds_its_count_whatever_the_stages_measure():
    """`schedule`: from step 2 one replica, from step 5 none; r is ignored, transitions wait."""
    ctl, replicas = ElasticController(ElasticConfig(schedule={2: 1, 5: 0})), pool(2)
    at = lambda step, t_train=50.0: ElasticSignals(t_train, 100.0, 0.0, 4, 32, 0, step=step)  # noqa: E731
    assert ctl.decide(at(1, t_train=500.0), replicas).hold  # r = 5, but the schedule says none yet
    d = ctl.decide(at(2), replicas)  # r = 0.5, but the schedule says one
    assert [j.replica for j in d.joins] == ["h0"] and "schedule" in d.reason
    gen = replicas[0].request_join()
    assert ctl.decide(at(3), replicas).reason == "a transition is in flight"
    assert replicas[0].begin_fetch(gen) and replicas[0].state_fetched(gen)
    assert replicas[0].propose_activation(gen) and replicas[0].activate(gen)
    assert ctl.decide(at(4), replicas).hold  # holding one, as scheduled
    d = ctl.decide(at(7), replicas)
    assert [(r.replica, r.generation) for r in d.releases] == [("h0", gen)]


def test_a_schedule_with_a_negative_step_or_count_is_refused():
    for bad in ({-1: 1}, {2: -1}):
        with pytest.raises(ConfigError, match="schedule"):
            build(ElasticConfig, {"schedule": bad}, "elastic")


def test_borrows_enough_to_balance_but_not_more():
    ctl = ElasticController()
    # T_train 200 on dp 4, rollout 100 on 32 GPUs with 4-GPU replicas: k=2 gives max(133, 133).
    d = ctl.decide(sig(200.0), pool(6))
    assert len(d.joins) == 2


def test_never_borrows_under_high_rollout_pressure():
    ctl = ElasticController()
    for pressure in (0.8, 0.95):
        assert not ctl.decide(sig(300.0, pressure=pressure), pool()).joins
    assert ctl.decide(sig(300.0, pressure=0.79), pool()).joins


def test_holds_while_a_transition_is_in_flight():
    ctl = ElasticController()
    replicas = pool()
    replicas[0].request_join()
    assert ctl.decide(sig(300.0), replicas).hold
    assert "in flight" in ctl.decide(sig(300.0), replicas).reason


def test_grpo_groups_stay_even_over_dp():
    ctl = ElasticController()
    # 32 prompts on core dp 4: only dp 8 (k = 4) divides evenly; with 3 free replicas: hold.
    assert ctl.decide(sig(400.0, prompts=32), pool(3)).hold
    d = ctl.decide(sig(400.0, prompts=32), pool(4))
    assert len(d.joins) == 4
    assert len(
        ElasticController(ElasticConfig(require_even_groups=False))
        .decide(sig(400.0, prompts=32), pool(3))
        .joins
    )


def test_no_measurements_no_move():
    assert ElasticController().decide(sig(0.0), pool()).hold


@settings(max_examples=200, deadline=None)
@given(
    t_train=st.floats(1, 1000),
    t_roll=st.floats(1, 1000),
    pressure=st.floats(0, 1),
    active=st.integers(0, 4),
)
def test_controller_respects_the_band_and_pressure(t_train, t_roll, pressure, active):
    replicas = pool(4)
    for r in replicas[:active]:
        joined(r)
    d = ElasticController().decide(sig(t_train, t_roll, pressure), replicas)
    ratio = t_train / t_roll
    if d.joins:
        assert ratio >= 1.15 and pressure < 0.8
        assert all(next(r for r in replicas if r.id == j.replica).serves_rollout for j in d.joins)
    if d.releases:
        assert ratio <= 0.90
        assert all(next(r for r in replicas if r.id == x.replica).state == S.ACTIVE for x in d.releases)
    if 0.90 < ratio < 1.15:
        assert d.hold


def test_pool_from_a_plan(catalog):
    from libra.planner import GlobalPlanner, PlannerConfig, PlanningProblem, WorkloadStats
    from tests.test_planner import synthetic

    p = PlanningProblem(catalog.hardware("a800-80g"), 6, catalog.model("qwen3-14b"), 32, 16, 40960)
    plan = GlobalPlanner(p, PlannerConfig(hybrid_fraction=0.5)).plan(
        WorkloadStats.from_trajectories(synthetic(512, 3))
    )
    replicas = make_pool(plan)
    assert len(replicas) == plan.hybrid_replicas >= 1
    assert all(r.gpus == plan.train.tp * plan.train.pp * plan.train.cp and r.serves_rollout for r in replicas)
    assert sum(r.gpus for r in replicas) <= plan.rollout_gpus
