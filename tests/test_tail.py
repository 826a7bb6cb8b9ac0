"""The tail lane (libra.rollout.tail): who is a straggler, where they go, and what it leaves to the rest."""

from hypothesis import given, settings
from hypothesis import strategies as st

from libra.rollout.base import Bucket, FinishedTrajectory, InstanceView, RouteRequest
from libra.rollout.registry import make_router
from libra.rollout.tail import TailConfig, TailLane

BUCKETS = [Bucket("all", 4, 40960)]


def views(n: int = 4) -> list[InstanceView]:
    return [InstanceView(f"i{k}", 0, 4, outstanding=k, cap=48) for k in range(n)]


def lane(cfg: TailConfig | None = None) -> TailLane:
    return TailLane(make_router("least-loaded", BUCKETS), cfg or TailConfig(lane_cap=2, max_share=0.25))


def req(traj: str, step: int = 0, turn: int = 0, ctx: int = 1000, at: str | None = None) -> RouteRequest:
    return RouteRequest(traj, f"p{traj}", step, turn, 1000, ctx, 0, current_instance=at)


def finish(tl: TailLane, traj: str, step: int = 0, final: int = 1000) -> None:
    tl.on_finish(FinishedTrajectory(traj, f"p{traj}", step, (), (), final))


def test_a_draining_batch_gets_a_lane_and_the_rest_stays_off_it():
    tl, vs = lane(), views()
    for k in range(5):
        tl.route(req(f"a{k}"), vs)
    for k in range(3):
        finish(tl, f"a{k}")
    # Two of batch 0 are left: they fit the lane (1 engine of 4 x lane_cap 2), so they are stragglers.
    d = tl.route(req("a3", turn=1, at="i2"), vs)
    assert tl.lanes == [d.instance] and d.migrate
    # A fresh trajectory of the next batch avoids the lane; one already on it is moved off.
    fresh = tl.route(req("b0", step=1), vs)
    assert fresh.instance not in tl.lanes
    off = tl.route(req("b1", step=1, turn=1, at=tl.lanes[0]), vs)
    assert off.instance not in tl.lanes and off.migrate and tl.stats.evictions == 1
    # The stragglers finish: the lane closes, and every engine takes work again.
    finish(tl, "a3")
    finish(tl, "a4")
    tl.route(req("b2", step=1), vs)
    assert tl.lanes == []


def test_a_long_trajectory_is_a_straggler_once_the_quantile_is_known():
    tl, vs = lane(TailConfig(lane_cap=2, max_share=0.25, long_quantile=0.5, window=16)), views()
    for k in range(16):
        tl.route(req(f"a{k}"), vs)
    for k in range(16):
        finish(tl, f"a{k}", final=1000 + 100 * k)
    assert tl.long == 1800
    for k in range(40):  # a busy batch: nothing is draining
        tl.route(req(f"b{k}", step=1), vs)
    long = tl.route(req("b1", step=1, turn=1, ctx=5000, at="i0"), vs)
    short = tl.route(req("b0", step=1, turn=1, ctx=1200, at="i0"), vs)
    assert long.instance in tl.lanes and short.instance not in tl.lanes and "b1" in tl.members


def test_one_engine_of_the_largest_tp_is_never_a_lane():
    tl = lane()
    vs = [InstanceView("s", 0, 1), InstanceView("big", 0, 4)]
    tl.route(req("a0"), vs)
    d = tl.route(req("a0", turn=1, at="big"), vs)
    assert tl.lanes == [] and d.instance in ("s", "big")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.booleans()), min_size=1, max_size=120))
def test_lanes_never_exceed_their_share_and_hold_only_healthy_largest_tp(events):
    """Whatever the order of turns and finishes: at most max_share of the largest-TP engines are
    lanes, every lane is such an engine, and admitted stragglers never exceed the lanes' room."""
    tl = lane(TailConfig(lane_cap=2, max_share=0.5))
    vs = views(6)
    started: set[str] = set()
    for step, k, done in events:
        t = f"{step}-{k}"
        if done and t in started:
            finish(tl, t, step)
            started.discard(t)
            continue
        d = tl.route(req(t, step, turn=int(t in started), at="i0" if t in started else None), vs)
        started.add(t)
        assert d.instance in {v.id for v in vs}
        assert len(tl.lanes) <= 3 and len(tl.members) <= tl.room
