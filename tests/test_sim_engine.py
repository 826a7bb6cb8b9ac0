"""The simulated engine: closed-form segments, KV capacity, preemption, prefix reuse, KV policies."""

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from libra.costmodel.rollout import RolloutCostModel
from libra.sim.engine import Engine, KVPolicy, Seq
from libra.sim.kernel import Kernel


@pytest.fixture(scope="module")
def cost(catalog):
    return RolloutCostModel(catalog.hardware("a800-80g"), catalog.model("qwen3-8b"), 1)


@pytest.fixture(scope="module")
def small_cost(catalog):
    """A tiny KV cache (qwen3-8b on a 24 GB card) so that preemption happens."""
    cm = RolloutCostModel(
        catalog.hardware("rtx-4090"), catalog.model("qwen3-4b"), 1, max_num_batched_tokens=2048
    )
    assert 5_000 < cm.kv_capacity_tokens() < 100_000
    return cm


def _run(cost, reqs, max_seg=None, max_num_seqs=64, check=None, **kw):
    k = Kernel(0)
    eng = Engine(k, "e", cost, max_num_seqs, cost.max_num_batched_tokens, max_segment_steps=max_seg, **kw)
    done = []
    seqs = []
    for i, (t, ctx, out) in enumerate(reqs):
        s = Seq(i, ctx, out, on_done=done.append)
        seqs.append(s)
        k.at(t, eng.submit, s)
    while k.peek() < float("inf"):
        k.run(max_events=1)
        if check:
            check(eng)
    return eng, seqs, done


REQS = [
    (0.0, 1000, 200),
    (0.0, 3000, 50),
    (0.05, 500, 400),
    (0.5, 8000, 10),
    (0.51, 100, 1000),
    (2.0, 2000, 300),
]


def test_closed_form_matches_stepping(cost):
    """Advancing a decode segment analytically gives the same times as one iteration per event."""
    _, fast, _ = _run(cost, REQS)
    _, slow, _ = _run(cost, REQS, max_seg=1)
    for a, b in zip(fast, slow, strict=True):
        assert a.t_first == pytest.approx(b.t_first, rel=1e-9)
        assert a.t_done == pytest.approx(b.t_done, rel=1e-9)


def test_fewer_events_than_iterations(cost):
    k1, _, _ = _run(cost, REQS)
    k2, _, _ = _run(cost, REQS, max_seg=1)
    assert k1.step_no == k2.step_no
    assert k1.k.events_run * 20 < k2.k.events_run


def test_decode_time_matches_cost_model(cost):
    eng, (s,), _ = _run(cost, [(0.0, 1000, 101)])
    expect = cost.step_time(1000, 1000 * 1001 / 2, 0, 0)
    expect += sum(cost.decode_time(1, 1001 + i) for i in range(100))
    assert s.t_done == pytest.approx(expect, rel=1e-9)


def test_max_num_seqs_limits_batch(cost):
    reqs = [(0.0, 100, 500)] * 10
    eng, seqs, _ = _run(cost, reqs, max_num_seqs=4)
    firsts = sorted(s.t_first for s in seqs)
    assert firsts[4] > firsts[3]  # the fifth waited for a slot


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 6000), st.integers(1, 800)), min_size=1, max_size=40),
       st.sampled_from(list(KVPolicy)))  # fmt: skip
def test_invariants_under_pressure(small_cost, reqs, policy):
    """Every request finishes exactly once, KV never exceeds capacity, time never goes back."""
    last = [0.0]

    def check(eng):
        assert eng.kv_used() <= eng.kv_cap
        assert eng.k.now >= last[0]
        last[0] = eng.k.now

    eng, seqs, done = _run(small_cost, reqs, check=check, kv_policy=policy)
    assert sorted(s.key for s in done) == list(range(len(reqs)))
    assert all(s.t_first <= s.t_done for s in seqs)
    assert eng.outstanding == 0 and eng.n_dec == 0 and eng.ctx_sum == 0 and eng.kv_pref == 0


