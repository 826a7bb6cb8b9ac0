"""The fleet planner (re-planning a running fleet, issue 28 item 3) and the moves that carry its
decisions out: pure, with the live run's own planning problem (`runtime/train/planning.py`)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra.core.config import build
from libra.core.trajectory import ToolStatus, Trajectory, Turn
from libra.planner.controller import StepReport
from libra.planner.fleet import deals
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.fleet import CannotMove, moves
from libra.runtime.train.planning import initial_plan, make_controller


@given(st.integers(1, 9), st.integers(1, 4))
def test_deals_are_every_composition_once(engines, buckets):
    out = list(deals(engines, buckets)) if engines >= buckets else []
    assert len(out) == len(set(out)) == (math.comb(engines - 1, buckets - 1) if engines >= buckets else 0)
    assert all(sum(d) == engines and min(d) >= 1 and len(d) == buckets for d in out)


def _cfg(short: int, long: int, **more) -> TrainConfig:
    return build(TrainConfig, {"buckets": [{"name": "short", "max_context": 64, "instances": short},
                                           {"name": "long", "max_context": 8192, "instances": long}],
                               "planner": {"policy": {"min_concurrent": 2, "interval_steps": 1}}, **more})  # fmt: skip


def _step(step: int, lengths) -> StepReport:
    rng = random.Random(step)
    trajs = []
    for i in range(64):
        n = lengths(rng, i)
        turns = [Turn(n // 2, "calc", 10, ToolStatus.SUCCESS, 0.05), Turn(n - n // 2, None, 0, ToolStatus.SUCCESS, None)]  # fmt: skip
        trajs.append(Trajectory(f"t{step}-{i}", f"p{i // 8}", step, 60, turns))
    return StepReport(step, trajs, 3.0, 4.0, 0.1)


def long_heavy(rng: random.Random, i: int) -> int:
    return rng.randint(1500, 3000) if i % 8 else rng.randint(20, 40)


def test_the_planner_moves_an_engine_to_where_the_work_is_and_then_keeps_the_layout():
    cfg = _cfg(2, 1)
    ctrl, current = make_controller(cfg), initial_plan(cfg)
    dec = ctrl.observe(_step(0, long_heavy), current, None)
    assert dec.replan is not None and "gain" in dec.reason
    new = dec.replan.plan
    assert [b.instances for b in new.buckets] == [1, 2] and new.buckets[-1].max_context == 8192
    assert 64 < new.buckets[0].max_context < 8192  # the boundary moved to the new workload
    assert dec.replan.reconfig_s == cfg.elastic.policy.train_to_rollout_s  # an engine changes bucket
    again = ctrl.observe(_step(1, long_heavy), new, None)
    assert again.replan is None or [b.instances for b in again.replan.plan.buckets] == [1, 2]
    assert "current layout" in again.reason


def test_a_fleet_of_one_engine_per_bucket_only_moves_boundaries_and_replan_off_says_so():
    cfg = _cfg(1, 1)
    dec = make_controller(cfg).observe(_step(0, long_heavy), initial_plan(cfg), None)
    assert dec.replan is not None and [b.instances for b in dec.replan.plan.buckets] == [1, 1]
    assert dec.replan.reconfig_s == 0.0  # only router thresholds: free
    off = build(TrainConfig, {**cfg.model_dump(), "planner": {"replan": False}})
    assert make_controller(off).observe(_step(0, long_heavy), initial_plan(off), None).reason == "this system does not re-plan"  # fmt: skip


@given(st.lists(st.integers(0, 2), min_size=1, max_size=8), st.data())
def test_moves_reach_the_wanted_counts_with_the_fewest_moves_and_never_move_a_pinned_engine(buckets_of, data):
    names = ["a", "b", "c"]
    where = {f"e{i}": names[b] for i, b in enumerate(buckets_of)}
    want = data.draw(st.lists(st.integers(0, len(where)), min_size=3, max_size=3).filter(lambda w: sum(w) == len(where)))  # fmt: skip
    pinned = set(data.draw(st.lists(st.sampled_from(sorted(where)), unique=True, max_size=3)))
    try:
        out = moves(where, names, want, pinned)
    except CannotMove:
        surplus = {n: sum(1 for b in where.values() if b == n) - w for n, w in zip(names, want, strict=True)}
        free = {n: sum(1 for e, b in where.items() if b == n and e not in pinned) for n in names}
        assert any(surplus[n] > free[n] for n in names)
        return
    after = dict(where)
    for m in out:
        assert after[m.engine] == m.src and m.src != m.dst and m.engine not in pinned
        after[m.engine] = m.dst
    assert [sum(1 for b in after.values() if b == n) for n in names] == want
    have = [sum(1 for b in where.values() if b == n) for n in names]
    assert len(out) == sum(max(0, h - w) for h, w in zip(have, want, strict=True))


def test_a_move_that_needs_a_pinned_engine_is_refused_with_the_reason():
    with pytest.raises(CannotMove, match="'long' must give 1"):
        moves({"e0": "short", "e1": "long", "e2": "long"}, ["short", "long"], [2, 1], {"e1", "e2"})


def test_a_fleet_no_layout_fits_is_kept_and_the_reason_logged():
    cfg = build(TrainConfig, {"planner": {"policy": {"min_concurrent": 64}}})
    dec = make_controller(cfg).observe(_step(0, long_heavy), initial_plan(cfg), None)
    assert "no way to deal 2 engines" in dec.reason and dec.replan is None
