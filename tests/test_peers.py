"""The peers' mechanisms on tiny scenarios: each system's defining behaviour, and bad input.

- The engine: an interrupt aborts what it holds at the end of its iteration, hands each request
  back with what it wrote, drops the KV and pauses; waiting requests go by priority.
- AReaL: a weight update interrupts the requests in flight, which recompute their KV and carry
  tokens of two versions; admission keeps the bound eta.
- APRIL: a step stops at its target, the unfinished trajectories resume in the next step with
  their tokens' version tags, nothing is trained twice or lost, and no token is older than the bound.
- Seer: divided rollout submits a turn in chunks; speculative decoding lowers the per-token cost at
  small batches and falls back to plain decoding at large ones.
- Heddle: a turn's KV moves while its tool runs; queues go longest predicted remaining first.
- An unknown peer option, or a staleness bound below what a system needs: exit 2, naming the field.
"""

from __future__ import annotations

import pytest

from libra.core.errors import ConfigError
from libra.core.trajectory import Trajectory, Turn
from libra.costmodel.rollout import RolloutCostModel
from libra.costmodel.speculative import SpecDecoding, SpeculativeCostModel
from libra.rollout.base import Bucket, RouteDecision
from libra.rollout.registry import make_router
from libra.sim.engine import Engine, Seq, SeqState
from libra.sim.kernel import Kernel
from libra.sim.rl import pipeline
from libra.sim.rl.driver import RolloutDriver
from libra.sim.rl.pipeline import Batches, RLSim
from libra.sim.rl.systems import make_system
from libra.sim.scenarios import parse_scenario
from tests.conftest import run_cli
from tests.test_sim_pipeline import SMALL


@pytest.fixture(scope="module")
def cost(catalog):
    return RolloutCostModel(catalog.hardware("a800-80g"), catalog.model("qwen3-8b"), 1)


def _sim(system: str, steps: int = 3, **over) -> RLSim:
    sc = parse_scenario({**SMALL, **over})
    sim = RLSim(sc, make_system(system), Batches(sc, 0), steps, 0)
    sim.run()
    return sim


# ---- the engine ---------------------------------------------------------------------------------


def test_interrupt_aborts_at_the_iterations_end_drops_kv_and_pauses(cost):
    k = Kernel(0)
    eng = Engine(k, "e", cost)
    done, aborted = [], []
    seqs = [Seq(i, 500, 400, on_done=done.append) for i in range(3)]
    for s in seqs:
        eng.submit(s)
    k.run(until=1.0)
    assert not done and eng.n_dec == 3
    eng.interrupt(lambda seq, n: aborted.append((seq, n)))
    k.run(until=1.5)
    assert [s for s, _ in aborted] == seqs  # in admission order
    assert all(0 < n < 400 and s.state == SeqState.ABORTED for s, n in aborted)
    assert eng.kv_used() == 0 and eng.paused and eng.n_dec == 0
    ctx = 500 + aborted[0][1]
    again = Seq(9, ctx, 400 - aborted[0][1], on_done=done.append)
    eng.submit(again)
    k.run(until=5.0)
    assert not done  # paused: nothing runs until resume
    eng.resume()
    k.run()
    assert done == [again] and again.prefilled == ctx  # its KV is recomputed whole


def test_waiting_requests_go_by_priority(cost):
    k = Kernel(0)
    eng = Engine(k, "e", cost, max_num_seqs=1)
    order = []
    first = Seq("running", 100, 50, on_done=lambda s: order.append(s.key))
    eng.submit(first)
    for key, prio in (("late", 5.0), ("urgent", -3.0), ("fifo-a", 0.0), ("fifo-b", 0.0)):
        eng.submit(Seq(key, 100, 5, on_done=lambda s: order.append(s.key), priority=prio))
    k.run()
    assert order == ["running", "urgent", "fifo-a", "fifo-b", "late"]


# ---- AReaL ------------------------------------------------------------------------------------


def test_areal_interrupted_requests_recompute_and_carry_two_versions(cost):
    k = Kernel(0)
    eng = Engine(k, "e", cost)
    router = make_router("least-loaded", [Bucket("all", 1, 40960)])
    drv = RolloutDriver(k, [eng], [Bucket("all", 1, 40960)], {"e": 0}, router, {"e": 0}, 1.0)
    done = []
    drv.on_traj_done = done.append
    drv.start(Trajectory("t", "p", 0, 2000, [Turn(3000)]))
    k.run(until=5.0)

    def update():
        drv.version = 1
        drv.interrupt(drv.resubmit)
        k.after(1.0, drv.resume_engines)

    k.at(k.now, update)
    k.run()
    (run,) = done
    versions = [v for v, _ in run.tags]
    assert versions == [0, 1] and sum(n for _, n in run.tags) == 3000
    assert eng.prefill_tokens >= 2000 + run.tags[0][1]  # the prompt, then everything again


