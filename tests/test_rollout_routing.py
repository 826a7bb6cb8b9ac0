"""The bucket rule, instance choice, migration pricing, and each router's own behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.errors import ConfigError
from libra.rollout.base import (
    Bucket,
    FinishedTrajectory,
    InstanceView,
    MigrationMethod,
    NoInstanceError,
    PayloadSize,
    RouteRequest,
    Status,
    ToolState,
)
from libra.rollout.cmlfq import PaperCMLFQRouter, mean_p90_rule
from libra.rollout.placement import CostModelCoster, choose_instance, migration_method, per_gpu_load
from libra.rollout.registry import ROUTERS, make_router
from libra.rollout.routers import BaseRouter

B = [Bucket("short", 1, 4096), Bucket("medium", 2, 12288), Bucket("long", 4, 40960)]
S = ToolState("search", PayloadSize.SMALL, Status.SUCCESS)
X = ToolState("brand-new-tool", PayloadSize.LARGE, Status.FAILURE)


def inst(i, bucket, outstanding=0, cap=8, healthy=True, node=0):
    return InstanceView(f"i{i}", bucket, B[bucket].tp, outstanding, cap, healthy, node)


def one_per_bucket():
    return [inst(0, 0), inst(1, 1), inst(2, 2)]


def req(turn=1, context=3000, path=(S,), cur=0, inst_id="i0", **kw):
    return RouteRequest("t", "p", 0, turn, 2000, context, context - 2000, tuple(path), cur, inst_id, **kw)


# ---- the bucket rule --------------------------------------------------------------------------


def test_mean_and_p90_disagree_means_no_move():
    assert mean_p90_rule(B, 0, mean_final=8000, p90_final=20000) == 0


def test_mean_and_p90_agree_on_another_bucket_means_move():
    assert mean_p90_rule(B, 0, mean_final=6000, p90_final=11000) == 1
    assert mean_p90_rule(B, 0, mean_final=13000, p90_final=30000) == 2
    assert mean_p90_rule(B, 2, mean_final=1000, p90_final=3000) == 0


def test_agreement_on_the_current_bucket_is_no_move():
    assert mean_p90_rule(B, 1, mean_final=5000, p90_final=12000) == 1


def trained_paper_router(finals):
    r = PaperCMLFQRouter(B)
    for i, f in enumerate(finals):
        r.on_finish(FinishedTrajectory(f"f{i}", "q", 0, (S,), (2000, 3000), f))
    return r


def test_paper_router_stays_when_mean_and_p90_disagree():
    # remaining after S: mean ~5.6K, P90 ~23K -> finals map to medium and long: disagree
    r = trained_paper_router([5000] * 8 + [26000] * 2)
    d = r.route(req(), one_per_bucket())
    assert d.bucket == 0 and not d.migrate


def test_paper_router_moves_when_they_agree():
    r = trained_paper_router([7000] * 10)
    d = r.route(req(), one_per_bucket())
    assert d.bucket == 1 and d.migrate and d.method == MigrationMethod.KV_TRANSFER
    assert d.predicted_final_tokens == pytest.approx(7000)


@pytest.mark.parametrize("name", ["cmlfq", "cmlfq-paper", "classic-mlfq", "context-prior"])
def test_every_trajectory_starts_in_the_smallest_bucket_when_nothing_is_known(name):
    r = make_router(name, B)
    d = r.route(req(turn=0, path=(), cur=None, inst_id=None), one_per_bucket())
    assert d.bucket == 0 and not d.migrate


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_a_context_that_outgrows_its_bucket_always_moves_up(name):
    r = make_router(name, B)
    d = r.route(req(context=5000, cur=0, true_final_tokens=5200), one_per_bucket())
    assert d.bucket >= 1


# ---- cold start and unseen tools ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cmlfq", "cmlfq-paper", "context-prior"])
def test_cold_start_stays_put(name):
    r = make_router(name, B)
    for k in range(1, 6):
        d = r.route(req(turn=k, path=(S,) * k, context=2000 + 300 * k), one_per_bucket())
        assert d.bucket == 0 and not d.migrate


@pytest.mark.parametrize("name", ["cmlfq", "cmlfq-paper"])
def test_unseen_tool_types_fall_back_to_what_is_known(name):
    r = make_router(name, B)
    from libra.rollout.evaluate import evaluate
    from libra.rollout.synthetic import search_like

    evaluate(r, search_like(steps=3, prompts=6, samples=4, seed=2), B)
    d = r.route(req(turn=3, path=(S, X, X), context=3500), one_per_bucket())
    assert d.instance in {"i0", "i1", "i2"}
    # the unseen state stops the walk at the known prefix
    m = r.tree.lookup("p", (S, X, X))
    assert m is not None and m.depth <= 1


# ---- instance choice ----------------------------------------------------------------------------


def test_fewest_outstanding_inside_the_bucket():
    insts = [inst(0, 0, outstanding=5), inst(1, 0, outstanding=2), inst(2, 0, outstanding=2)]
    assert choose_instance(insts, 0, 0, 3, None).id == "i1"


def test_prefers_the_instance_holding_the_prefix():
    insts = [inst(0, 0, outstanding=5), inst(1, 0, outstanding=0)]
    assert choose_instance(insts, 0, 0, 3, "i0").id == "i0"
    # ... even at its request cap: others filled it while this one was in a tool call
    insts[0].outstanding = 8
    assert choose_instance(insts, 0, 0, 3, "i0").id == "i0"
    # ... but not when it failed
    insts[0].healthy = False
    assert choose_instance(insts, 0, 0, 3, "i0").id == "i1"


def test_a_larger_bucket_keeps_a_spilled_trajectory_only_if_the_choice_did_not_go_down():
    insts = [inst(0, 0), inst(1, 1), inst(2, 2)]
    assert choose_instance(insts, 0, 0, 3, "i2", level=0).id == "i2"  # spilled there: stays
    assert choose_instance(insts, 0, 0, 3, "i2", level=2).id == "i0"  # the router moved it down
    assert choose_instance(insts, 0, 0, 3, "i2").id == "i0"  # the caller does not know: the target
    assert choose_instance(insts, 1, 0, 3, "i2", level=0).id == "i2"  # the choice went up: stays
    # never below the target
    assert choose_instance(insts, 2, 0, 3, "i1", level=2).id == "i2"


def test_a_full_target_never_shuffles_a_trajectory_inside_its_own_bucket():
    """Spilled down to bucket 0 while bucket 1 is still full: it stays on its instance rather than
    moving to a less loaded one of the same bucket."""
    insts = [inst(0, 0, outstanding=5), inst(1, 0, outstanding=0), inst(2, 1, outstanding=8)]
    assert choose_instance(insts, 1, 0, 2, "i0", level=1).id == "i0"
    insts[2].outstanding = 0  # room in its bucket again: it goes up
    assert choose_instance(insts, 1, 0, 2, "i0", level=1).id == "i2"


def test_a_spill_is_not_a_decision():
    """Bucket 0 full: the trajectory spills to bucket 1 and stays there while the router's own
    target is unchanged; a router that lowers its target moves it down once there is room."""
    r = make_router("oracle", B)
    insts = [inst(0, 0, outstanding=8), inst(1, 1), inst(2, 2)]
    d = r.route(req(turn=0, path=(), context=2000, cur=None, inst_id=None, true_final_tokens=2500), insts)
    assert (d.target, d.bucket) == (0, 1)
    insts[0].outstanding = 0  # room again in bucket 0
    again = req(
        context=2400, cur=d.bucket, inst_id=d.instance, true_final_tokens=2500, target_bucket=d.target
    )
    d2 = r.route(again, insts)
    assert (d2.bucket, d2.migrate) == (1, False)
    # without the target the caller cannot tell a spill, and the trajectory goes back to bucket 0
    d3 = r.route(req(context=2400, cur=1, inst_id="i1", true_final_tokens=2500), insts)
    assert (d3.bucket, d3.migrate) == (0, True)


# ---- spill: balance ---------------------------------------------------------------------------------


def test_balance_sends_a_turn_up_to_a_bucket_with_less_load_per_gpu():
    # outstanding per GPU: bucket 0 (TP1) 2, bucket 1 (TP2) 2, bucket 2 (TP4) 1
    insts = [inst(0, 0, outstanding=2), inst(1, 1, outstanding=4), inst(2, 2, outstanding=4)]
    assert choose_instance(insts, 0, 0, 3, None, price=per_gpu_load).id == "i2"
    assert choose_instance(insts, 0, 0, 3, None).id == "i0"  # without it: the target, which has room


def test_balance_keeps_the_target_when_idle_or_tied():
    assert choose_instance(one_per_bucket(), 0, 0, 3, None, price=per_gpu_load).id == "i0"
    tied = [inst(0, 0, outstanding=1), inst(1, 1, outstanding=2), inst(2, 2, outstanding=4)]
    assert choose_instance(tied, 0, 0, 3, None, price=per_gpu_load).id == "i0"


def test_balance_never_goes_below_the_target_nor_to_a_full_instance():
    insts = [inst(0, 0), inst(1, 1, outstanding=6), inst(2, 2, outstanding=7)]
    assert (
        choose_instance(insts, 1, 0, 3, None, price=per_gpu_load).id == "i2"
    )  # 7/4 < 6/2; i0 idle but below
    insts[2].outstanding = 8  # full (cap 8): it does not compete
    assert choose_instance(insts, 1, 0, 3, None, price=per_gpu_load).id == "i1"


def test_balance_does_not_move_a_trajectory_inside_its_bucket():
    # on i2 in bucket 2; the router now chooses bucket 0, which is busier per GPU than i2
    insts = [inst(0, 0, outstanding=4), inst(2, 2, outstanding=2), inst(3, 2)]
    assert choose_instance(insts, 0, 0, 3, "i2", level=2, price=per_gpu_load).id == "i2"  # not idle i3
    insts[0].outstanding = 0  # room in the chosen bucket: it moves down
    assert choose_instance(insts, 0, 0, 3, "i2", level=2, price=per_gpu_load).id == "i0"


def test_routers_spill_by_cost_by_default_and_keep_their_target():
    """Accuracy is scored on the target, so spill-over changes where a turn runs, not the decision.
    Without a cost model (no `TurnPricer`), the default `spill: cost` balances load per GPU."""
    insts = [inst(0, 0, outstanding=3), inst(1, 1, outstanding=4), inst(2, 2, outstanding=2)]
    first = req(turn=0, path=(), cur=None, inst_id=None, true_final_tokens=2500)
    d = make_router("oracle", B).route(first, insts)
    assert (d.target, d.bucket) == (0, 2)
    d = make_router("oracle", B, spill="cost").route(first, insts)
    assert (d.target, d.bucket) == (0, 2)
    d = make_router("oracle", B, spill="saturated").route(first, insts)
    assert (d.target, d.bucket) == (0, 0)
    for name in ("cmlfq", "cmlfq-paper", "classic-mlfq", "length-predictor", "context-prior"):
        assert make_router(name, B).params.spill == "cost"
    with pytest.raises(ConfigError, match="router_params.spill"):
        make_router("cmlfq", B, spill="always")
    with pytest.raises(ConfigError, match="no settings"):  # a length-blind router has no buckets to spill
        make_router("round-robin", B, spill="balance")
    with pytest.raises(ConfigError, match="one of: per_gpu"):
        make_router("least-loaded", B, spill="balance")


def test_a_full_kv_cache_saturates_new_placements_but_does_not_evict_its_own():
    insts = [inst(0, 0), inst(1, 0, outstanding=3), inst(2, 1)]
    insts[0].kv_usage = 0.95
    assert insts[0].saturated
    assert choose_instance(insts, 0, 0, 3, None).id == "i1"  # a new trajectory avoids the full cache
    assert choose_instance(insts, 0, 0, 3, "i0").id == "i0"  # the one whose KV is there stays


def test_saturated_bucket_falls_back_to_a_neighbour():
    insts = [inst(0, 0, outstanding=8), inst(1, 1, outstanding=3), inst(2, 2)]
    assert choose_instance(insts, 0, 0, 3, None).id == "i1"
    # a neighbour below the floor (too small for the context) is never used
    insts = [inst(0, 0), inst(1, 1, outstanding=8), inst(2, 2, outstanding=7)]
    assert choose_instance(insts, 1, 1, 3, None).id == "i2"


def test_all_saturated_still_routes_to_the_least_loaded_healthy():
    insts = [inst(0, 0, outstanding=9), inst(1, 1, outstanding=8, healthy=False), inst(2, 2, outstanding=12)]
    assert choose_instance(insts, 0, 0, 3, None).id == "i0"


def test_unhealthy_instances_are_never_chosen():
    insts = [inst(0, 0, healthy=False), inst(1, 1, outstanding=7)]
    assert choose_instance(insts, 0, 0, 3, "i0").id == "i1"


# ---- migration method ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coster(catalog):
    from libra.costmodel.rollout import RolloutCostModel

    hw, model = catalog.hardware("a800-80g"), catalog.model("qwen3-14b")
    return CostModelCoster([RolloutCostModel(hw, model, b.tp) for b in B])


def test_coster_kv_transfer_beats_reprefill_at_long_context(coster):
    kv, prefill = coster.costs(0, 2, 40_000, inter_node=False)
    assert kv < prefill
    kv_far, _ = coster.costs(0, 2, 40_000, inter_node=True)
    assert kv_far > kv  # the inter-node link is slower


def test_migration_method_choices(coster):
    insts = [inst(0, 0, node=0), inst(1, 1, node=1)]
    assert migration_method(coster, insts, None, insts[1], 5000) == MigrationMethod.NONE
    assert migration_method(coster, insts, "i1", insts[1], 5000) == MigrationMethod.NONE
    assert migration_method(coster, insts, "i0", insts[1], 5000) in (
        MigrationMethod.KV_TRANSFER,
        MigrationMethod.REPREFILL,
    )
    # the source is gone or unhealthy: its KV cache cannot be read
    assert migration_method(coster, insts, "gone", insts[1], 5000) == MigrationMethod.REPREFILL
    insts[0].healthy = False
    assert migration_method(coster, insts, "i0", insts[1], 5000) == MigrationMethod.REPREFILL
    # without a coster: KV transfer
    assert migration_method(None, [inst(0, 0), insts[1]], "i0", insts[1], 5000) == MigrationMethod.KV_TRANSFER


# ---- spill: cost ----------------------------------------------------------------------------------


def test_turn_price_grows_with_the_turns_running_and_shrinks_with_tp(coster):
    for bucket in range(3):
        prices = [coster.turn_price(bucket, n, 3000) for n in range(0, 64, 8)]
        assert prices == sorted(prices) and prices[0] > 0
    # idle, a larger TP decodes a token sooner (qwen3-14b on A800s)
    assert coster.turn_price(2, 0, 3000) < coster.turn_price(1, 0, 3000) < coster.turn_price(0, 0, 3000)
    # the price counts the delay a turn adds to those already running: more than its own step
    own, _ = coster.models[2].decode_coeffs(9)
    assert coster.turn_price(2, 8, 3000) > own + coster.models[2].decode_coeffs(9)[1] * 9 * 3000


def test_cost_sends_a_turn_to_an_idle_larger_tp_and_back_when_it_is_busy(coster):
    r = make_router("oracle", B, cost=coster)
    first = req(turn=0, path=(), cur=None, inst_id=None, true_final_tokens=2500)
    d = r.route(first, one_per_bucket())
    assert (d.target, d.bucket) == (0, 2)  # idle everywhere: the TP4 engine is the fastest
    busy = [inst(0, 0), inst(1, 1, outstanding=60, cap=256), inst(2, 2, outstanding=120, cap=256)]
    d = r.route(first, busy)
    assert (d.target, d.bucket) == (0, 0)  # each turn there would slow a hundred others
    # never below the target, never to a full instance; spill: balance ignores the cost model
    d = r.route(req(turn=0, path=(), cur=None, inst_id=None, true_final_tokens=8000), busy)
    assert d.bucket >= d.target == 1
    busy[1].outstanding = busy[1].cap
    assert r.route(req(turn=0, path=(), cur=None, inst_id=None, true_final_tokens=8000), busy).bucket == 2
    d = make_router("oracle", B, cost=coster, spill="balance").route(first, one_per_bucket())
    assert d.bucket == 0  # idle: per GPU the loads tie, and ties keep the target


@settings(max_examples=150)
@given(st.lists(st.integers(0, 40), min_size=3, max_size=3), st.integers(0, 2), st.integers(100, 30000))
def test_cost_picks_the_cheapest_instance_at_or_above_the_target(coster, loads, target, ctx):
    insts = [inst(k, k, outstanding=n, cap=64) for k, n in enumerate(loads)]
    price = lambda i: coster.turn_price(i.bucket, i.outstanding, ctx)  # noqa: E731
    chosen = choose_instance(insts, target, 0, 3, None, price=price)
    assert chosen.bucket >= target
    assert price(chosen) == min(price(i) for i in insts[target:])


class CheapPrefill:
    def costs(self, src, dst, tokens, inter_node):
        return 1.0, 0.1


def test_router_puts_the_cheaper_method_in_the_decision():
    r = make_router("oracle", B, cost=CheapPrefill())
    d = r.route(req(cur=0, inst_id="i0", true_final_tokens=30000), one_per_bucket())
    assert d.migrate and d.method == MigrationMethod.REPREFILL


# ---- baselines ------------------------------------------------------------------------------------


def test_classic_mlfq_demotes_one_level_per_threshold():
    r = make_router("classic-mlfq", B)
    assert r.route(req(context=4000, cur=0), one_per_bucket()).bucket == 0
    assert r.route(req(context=4200, cur=0), one_per_bucket()).bucket == 1
    assert r.route(req(context=12000, cur=1, inst_id="i1"), one_per_bucket()).bucket == 1
    assert r.route(req(context=12500, cur=1, inst_id="i1"), one_per_bucket()).bucket == 2
    gen = make_router("classic-mlfq", B, thresholds=[1000, 2000], measure="generated")
    assert gen.route(req(context=3000, cur=0), one_per_bucket()).bucket == 0  # 1000 generated: not past
    assert gen.route(req(context=3100, cur=0), one_per_bucket()).bucket == 1


def test_oracle_places_by_the_true_final_length_from_the_start():
    r = make_router("oracle", B)
    d = r.route(req(turn=0, path=(), cur=None, inst_id=None, true_final_tokens=20000), one_per_bucket())
    assert d.bucket == 2
    d = r.route(req(turn=0, path=(), cur=None, inst_id=None), one_per_bucket())
    assert d.bucket == 0  # without the truth it can only react


def test_length_predictor_learns_from_earlier_steps():
    r = make_router("length-predictor", B)
    first = req(turn=0, path=(), cur=None, inst_id=None)
    assert r.route(first, one_per_bucket()).bucket == 0  # nothing learned yet
    for i in range(6):
        r.on_finish(FinishedTrajectory(f"a{i}", "p", 0, (), (2000,), 9000))
        r.on_finish(FinishedTrajectory(f"b{i}", "q", 0, (), (2000,), 2500))
    r.on_step_end(0)
    assert r.route(first, one_per_bucket()).bucket == 1  # prompt p ran ~9K before
    other = RouteRequest("u", "q", 1, 0, 2000, 2000, 0)
    assert r.route(other, one_per_bucket()).bucket == 0
    # between tool returns it keeps its bucket
    assert r.route(req(cur=1, inst_id="i1", context=3000), one_per_bucket()).bucket == 1


def test_least_loaded_per_gpu_weighs_load_by_tp():
    insts = [inst(0, 0, outstanding=2), inst(1, 1, outstanding=3), inst(2, 2, outstanding=5)]
    first = req(turn=0, path=(), cur=None, inst_id=None)
    assert make_router("least-loaded", B).route(first, insts).instance == "i0"  # fewest requests
    assert (
        make_router("least-loaded", B, per_gpu=True).route(first, insts).instance == "i2"
    )  # 5/4 < 3/2 < 2/1


def test_round_robin_and_least_loaded_keep_affinity():
    insts = [inst(0, 0, outstanding=3), inst(1, 1, outstanding=1), inst(2, 2, outstanding=2)]
    ll = make_router("least-loaded", B)
    assert ll.route(req(turn=0, path=(), cur=None, inst_id=None), insts).instance == "i1"
    assert ll.route(req(cur=0, inst_id="i0"), insts).instance == "i0"
    rr = make_router("round-robin", B, seed=1)
    picks = [rr.route(RouteRequest(f"t{k}", "p", 0, 0, 10, 10, 0), insts).instance for k in range(4)]
    assert picks == ["i1", "i2", "i0", "i1"]


# ---- the registry --------------------------------------------------------------------------------


def test_registry_names():
    assert {"cmlfq", "cmlfq-paper", "classic-mlfq", "length-predictor", "least-loaded", "round-robin",
            "oracle"} <= set(ROUTERS)  # fmt: skip


def test_unknown_router_lists_the_known_names():
    with pytest.raises(ConfigError, match="cmlfq-paper") as e:
        make_router("c-mlfq", B)
    assert e.value.field == "rollout.router"


def test_bad_params_name_the_field():
    with pytest.raises(ConfigError, match="rollout.router_params.window"):
        make_router("cmlfq", B, window=0)
    with pytest.raises(ConfigError, match="one of: .*window"):  # an unknown name lists the known ones
        make_router("cmlfq-paper", B, windw=10)
    with pytest.raises(ConfigError, match="thresholds"):
        make_router("classic-mlfq", B, thresholds=[10])


def test_buckets_must_be_ordered():
    with pytest.raises(ConfigError, match="rollout.buckets"):
        make_router("cmlfq", [B[1], B[0]])
    with pytest.raises(ConfigError, match="rollout.buckets"):
        make_router("oracle", [])


class OutsideRouter(BaseRouter):
    name = "outside"

    def target(self, req, floor):
        return len(self.buckets) - 1, None


def test_dotted_path_plugs_in_an_outside_router():
    r = make_router("tests.test_rollout_routing:OutsideRouter", B)
    assert r.route(req(turn=0, path=(), cur=None, inst_id=None), one_per_bucket()).bucket == 2
    with pytest.raises(ConfigError, match="importable"):
        make_router("no.such.module:Router", B)
    with pytest.raises(ConfigError, match="route, on_finish"):
        make_router("builtins:dict", B)


def test_a_router_that_lowers_its_target_moves_the_trajectory_down():
    class Fixed(BaseRouter):
        name = "fixed-test"

        def __init__(self, bucket):
            super().__init__(B)
            self.bucket = bucket

        def target(self, req, floor):
            return self.bucket, None

    insts = [inst(0, 0), inst(1, 1), inst(2, 2)]
    down = Fixed(0).route(req(cur=2, inst_id="i2", target_bucket=2), insts)
    assert (down.bucket, down.target, down.migrate) == (0, 0, True)
    # raising the target to a bucket below where it sits keeps it there (no pointless move down)
    up = Fixed(1).route(req(cur=2, inst_id="i2", target_bucket=0), insts)
    assert (up.bucket, up.target, up.migrate) == (2, 1, False)


def test_shared_router_params_go_to_the_routers_that_have_them():
    """A simulation runs several routers on one `rollout.router_params`."""
    from libra.rollout.registry import params_for

    shared = {"spill": "saturated", "move_cost": 0.5}
    assert params_for("cmlfq", shared) == shared
    assert params_for("oracle", shared) == {"spill": "saturated"}
    assert params_for("least-loaded", shared) == {}
    with pytest.raises(ConfigError, match="router_params.movecost.*move_cost"):
        params_for("least-loaded", {"movecost": 1})


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.booleans()), min_size=1, max_size=8),
    target=st.integers(0, 2),
)
def test_balance_takes_the_least_load_per_gpu_at_or_above_the_target(loads, target):
    """For a new trajectory: when any instance at or above the target has room, the turn goes to
    one with the least outstanding/TP there (ties to the smaller bucket), never below the target."""
    insts = [inst(i, b, outstanding=o, healthy=h) for i, (b, o, h) in enumerate(loads)]
    if not any(i.healthy for i in insts):
        with pytest.raises(NoInstanceError):
            choose_instance(insts, target, 0, 3, None, price=per_gpu_load)
        return
    chosen = choose_instance(insts, target, 0, 3, None, price=per_gpu_load)
    assert chosen.healthy
    room = [i for i in insts if i.bucket >= target and not i.saturated]
    if not room:
        return
    key = min((i.outstanding / i.tp, i.bucket) for i in room)
    assert (chosen.outstanding / chosen.tp, chosen.bucket) == key