def test_preemption_recomputes(small_cost):
    cap = small_cost.kv_capacity_tokens()
    reqs = [(0.0, cap // 8, cap // 4)] * 6  # outputs grow past the cache
    eng, seqs, done = _run(small_cost, reqs)
    assert eng.preemptions > 0 and len(done) == 6
    assert eng.prefill_tokens > sum(r[1] for r in reqs)  # recompute prefilled again


def _two_turns(cost, policy, same_engine=True):
    k = Kernel(0)
    a = Engine(k, "a", cost, kv_policy=policy)
    b = Engine(k, "b", cost, kv_policy=policy)
    second = b if not same_engine else a
    out = {}

    def turn1_done(s):
        k.after(1.0, second.submit, Seq("t", s.ctx + 500, 50, on_done=lambda s2: out.setdefault("s2", s2)))

    a.submit(Seq("t", 4000, 100, on_done=turn1_done, keep_kv=True))
    k.run()
    return out["s2"]


def test_prefix_reuse_same_instance_only(cost):
    same = _two_turns(cost, KVPolicy.RESIDENT)
    other = _two_turns(cost, KVPolicy.RESIDENT, same_engine=False)
    assert same.prefilled == 500 and other.prefilled == 4600


def test_kv_policies_during_tool(cost):
    assert _two_turns(cost, KVPolicy.DROP).prefilled == 4600
    off = _two_turns(cost, KVPolicy.OFFLOAD)
    res = _two_turns(cost, KVPolicy.RESIDENT)
    assert off.prefilled == 500
    assert off.t_done > res.t_done  # reloading from host memory takes time


def test_request_larger_than_cache_is_reported(small_cost):
    with pytest.raises(RuntimeError, match="exceeds the KV cache"):
        _run(small_cost, [(0.0, small_cost.kv_capacity_tokens() + 10, 5)])


def test_driver_spills_agents_past_an_engines_kv_commitment(small_cost):
    """Agents keep their KV between turns, so an engine's commitment is the contexts of every
    trajectory living on it, in a turn or in a tool call. Past 90% of the cache the router sees the
    engine saturated and starts new agents in the neighbouring bucket instead of thrashing it; the
    commitment returns to zero when they finish."""
    from libra.core.trajectory import Trajectory, Turn
    from libra.rollout.base import Bucket
    from libra.rollout.registry import make_router
    from libra.sim.rl.driver import RolloutDriver

    k = Kernel(0)
    cap = small_cost.kv_capacity_tokens()
    engines = [Engine(k, n, small_cost, 64, small_cost.max_num_batched_tokens) for n in ("small", "big")]
    buckets = [Bucket("s", 1, cap), Bucket("l", 1, 10 * cap)]
    # saturated: the neighbour takes work only when the small engine is full (balance would share
    # it between the two TP1 engines from the start)
    router = make_router("cmlfq-paper", buckets, seed=0, spill="saturated")
    drv = RolloutDriver(k, engines, buckets, {"small": 0, "big": 1}, router, {"small": 0, "big": 0}, 1.0)
    prompt = cap // 8
    trajs = [Trajectory(f"t{i}", f"p{i}", 0, prompt, [Turn(16, "bash", 16, tool_latency_s=60.0), Turn(16)])
             for i in range(12)]  # fmt: skip
    homes = []
    for t in trajs:
        before = dict(drv.committed)
        drv.start(t)
        homes += [drv.views[e].bucket for e in drv.committed if drv.committed[e] > before[e]]
    assert homes[:8] == [0] * 8  # up to 90% of the cache: the smallest bucket, as C-MLFQ starts
    assert set(homes[8:]) == {1}  # then the small engine is saturated: the neighbour takes the rest
    assert drv.views["small"].saturated and drv.committed["small"] >= 0.9 * cap
    k.run()
    assert len(drv.finished) == 12 and drv.committed == {"small": 0, "big": 0}


def _tpot_and_peak(cost, reqs, cap, exact=False):
    k = Kernel(0)
    eng = Engine(k, "e", cost, 32, cost.max_num_batched_tokens, max_segment_steps=1 if exact else None)
    eng.kv_cap = cap
    seqs = [Seq(i, ctx, out) for i, (_, ctx, out) in enumerate(reqs)]
    for (t, _, _), s in zip(reqs, seqs, strict=True):
        k.at(t, eng.submit, s)
    peak = 0
    while k.peek() < float("inf"):
        k.run(max_events=1)
        peak = max(peak, eng.ctx_sum + eng.kv_pref)
    tpot = [(s.t_done - s.t_first) / (s.out_total - 1) for s in seqs if s.out_total > 1]
    return sum(tpot) / len(tpot), peak, eng.preemptions


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.floats(0, 3), st.integers(50, 3000), st.integers(2, 1500)), min_size=5, max_size=60)
)
@example([(0.0, 50, 2), (0.0, 50, 2), (0.0, 50, 89), (1.0, 50, 2), (1.0, 810, 2)])
def test_no_preemption_cascade_when_the_cache_shrinks_by_15_percent(small_cost, reqs):
    """The working set (the KV in use at the busiest moment of an unconstrained run) fits in the
    cache either way; shrinking the cache by 15% to exactly that costs a handful of preemptions,
    never a cascade: at most one per request, and mean TPOT at most 2x. (The
    engine before vLLM V1's rules, admitting every request whose prompt fitted on its own, without
    the step's token budget, preempted 1,750 times for 300 requests on the RTX 4090 trace; one
    before that, admitting before the running requests grew, reached 2.3x TPOT here.) One
    preemption alone may pass 2x on a handful of two-token requests, where a request's TPOT is a
    single interval (the example: the 810-token prompt recomputed once makes its one interval 6x),
    so past 2x exactly one preemption is allowed."""
    _, peak, _ = _tpot_and_peak(small_cost, reqs, 10**9, exact=True)
    cap = int(peak / 0.85) + 1
    full, _, _ = _tpot_and_peak(small_cost, reqs, cap)
    shrunk, _, preempted = _tpot_and_peak(small_cost, reqs, int(0.85 * cap))
    assert preempted <= len(reqs), preempted
    assert shrunk <= 2 * full or preempted == 1, (shrunk / full, preempted)