def test_areal_interrupts_each_update_and_keeps_its_admission_bound():
    sim = _sim("areal", steps=4, pipeline={"staleness": 1})
    out = sim.summary()
    assert out["interrupts"] == 4 and out["max_token_lag"] >= 1
    h = sim.history
    for s in range(2, 4):  # batch s starts only once step s-2 has trained (eta = 1)
        assert h[s].rollout_start >= h[s - 2].train_end - 1e-9


# ---- APRIL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("staleness", [1, 2])
def test_april_resumes_partial_trajectories_with_their_version_tags(staleness):
    sim = _sim("april", steps=4, pipeline={"staleness": staleness, "strict_staleness": True})
    out = sim.summary()
    assert out["carried_groups"] > 0 and out["max_token_lag"] <= staleness
    trained = [t.id for r in sim.history for t in r.trajs]
    assert len(trained) == len(set(trained)) >= 4 * SMALL["workload"]["prompts_per_step"] * 4
    assert any(len(r.token_lag) > 1 for r in sim.history)  # steps train tokens of two versions
    for r in sim.history:
        assert max(r.token_lag) <= staleness
        assert sum(r.token_lag.values()) == r.generated_tokens  # every token tagged once
        assert len({(t.step, t.prompt_id) for t in r.trajs}) >= SMALL["workload"]["prompts_per_step"]


@pytest.mark.parametrize("system", ["static-uniform", "areal", "april"])
def test_a_strict_bound_holds_for_every_trained_token(system):
    """Admission alone lets a straggler be trained with tokens older than the bound; strict does not."""
    loose = _sim(system, steps=5, pipeline={"staleness": 1}).summary()
    strict = _sim(system, steps=5, pipeline={"staleness": 1, "strict_staleness": True}).summary()
    assert strict["max_token_lag"] <= 1 and strict["max_staleness"] <= 1
    assert loose["max_token_lag"] >= strict["max_token_lag"]


# ---- Seer ---------------------------------------------------------------------------------------


def test_divided_rollout_submits_a_turn_in_chunks(cost):
    k = Kernel(0)
    engines = [Engine(k, f"e{i}", cost) for i in range(2)]
    buckets = [Bucket("all", 1, 40960)]
    router = make_router("seer", buckets)
    drv = RolloutDriver(k, engines, buckets, {"e0": 0, "e1": 0}, router, {"e0": 0, "e1": 0}, 1.0)
    drv.chunk_tokens = 1000
    done = []
    drv.on_traj_done = done.append
    drv.start(Trajectory("t", "p", 0, 500, [Turn(3500)]))
    k.run()
    (run,) = done
    assert sum(e.decode_tokens for e in engines) == 3500
    assert sum(n for _, n in run.tags) == 3500 and run.contexts == [500]


def test_speculative_decoding_pays_at_small_batches_only(catalog):
    hw, model = catalog.hardware("h100-80g"), catalog.model("qwen3-8b")
    base = RolloutCostModel(hw, model, 1)
    spec = SpeculativeCostModel(hw, model, 1, SpecDecoding(0.5, 4))
    assert spec.draft_length(1) == 4 and spec.draft_length(256) < spec.draft_length(1)
    a, b = spec.decode_coeffs(1)
    a0, b0 = base.decode_coeffs(1)
    assert a < a0 / 1.5 and b < b0
    fa, fb = spec.floor_coeffs()
    assert fa <= a and fb <= b  # the limit's floor is below every step


def test_seer_beats_veRL_dispatch_on_a_long_tail():
    over = {"workload": {**SMALL["workload"], "family": "dapo-math", "params": {"max_turns": 1}}}
    sc = parse_scenario({**SMALL, **over})
    out = pipeline.run(
        sc, ["colocated:group-round-robin", "seer"], 2, 0, None, lambda *a: None, isolate=False
    )
    base, seer = out["systems"]["colocated:group-round-robin"], out["systems"]["seer"]
    assert seer["rollout_throughput_tokens_per_s"] > base["rollout_throughput_tokens_per_s"]
    assert seer["mean_tail_s"] < base["mean_tail_s"]


# ---- Heddle -------------------------------------------------------------------------------------


class _Alternate:
    """A router that moves a trajectory to the other engine during each tool call, and keeps it
    where it is at a turn's start (what Heddle's placement does when its prediction changes)."""

    name = "alternate"

    def __init__(self):
        self.moves = 0

    def route(self, req, instances):
        cur = req.current_instance
        if cur is not None and not req.in_tool:
            return RouteDecision(0, cur, priority=-1.0)
        inst = instances[0] if cur != instances[0].id else instances[1]
        return RouteDecision(0, inst.id, priority=-1.0)

    def on_finish(self, traj):
        pass

    def on_step_end(self, step):
        pass

    def retune(self, buckets):
        pass


