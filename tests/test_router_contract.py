"""The contract every registered router keeps, checked on random instance lists and requests.

- No request is lost: `route` always returns a decision while some instance is healthy, and
  raises `NoInstanceError` (never anything else) when none is.
- It never names an instance that is not in the list, nor an unhealthy one.
- The decision's bucket is the chosen instance's bucket, and the migration fields agree.
- The same seed and the same inputs give the same decisions.

Routers are checked both cold (nothing learned) and warmed up on synthetic trajectories, so the
learned code paths (trees, fitted models, sibling books) are under the same contract. The cold ones
are given a cost model, so the default `spill: cost` prices the instances with it; the warm ones
have none and balance load per GPU: both placement paths are under the contract too.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from libra.costmodel.catalog import load_catalog
from libra.costmodel.rollout import RolloutCostModel
from libra.rollout.base import (
    Bucket,
    InstanceView,
    MigrationMethod,
    NoInstanceError,
    PayloadSize,
    RouteRequest,
    Status,
    ToolState,
    bucket_for_length,
)
from libra.rollout.evaluate import evaluate
from libra.rollout.placement import CostModelCoster
from libra.rollout.registry import ROUTERS, make_router
from libra.rollout.synthetic import search_like

BUCKETS = [Bucket("short", 1, 4096), Bucket("medium", 2, 12288), Bucket("long", 4, 40960)]
TOOLS = ["search", "bash", "never-seen-before", ""]

states = st.builds(
    ToolState,
    st.sampled_from(TOOLS),
    st.sampled_from(list(PayloadSize)),
    st.sampled_from(list(Status)),
)


@st.composite
def instance_lists(draw):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        out.append(
            InstanceView(
                id=f"i{i}",
                bucket=draw(st.integers(0, len(BUCKETS) - 1)),
                tp=draw(st.sampled_from([1, 2, 4, 8])),  # unequal TPs exercise the spill prices
                outstanding=draw(st.integers(0, 6)),
                cap=draw(st.integers(1, 6)),
                healthy=draw(st.booleans()),
                node=draw(st.integers(0, 2)),
                kv_usage=draw(st.sampled_from([0.0, 0.5, 0.95, 1.0])),
            )
        )
    return out


@st.composite
def requests(draw):
    turn = draw(st.integers(0, 12))
    path = tuple(draw(st.lists(states, min_size=turn, max_size=turn)))
    prompt = draw(st.integers(1, 6000))
    context = prompt + draw(st.integers(0, 60000))
    cur_bucket = None if turn == 0 else draw(st.integers(0, len(BUCKETS) - 1))
    cur_inst = None if turn == 0 else draw(st.sampled_from([f"i{k}" for k in range(10)]))
    return RouteRequest(
        traj_id=f"t{draw(st.integers(0, 5))}",
        prompt_id=f"p{draw(st.integers(0, 2))}",
        step=draw(st.integers(0, 3)),
        turn=turn,
        prompt_tokens=prompt,
        context_tokens=context,
        generated_tokens=draw(st.integers(0, context - prompt)),
        path=path,
        current_bucket=cur_bucket,
        current_instance=cur_inst,
        true_final_tokens=draw(st.one_of(st.none(), st.integers(context, context + 50000))),
    )


def _warm(name: str):
    router = make_router(name, BUCKETS, seed=3)
    evaluate(router, search_like(steps=3, prompts=6, samples=4, seed=11), BUCKETS)
    return router


WARM = {}


def _coster() -> CostModelCoster:
    cat = load_catalog()
    hw, model = cat.hardware("a800-80g"), cat.model("qwen3-14b")
    return CostModelCoster([RolloutCostModel(hw, model, b.tp) for b in BUCKETS])


COSTER = _coster()


def _router(name: str, warm: bool):
    if not warm:
        return make_router(name, BUCKETS, cost=COSTER, seed=3)
    if name not in WARM:
        WARM[name] = _warm(name)
    return WARM[name]


def check_decision(router, req, instances):
    healthy = [i for i in instances if i.healthy]
    if not healthy:
        with pytest.raises(NoInstanceError):
            router.route(req, instances)
        return
    d = router.route(req, instances)
    by_id = {i.id: i for i in instances}
    assert d.instance in by_id, "routed to an instance that is not in the list"
    chosen = by_id[d.instance]
    assert chosen.healthy, "routed to an unhealthy instance while a healthy one exists"
    assert d.bucket == chosen.bucket
    floor = bucket_for_length(router.buckets, req.context_tokens)
    if any(i.bucket >= floor for i in healthy):
        assert chosen.bucket >= floor, "routed to a bucket too small for the context"
    moved = req.current_instance is not None and req.current_instance != d.instance
    assert d.migrate == moved
    assert (d.method != MigrationMethod.NONE) == moved


# Every router, cold and warm, is checked on each drawn example (each on its own copy of the
# instances): drawing the instance lists and request paths is most of the cost (the routing is a
# few ms), so one draw serves them all, and each router still sees all 60 (25) examples, as it did
# when each router drew its own. `note` names the router in a falsifying example's report.
CASES = [(name, warm) for name in sorted(ROUTERS) for warm in (False, True)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances=instance_lists(), reqs=st.lists(requests(), min_size=1, max_size=6))
def test_every_router_keeps_the_contract(instances, reqs):
    for name, warm in CASES:
        note(f"router {name}, {'warm' if warm else 'cold'}")
        router, mine = _router(name, warm), copy.deepcopy(instances)
        for req in reqs:
            check_decision(router, req, mine)


@settings(max_examples=25, deadline=None)
@given(instances=instance_lists(), reqs=st.lists(requests(), min_size=1, max_size=8))
def test_same_seed_same_decisions(instances, reqs):
    if not any(i.healthy for i in instances):
        instances[0].healthy = True
    for name in sorted(ROUTERS):
        note(f"router {name}")
        mine = copy.deepcopy(instances)
        a, b = make_router(name, BUCKETS, seed=7), make_router(name, BUCKETS, seed=7)
        assert [a.route(r, mine) for r in reqs] == [b.route(r, mine) for r in reqs], name


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_learning_is_deterministic(name):
    trajs = search_like(steps=3, prompts=6, samples=4, seed=5)
    a = evaluate(make_router(name, BUCKETS, seed=1), trajs, BUCKETS, order="interleaved")
    b = evaluate(make_router(name, BUCKETS, seed=1), trajs, BUCKETS, order="interleaved")
    assert a.to_dict() == b.to_dict()
    assert a.decisions == sum(len(t.turns) - 1 for t in trajs)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_empty_instance_list_is_a_typed_error(name):
    req = RouteRequest("t", "p", 0, 0, 100, 100, 0)
    with pytest.raises(NoInstanceError):
        make_router(name, BUCKETS).route(req, [])
