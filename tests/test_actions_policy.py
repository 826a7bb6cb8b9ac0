"""The pure policy side of action orchestration: resource vectors, profiles, topology operators and
their exact split, the elastic scheduler, and the orchestrator with its CPU, GPU and quota managers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.actions import Action, ActionState, EfficiencyProfile, Orchestrator, ResourceVector
from libra.actions.cpu import CpuManager, CpuNode
from libra.actions.gpu import GpuManager, GpuService
from libra.actions.model import ActionRecord, LifecycleError
from libra.actions.profiles import load_profiles
from libra.actions.quota import QuotaManager, QuotaSpec
from libra.actions.resources import Discrete, Range, parse_feasible
from libra.actions.scheduler import ElasticScheduler, Pool, SchedulerView
from libra.actions.topology import Buddy, Fungible, SplitItem, free_block_spans
from libra.core.errors import ConfigError
from libra.sim.kernel import Kernel

AMDAHL = EfficiencyProfile.amdahl("amdahl", 0.05, (1, 2, 4, 8, 16))


def cpu_action(i, t1=10.0, lo=1, hi=1, profile=AMDAHL, traj=None, mem=0.0, **quota):
    demand = ResourceVector.from_mapping({"cpu": [lo, hi], "memory": mem, **quota}, key="cpu")
    return Action(f"a{i}", traj or f"t{i}", "test", t1, demand, profile if hi > lo else None, seq=i)


# ---- resource vectors and profiles ---------------------------------------------------------------


def test_feasible_sets_parse_and_reject():
    assert parse_feasible(4, "cpu") == Range(4, 4)
    assert list(parse_feasible([1, 4], "cpu").values()) == [1, 2, 3, 4]
    assert list(parse_feasible({"set": [8, 1, 2, 4]}, "gpu").values(cap=4)) == [1, 2, 4]
    assert 3 not in Discrete((1, 2, 4))
    for bad in ([4, 1], {"set": []}, "x", True, {"range": [1]}):
        with pytest.raises(ConfigError) as e:
            parse_feasible(bad, "cpu")
        assert "cpu" in str(e.value)


def test_resource_vector_names_and_key():
    v = ResourceVector.of("cpu", cpu=[1, 8], memory=2, quota_search=1)
    assert v.names == ("cpu", "memory", "quota:search")
    assert v.quotas() == (("search", 1),)
    with pytest.raises(ConfigError, match="quota:NAME"):
        ResourceVector.from_mapping({"disk": 1})
    with pytest.raises(ConfigError, match="key"):
        ResourceVector.from_mapping({"cpu": 1}, key="gpu")


def test_profile_interpolates_and_stays_flat_past_measurements():
    p = EfficiencyProfile.from_mapping("p", {1: 1.0, 4: 0.8})
    assert p.efficiency(2) == pytest.approx(1.0 - 0.2 / 3)
    assert p.speedup(4) == pytest.approx(3.2)
    assert p.speedup(8) == pytest.approx(3.2)  # never extrapolated upward
    assert p.duration(32.0, 4) == pytest.approx(10.0)
    with pytest.raises(ConfigError):
        EfficiencyProfile.from_mapping("bad", {1: 1.5})
    profs = load_profiles({"a": {"amdahl": 0.1, "units": [1, 2]}, "b": {1: 1.0}})
    assert profs["a"].efficiency(2) == pytest.approx(1 / 1.1)


def test_unknown_elasticity_gets_its_minimum():
    a = cpu_action(0, lo=2, hi=8, profile=None)
    assert a.key_options() == (2,)
    assert a.duration(8) == a.t1


def test_lifecycle_checks_the_starting_state():
    rec = ActionRecord(cpu_action(0))
    with pytest.raises(LifecycleError):
        rec.finish(1.0)
    rec.start(1.0, 1)
    with pytest.raises(LifecycleError):
        rec.cancel(2.0)
    rec.finish(3.0, ActionState.FAILED)
    assert rec.act_s == 3.0 and rec.queue_s == 1.0


# ---- topology operators --------------------------------------------------------------------------


def brute_force(items, capacity, operator):
    best = None
    for plan in itertools.product(*[it.sizes for it in items]):
        usage = operator.zero()
        for m in plan:
            usage = operator.charge(usage, m)
        if operator.fits(usage, capacity):
            cost = sum(it.cost(m) for it, m in zip(items, plan, strict=True))
            best = cost if best is None or cost < best else best
    return best


profiles = st.sampled_from(
    [AMDAHL, EfficiencyProfile.from_mapping("odd", {1: 1.0, 2: 0.6, 3: 0.9, 6: 0.5}), None]
)


@st.composite
def fungible_items(draw):
    n = draw(st.integers(1, 6))
    items = []
    for _ in range(n):
        prof, t1 = draw(profiles), draw(st.floats(0.1, 50))
        lo = draw(st.integers(1, 3))
        hi = lo if prof is None else draw(st.integers(lo, lo + 5))
        items.append(
            SplitItem(
                tuple(range(lo, hi + 1)),
                (lambda m, p=prof, t=t1: t if p is None else p.duration(t, m)),
                None if prof is None else (prof.name, lo, hi),
                t1,
            )
        )
    cap = sum(it.sizes[0] for it in items) + draw(st.integers(0, 12))
    return items, cap


@settings(max_examples=150, deadline=None)
@given(fungible_items())
def test_fungible_split_is_exact(case):
    items, cap = case
    cost, alloc = Fungible().split(items, (cap,))
    assert sum(alloc) <= cap
    assert all(m in it.sizes for it, m in zip(items, alloc, strict=True))
    assert cost == pytest.approx(sum(it.cost(m) for it, m in zip(items, alloc, strict=True)))
    assert cost == pytest.approx(brute_force(items, (cap,), Fungible()))


def test_buddy_capacity_counts_aligned_blocks():
    b = Buddy(8)
    # GPUs 1 and 2 are free but not an aligned pair; 4..7 are a free aligned block of 4.
    flags = [False, True, True, False, True, True, True, True]
    assert free_block_spans(flags) == [(1, 1), (2, 1), (4, 4)]
    assert b.capacity([flags]) == (6, 4, 4, 0)
    assert b.sizes((1, 2, 3, 4, 8, 16)) == (1, 2, 4, 8)


def place_largest_first(flags_by_node, sizes):
    """Place chunks on real idle flags, largest first; True when every one finds an aligned slot."""
    flags = [list(f) for f in flags_by_node]
    for m in sorted(sizes, reverse=True):
        slot = next(
            ((n, s) for n, f in enumerate(flags) for s in range(0, len(f) - m + 1, m) if all(f[s : s + m])),
            None,
        )
        if slot is None:
            return False
        n, s = slot
        flags[n][s : s + m] = [False] * m
    return True


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=1, max_size=2),
    st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.floats(1, 30)), min_size=1, max_size=4),
)
def test_buddy_split_is_exact_and_placeable(flags, specs):
    b = Buddy(8)
    cap = b.capacity(flags)
    items = [
        SplitItem(b.sizes([m for m in (1, 2, 4, 8) if m >= lo]), lambda m, t=t: t / (m * (1 - 0.03 * m)))
        for lo, t in specs
    ]
    best = brute_force(items, cap, b)
    if best is None:
        with pytest.raises(ValueError):
            b.split(items, cap)
        return
    cost, plan = b.split(items, cap)
    assert cost == pytest.approx(best)
    assert place_largest_first(flags, plan)


# ---- the scheduler -------------------------------------------------------------------------------


def view(actions, cores=8, releases=(), pools=None, pool_of=None, ledger=None):
    pools = pools or {0: Pool(0, Fungible(), (cores,), list(releases))}
    return SchedulerView(0.0, actions, pools, pool_of or (lambda a: 0), ledger)


def test_admits_the_fcfs_prefix_at_minimum_and_never_overtakes():
    acts = [cpu_action(0, lo=3, hi=3), cpu_action(1, lo=6, hi=6), cpu_action(2, lo=1, hi=1)]
    d = ElasticScheduler().decide(view(acts, cores=8))
    # a1 does not fit after a0; a2 would fit but must not overtake a1 in the same pool.
    assert [g.action.id for g in d.grants] == ["a0"]


def test_a_full_pool_does_not_block_another_pool():
    acts = [cpu_action(0, lo=4, hi=4), cpu_action(1, lo=4, hi=4), cpu_action(2, lo=1, hi=1)]
    pools = {n: Pool(n, Fungible(), (4,)) for n in (0, 1)}
    where = {"a0": 0, "a1": 0, "a2": 1}
    d = ElasticScheduler().decide(view(acts, pools=pools, pool_of=lambda a: where[a.id]))
    assert [g.action.id for g in d.grants] == ["a0", "a2"]


def test_spare_units_go_to_elastic_actions_when_nothing_waits():
    acts = [cpu_action(0, t1=40, hi=16), cpu_action(1, t1=1, profile=None)]
    d = ElasticScheduler().decide(view(acts, cores=8))
    units = {g.action.id: g.units for g in d.grants}
    assert units == {"a0": 7, "a1": 1}


def test_evicts_from_the_back_only_when_the_estimate_improves():
    # One long elastic job and a short rigid one behind it, on 4 cores. Evicting the short job
    # gives the long one 4 cores; it then waits a quarter of the long job instead of nothing.
    long_first = [cpu_action(0, t1=100, hi=4), cpu_action(1, t1=1, lo=1, hi=1, profile=None)]
    d = ElasticScheduler().decide(view(long_first, cores=4))
    assert {g.action.id for g in d.grants} == {"a0", "a1"}
    # Many equal elastic jobs and a queue: splitting wider would only delay the queue.
    many = [cpu_action(i, t1=10, hi=4) for i in range(12)]
    d = ElasticScheduler().decide(view(many, cores=4))
    assert len(d.grants) == 4 and all(g.units == 1 for g in d.grants) and d.evicted == 0


def test_eviction_happens_when_it_pays():
    # Two perfectly elastic jobs on 2 cores (E = 1): running them one after the other at 2 cores
    # each finishes the first at 5 and the second at 10 (total 15), against 10 + 10 side by side.
    perfect = EfficiencyProfile.from_mapping("perfect", {1: 1.0, 2: 1.0})
    acts = [cpu_action(i, t1=10, hi=2, profile=perfect) for i in range(2)]
    d = ElasticScheduler().decide(view(acts, cores=2))
    assert [(g.action.id, g.units) for g in d.grants] == [("a0", 2)]
    assert d.evicted == 1 and d.estimated_act_s == pytest.approx(15.0)


def test_depth_bounds_the_playout_but_counts_every_action():
    acts = [cpu_action(i, t1=10) for i in range(10)]
    shallow = ElasticScheduler(depth=1).decide(view(acts, cores=2))
    deep = ElasticScheduler(depth=100).decide(view(acts, cores=2))
    # Exact FCFS on 2 cores: finishes at 10,10,20,20,...,50,50 -> 300. Depth 1 plays out one
    # wave (a2, a3 from 10 to 20) and works through the other six as a fluid from 20 on:
    # 6 x 20 + 60 s of execution + 150 core-s ahead of them / 2 cores.
    assert deep.estimated_act_s == pytest.approx(300.0)
    assert shallow.estimated_act_s == pytest.approx(20 + 40 + 120 + 60 + 75)
    assert len(shallow.grants) == len(deep.grants) == 2


@st.composite
def snapshots(draw):
    n = draw(st.integers(0, 25))
    acts = []
    for i in range(n):
        lo = draw(st.integers(1, 4))
        hi = draw(st.integers(lo, 8))
        acts.append(cpu_action(i, t1=draw(st.floats(0.1, 60)), lo=lo, hi=hi))
    running = draw(st.lists(st.tuples(st.floats(0, 30), st.integers(1, 3)), max_size=3))
    return acts, running, draw(st.integers(4, 16))


@settings(max_examples=120, deadline=None)
@given(snapshots())
def test_decisions_respect_capacity_fcfs_and_feasible_sets(snap):
    acts, running, cores = snap
    used = sum(u for _, u in running)
    free = max(0, cores - used)
    d = ElasticScheduler().decide(view(acts, cores=free, releases=running))
    assert sum(g.units for g in d.grants) <= free
    assert d.admitted_at_min == len(d.grants) + d.evicted  # evicted ones were admitted, then held back
    ids = [g.action.id for g in d.grants]
    assert ids == [a.id for a in acts[: len(ids)]]  # one pool: always a prefix
    for g in d.grants:
        assert g.units in g.action.key_options() or g.units == g.action.min_units


# ---- managers ------------------------------------------------------------------------------------


def test_cpu_manager_pins_prefers_one_numa_domain_and_reserves_memory():
    m = CpuManager([CpuNode.uniform(8, 2, memory_gib=4), CpuNode.uniform(8, 2, memory_gib=4, first=8)])
    assert m.pin("t1", 3) == 0 and m.pin("t1", 3) == 0
    assert m.pin("t2", 3) == 1
    assert m.pin("t3", 3) is None  # no node has 3 GiB left
    cores = m.allocate("x", 0, 3)
    assert set(cores) <= set(range(4)) or set(cores) <= set(range(4, 8))
    m.allocate("y", 0, 4)  # the other domain, whole
    assert m.free_count(0) == 1
    m.release("x")
    m.unpin("t1")
    assert m.pin("t3", 3) == 0


def test_gpu_manager_restores_on_demand_reuses_and_evicts_lru():
    svc = {s: GpuService(name=s, state_gib=60, workspace_gib=10) for s in ("a", "b", "c")}
    g = GpuManager([4], gpu_memory_gib=80, services=svc)
    p = g.place("x1", "a", 1, now=0.0)
    assert p.restore_s > 0 and g.restores == 1
    g.release("x1", now=1.0)
    assert g.resident_idle("a", 1)
    p = g.place("x2", "a", 1, now=2.0)
    assert p.restore_s == 0 and g.restores == 1  # a chunk that already holds it
    g.release("x2", now=3.0)
    g.place("y1", "b", 1, now=4.0)
    g.place("y2", "c", 1, now=4.0)
    g.place("y3", "a", 2, now=4.0)  # (a, 2) is a different service from (a, 1)
    assert g.restores == 4
    assert g.capacity() == (0, 0, 0)  # one action per GPU: all busy
    with pytest.raises(ValueError):
        g.place("y4", "b", 1, now=5.0)


def test_quota_caps_concurrency_and_tokens_per_period():
    q = QuotaManager({"search": QuotaSpec(max_concurrency=2, tokens_per_period=3, period_s=10)})
    scratch = q.scratch(0.0)
    assert scratch.fits((("search", 1),))
    scratch.take((("search", 1),))
    scratch.take((("search", 1),))
    assert not scratch.fits((("search", 1),))  # concurrency
    q.acquire("r1", (("search", 2),), 0.0)
    q.release("r1")
    assert not q.scratch(1.0).fits((("search", 2),))  # 2 + 2 > 3 tokens in this window
    assert q.scratch(10.0).fits((("search", 2),))  # the next window
    with pytest.raises(ConfigError, match="tokens_per_period"):
        q.check("search", 5)


# ---- the orchestrator, driven by a tiny event loop -------------------------------------------------


def drive(orch: Orchestrator, arrivals, seed=0):
    """Run actions through the orchestrator on the simulated clock, checking invariants as it goes."""
    k = Kernel(seed)
    done = []

    def dispatch():
        for s in orch.decide(k.now):
            k.after(s.expected_s, finish, s)
        w = orch.wake_at(k.now)
        if w is not None and orch.running == 0:
            k.at(w, dispatch)
        check()

    def finish(s):
        orch.complete(s.action.id, k.now)
        done.append(s.action.id)
        dispatch()

    def check():
        if orch.cpu is not None:
            for n, node in enumerate(orch.cpu.nodes):
                assert 0 <= orch.cpu.free_count(n) <= node.cores
        if orch.quota is not None:
            for name, spec in orch.quota.specs.items():
                assert spec.max_concurrency is None or orch.quota.in_flight(name) <= spec.max_concurrency

    for t, a in arrivals:
        k.at(t, lambda a=a: (orch.submit(a, k.now), dispatch()))
    k.run()
    return done


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_no_action_is_lost_and_capacity_holds(seed):
    import random

    rng = random.Random(seed)
    orch = Orchestrator(
        cpu=CpuManager([CpuNode.uniform(4, 2, 8), CpuNode.uniform(6, 1, 8, first=4)]),
        quota=QuotaManager({"api": QuotaSpec(max_concurrency=2, tokens_per_period=5, period_s=20)}),
    )
    arrivals = []
    for i in range(30):
        extra = {"quota:api": 1} if rng.random() < 0.3 else {}
        a = cpu_action(i, t1=rng.uniform(0.5, 20), hi=rng.choice([1, 4]), traj=f"t{i % 7}", mem=2.0, **extra)
        arrivals.append((rng.uniform(0, 50), a))
    done = drive(orch, arrivals)
    assert sorted(done) == sorted(a.id for _, a in arrivals)
    assert all(r.state == ActionState.SUCCEEDED for r in orch.records.values())
    assert orch.cpu.busy_count() == 0


def test_same_seed_same_schedule():
    def run():
        orch = Orchestrator(cpu=CpuManager([CpuNode.uniform(4)]))
        acts = [(float(i % 5), cpu_action(i, t1=1 + i % 3, hi=4)) for i in range(20)]
        drive(orch, acts)
        return [(r.action.id, r.started, r.ended, r.units) for r in orch.records.values()]

    assert run() == run()


def test_orchestrator_rejects_what_could_never_run():
    orch = Orchestrator(cpu=CpuManager([CpuNode.uniform(4, memory_gib=8)]))
    with pytest.raises(ConfigError, match="cores"):
        orch.submit(cpu_action(0, lo=8, hi=8), 0.0)
    with pytest.raises(ConfigError, match="memory"):
        orch.submit(cpu_action(1, mem=64), 0.0)
    with pytest.raises(ConfigError, match="quota"):
        orch.submit(cpu_action(2, **{"quota:x": 1}), 0.0)
    gpu_act = Action("g", "t", "rm", 1.0, ResourceVector.of("gpu", gpu={"set": [1, 2]}), service="rm")
    with pytest.raises(ConfigError, match="GPU manager"):
        orch.submit(gpu_act, 0.0)


def test_gpu_actions_go_through_the_same_orchestrator():
    svc = {"rm": GpuService(name="rm", state_gib=30, workspace_gib=8)}
    orch = Orchestrator(gpu=GpuManager([8], 80, svc))
    prof = EfficiencyProfile.from_mapping("tp", {1: 1.0, 2: 0.95, 4: 0.9, 8: 0.8})
    acts = [
        (
            0.0,
            Action(
                f"g{i}",
                f"t{i}",
                "rm",
                40.0,
                ResourceVector.of("gpu", gpu={"set": [1, 2, 4, 8]}),
                prof,
                service="rm",
            ),
        )
        for i in range(3)
    ]
    done = drive(orch, acts)
    assert sorted(done) == ["g0", "g1", "g2"]
    recs = list(orch.records.values())
    assert all(r.units in (1, 2, 4, 8) for r in recs)
    for r in recs:  # never more GPUs at once than the node has
        assert sum(o.units for o in recs if o.started <= r.started < o.ended) <= 8
    assert orch.gpu.busy_count() == 0
    # Three equal jobs at once: running them one after another on all 8 GPUs finishes the
    # first three times sooner; only the first one pays a restore, the others find it loaded.
    assert [r.units for r in recs] == [8, 8, 8]
    assert [r.restore_s > 0 for r in recs] == [True, False, False]