def test_heddle_moves_kv_during_the_tool_call(cost):
    k = Kernel(0)
    engines = [Engine(k, f"e{i}", cost) for i in range(2)]
    buckets = [Bucket("all", 1, 40960)]
    drv = RolloutDriver(k, engines, buckets, {"e0": 0, "e1": 0}, _Alternate(), {"e0": 0, "e1": 0}, 1.0)
    drv.migrate_in_tool = True
    done = []
    drv.on_traj_done = done.append
    drv.start(Trajectory("t", "p", 0, 4000, [Turn(50, "bash", 30, tool_latency_s=5.0), Turn(50)]))
    k.run()
    assert done and drv.stats.migrations >= 1 and drv.stats.migrated_tokens >= 4000
    # the second turn prefilled only its new tokens: the KV had arrived while the tool ran
    assert sum(e.prefill_tokens for e in engines) < 4000 + 200


def test_heddle_predicts_progressively_and_ranks_long_remaining_first():
    from libra.rollout.base import FinishedTrajectory, RouteRequest
    from libra.rollout.peers import HeddleRouter

    r = HeddleRouter([Bucket("s", 1, 4096), Bucket("l", 4, 40960)])
    for i, final in enumerate([1000, 2000, 3000, 20000]):
        r.on_finish(FinishedTrajectory(f"t{i}", "other", 0, (), (100,), final))
    short = RouteRequest("a", "p", 1, 0, 100, 500, 0)
    long = RouteRequest("b", "p", 1, 3, 100, 5000, 4900)
    assert r.predict(short) == pytest.approx(6500) and r.predict(long) == pytest.approx(20000)
    from libra.rollout.base import InstanceView

    views = [InstanceView("i0", 0, 1), InstanceView("i1", 1, 4)]
    a, b = r.route(short, views), r.route(long, views)
    assert b.priority < a.priority and b.bucket == 1


# ---- bad input ----------------------------------------------------------------------------------


def test_staleness_below_what_a_system_needs_names_the_field():
    sc = parse_scenario({**SMALL, "pipeline": {"staleness": 0}})
    for name in ("april", "areal"):
        with pytest.raises(ConfigError) as e:
            pipeline.run(sc, [name], 1, 0, None, lambda *a: None, isolate=False)
        assert e.value.field == "pipeline.staleness" and name in str(e.value)


def test_cli_bad_peer_options_exit_2():
    r = run_cli("simulate", "--steps", "1", "--systems", "seer", "--set", "peers.seer.drafts=3")
    assert r.returncode == 2 and "peers.seer.drafts" in r.stderr
    r = run_cli("simulate", "--steps", "1", "--systems", "april", "--set", "pipeline.staleness=0")
    assert r.returncode == 2 and "pipeline.staleness" in r.stderr and "april" in r.stderr
    with pytest.raises(ConfigError) as e:
        parse_scenario({**SMALL, "peers": {"april": {"over_provision": 0.5}}})
    assert e.value.field == "scenario.peers.april.over_provision"


def test_strict_gate_takes_overdue_groups_first_and_waits_for_running_ones():
    from libra.planner.staleness import GroupQueue, StalenessGate

    q: GroupQueue[str] = GroupQueue(StalenessGate(1, "completion", strict=True))
    for version, name in [(3, "fresh-a"), (1, "old-a"), (3, "fresh-b"), (1, "old-b"), (2, "mid")]:
        q.add(0, version, name)
    assert q.take(2, 2, oldest_running=1) is None  # a group sampled at version 1 still runs
    taken = q.take(2, 1, oldest_running=2)
    assert [f.group for f in taken] == ["old-a", "old-b"]  # overdue at step 2: past the target
    assert [f.group for f in q.take(3, 2)] == ["mid", "fresh-a"]


def test_an_interrupted_lockstep_rank_aborts_at_the_groups_step_end(cost):
    from libra.sim.engine import LockstepGroup

    k = Kernel(0)
    a, b = Engine(k, "a", cost), Engine(k, "b", cost)
    LockstepGroup(k, [a, b])
    done, aborted = [], []
    for i, eng in enumerate((a, b)):
        eng.submit(Seq(i, 500, 300, on_done=done.append))
    k.run(until=0.5)
    a.interrupt(lambda seq, n: aborted.append((seq.key, n)))
    k.run()
    assert [key for key, _ in aborted] == [0] and 0 < aborted[0][1] < 300
    assert [s.key for s in done] == [1] and a.paused and a.kv_used() == 0