def test_no_cascade_on_the_rtx4090_trace(catalog):
    """vLLM allocated 41,408 KV tokens for the 24 GB trace; the simulator computed 14% fewer before
    it followed vLLM's memory profile, and then preempted 1,750 times. With vLLM V1's scheduling
    rules, a 15% smaller cache preempts about as often as vLLM's own size (each about two thirds of
    the requests, recomputing little under prefix caching) and costs latency, not a cascade."""
    from libra.sim.replay.vllm import compare, load_bench

    bench = load_bench(Path(__file__).parent / "data" / "vllm-bench" / "RTX4090_Llama-3.1-8B", catalog)
    runs = {}
    for cap in (41_408, 35_196):
        bench.vllm_kv_tokens = cap
        res = compare(bench, catalog)
        runs[cap] = (res["instances"][0]["preemptions"], res["error"]["latency_mean"])
    (p_full, lat_full), (p_small, lat_small) = runs[41_408], runs[35_196]
    assert p_small <= 1.25 * p_full + 5 and p_small < len(bench.requests), runs
    assert lat_full < lat_small < lat_full + 0.2, runs


def test_data_parallel_moe_ranks_step_together(catalog):
    """Two data-parallel ranks of an MoE model (`LockstepGroup`): one prefills an 8,000-token
    prompt in four 2,048-token chunks while the other decodes a short request. Every step ends on
    both at once, padded to the larger batch, so the decoding rank's first four tokens each take
    a whole prefill step; alone, it would decode at its own pace."""
    from libra.sim.engine import LockstepGroup

    cost = RolloutCostModel(catalog.hardware("h100-80g"), catalog.model("qwen3-30b-a3b"), 1,
                            max_num_batched_tokens=2048, ep=2)  # fmt: skip

    def run(grouped: bool) -> tuple[Seq, Seq, int]:
        k = Kernel(0)
        a, b = Engine(k, "a", cost, 64, 2048), Engine(k, "b", cost, 64, 2048)
        group = LockstepGroup(k, [a, b]) if grouped else None
        long, short = Seq(0, 8000, 2), Seq(1, 16, 50)
        a.submit(long)
        b.submit(short)
        k.run()
        return long, short, group.steps if group else 0

    long, short, steps = run(True)
    _, alone, _ = run(False)
    chunk = cost.step_time(2048, 2048 * 2049 / 2, 0, 0.0)
    # The long prompt's first chunk started alone (the short request was submitted just after):
    # then the short one's prefill and 49 decodes, the long one's 3 chunks and 1 decode inside them.
    assert steps == 51
    assert short.t_first >= chunk + cost.step_time(16, 136, 0, 0.0, 2048)  # padded to 2,048 tokens
    assert short.t_done - alone.t_done > 3 * (chunk - cost.decode_time(1, 40))
    assert long.t_done < short.t_done
