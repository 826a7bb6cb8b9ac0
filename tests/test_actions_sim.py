"""The action-orchestration scenarios in the simulator: the published effects, determinism, the
baselines' mechanics, and clear errors for bad scenario input."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.errors import ConfigError
from libra.sim.scenarios import parse_scenario, read_scenario
from libra.sim.tangram import runner
from libra.sim.tangram.runner import split_nodes
from libra.sim.tangram.systems import max_min_fair
from tests.conftest import run_cli, run_main


def run(scenario: dict, *args, **kw) -> dict:
    """The runner on a scenario mapping (validated first, as `libra simulate` loads one)."""
    return runner.run(parse_scenario(scenario), *args, **kw)


REQUIRED = ("mean_act_s", "p99_act_s", "mean_step_time_s", "restore_overhead_share")


# One step of each shipped scenario, not the scenario's two: a step is the whole workload (512
# trajectories on 128 cores; 4,096 samples scored by 10 services), so the effects below show in
# one, at the same size (tangram's ACT win is 1.81x at one step, 1.83x at two; the MOPD sweep
# stops at 16 GPUs in both), for half the CPU.
@pytest.fixture(scope="module")
def coding():
    return run(read_scenario("tangram-coding"), steps=1, seed=0)


@pytest.fixture(scope="module")
def mopd():
    return run(read_scenario("tangram-mopd"), steps=1, seed=0)


def test_coding_systems_share_cores_and_tangram_beats_fixed_dop(coding):
    s = coding["systems"]
    assert set(s) == {"k8s-per-trajectory", "tangram", "tangram-fixed-dop4"}
    for m in s.values():
        assert all(k in m["actions"] for k in REQUIRED)
        assert m["actions"]["cpu_cores"] == 128  # the same cores for every system
        assert m["throughput_tokens_per_s"] > 0
    act = {n: m["actions"]["mean_act_s"] for n, m in s.items()}
    assert act["tangram"] < act["tangram-fixed-dop4"] < act["k8s-per-trajectory"]
    # Every system ran every action of the same workload, reward calls included (one per trajectory).
    assert len({m["actions"]["count"] for m in s.values()}) == 1
    assert s["tangram"]["actions"]["by_kind"]["reward-tests"]["count"] == coding["steps"] * 512


# Known shortfall, recorded rather than hidden (README "Known gaps", docs/gaps.md): on the calibrated r2e-gym
# turns, with reward calls, tangram's mean-ACT win is ~1.8x, not the 3x issue 6 asks for. Strict:
# if a change makes this pass, the xfail itself fails and must be removed.
@pytest.mark.xfail(
    strict=True,
    reason="tangram-coding ACT win ~1.8x < 3x; the no-queue bound is 3.19x "
    "(benchmarks/bench_tangram_bound.py; issue 6 open; docs/gaps.md)",
)
def test_coding_tangram_cuts_act_to_a_third_of_k8s(coding):
    s = coding["systems"]
    assert s["tangram"]["actions"]["mean_act_s"] <= s["k8s-per-trajectory"]["actions"]["mean_act_s"] / 3


def test_coding_trajectories_end_with_a_reward_call_at_their_repository_scale():
    from libra.core.config import build
    from libra.sim.tangram.config import TangramScenario
    from libra.sim.tangram.runner import CodingSetup

    setup = CodingSetup(build(TangramScenario, read_scenario("tangram-coding"), "scenario"), None)
    plans = setup.plans(0, seed=3)
    for plan in plans:
        assert plan.segments[-1] == (0.0, None)
        reward = plan.segments[-2][1]
        assert reward is not None and reward.kind == "reward-tests" and reward.profile is not None
    # The verifier's run shares the repository's scale with the agent's test runs: across
    # trajectories, their one-core times are strongly correlated.
    pairs = []
    for plan in plans:
        runs = [a.t1 for _, a in plan.segments[:-2] if a is not None and a.kind == "run-tests"]
        if runs:
            pairs.append((sum(runs) / len(runs), plan.segments[-2][1].t1))
    x, y = np.log(np.array(pairs)).T
    assert len(pairs) > 100 and np.corrcoef(x, y)[0, 1] > 0.6
    no_reward = read_scenario("tangram-coding")
    no_reward["coding"]["reward"] = None
    bare = CodingSetup(build(TangramScenario, no_reward, "scenario"), None).plans(0, seed=3)
    assert not any(a is not None and a.kind == "reward-tests" for p in bare for _, a in p.segments)


def test_mopd_pooled_gpus_match_static_act_with_half_the_gpus(mopd):
    s = mopd["systems"]
    static, pooled = s["static-services"]["actions"], s["tangram"]["actions"]
    assert static["gpus"] == 40 and pooled["gpus"] == 40
    assert pooled["mean_act_s"] < static["mean_act_s"]
    assert 0 < pooled["restore_overhead_share"] < 0.2 and static["restore_overhead_share"] == 0
    assert mopd["gpus_for_equal_act"] <= 0.5 * static["gpus"]
    # The sweep stops at the first pool size that matches, and that one does.
    last = mopd["equal_act_sweep"][-1]
    assert last["gpus"] == mopd["gpus_for_equal_act"] and last["mean_act_s"] <= static["mean_act_s"]


def small_mopd() -> dict:
    sc = read_scenario("tangram-mopd")
    sc["mopd"]["prompts_per_step"] = 48
    sc["equal_act"]["step"] = 8
    return sc


def test_same_seed_same_result_and_another_seed_differs():
    a, b = run(small_mopd(), steps=1, seed=3), run(small_mopd(), steps=1, seed=3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = run(small_mopd(), steps=1, seed=4)
    assert (
        c["systems"]["tangram"]["actions"]["mean_act_s"] != a["systems"]["tangram"]["actions"]["mean_act_s"]
    )


def test_outputs_are_written(tmp_path):
    out = run(small_mopd(), steps=1, seed=0, out_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpus_for_equal_act"] == out["gpus_for_equal_act"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"] and all(e["dur"] >= 0 for e in trace["traceEvents"])
    assert (tmp_path / "actions_act_cdf.png").stat().st_size > 0


def test_bad_scenarios_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="--systems"):
        run(small_mopd(), systems=["nope"], steps=1)
    sc = small_mopd()
    sc["systems"]["weird"] = {"type": "slurm"}
    with pytest.raises(ConfigError, match="systems.weird.type"):
        run(sc, systems=["weird"], steps=1)
    sc = small_mopd()
    sc["systems"]["k8s"] = {"type": "k8s"}
    with pytest.raises(ConfigError, match="CPU scenario"):
        run(sc, systems=["k8s"], steps=1)
    sc = copy.deepcopy(read_scenario("tangram-coding"))
    sc["coding"]["tools"]["python"] = [{"kind": "python", "profile": "missing"}]
    with pytest.raises(ConfigError, match=r"coding\.tools\.python\[0\]\.profile"):
        run(sc, steps=1)
    sc = copy.deepcopy(read_scenario("tangram-coding"))
    sc["coding"]["reward"]["cpu"] = [4, 2]
    with pytest.raises(ConfigError, match=r"coding\.reward\.cpu"):
        run(sc, steps=1)
    sc = small_mopd()
    sc["mopd"]["services"][0]["model"] = "gpt-9"
    with pytest.raises(ConfigError, match="model"):
        run(sc, steps=1)


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("coding", "env_memory_gib"), 1e12, "coding.env_memory_gib"),  # was a TypeError mid-run
        (("systems", "k8s-per-trajectory", "cpu_request"), 64, "cores_per_node"),  # was a TypeError
        (("cluster", "nodes"), 10**12, "cluster.nodes"),  # was a hang
        (("cluster", "cores_per_node"), 10**12, "cluster.cores_per_node"),  # was a MemoryError
        (("cluster", "memory_gib_per_node"), float("nan"), "finite"),
        # found by a fuzz of every scenario key: an OverflowError, a TypeError, an unhashable type
        (("coding", "reward", "t1_sigma"), 1e300, r"coding\.reward\.t1_sigma"),
        (("profiles", "pytest-xdist", "amdahl"), {"a": 1}, r"profiles\.pytest-xdist\.amdahl"),
        (("profiles", "pytest-xdist", "units"), [0, 2], r"profiles\.pytest-xdist\.units"),
        (("systems", "tangram", "type"), [], r"systems\.tangram\.type"),
    ],
)
def test_values_no_run_could_use_are_refused_up_front(path, value, needle):
    sc = copy.deepcopy(read_scenario("tangram-coding"))
    node = sc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=needle):
        run(sc, steps=1)


@pytest.mark.parametrize("key", ["prompt_tokens_median", "response_tokens_median", "prompts_per_step"])
def test_mopd_sizes_that_would_hang_a_step_are_refused(key):
    sc = small_mopd()
    sc["mopd"][key] = 10**12  # each hung for minutes before the bound
    with pytest.raises(ConfigError, match=f"mopd.{key}"):
        run(sc, steps=1)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.5, 64), st.dictionaries(st.text(min_size=1, max_size=3), st.floats(0.1, 8), max_size=12))
def test_cfs_shares_are_max_min_fair(capacity, caps):
    shares = max_min_fair(capacity, caps)
    assert sum(shares.values()) <= capacity + 1e-6
    for aid, share in shares.items():
        assert 0 <= share <= caps[aid] + 1e-9
        if share < caps[aid] - 1e-9:  # a capped-short action gets at least everyone else's share
            assert all(share >= other - 1e-9 for other in shares.values())
    if sum(caps.values()) <= capacity:
        assert shares == pytest.approx(caps)


def test_split_nodes_makes_power_of_two_nodes():
    assert split_nodes(20, 8) == [8, 8, 4]
    assert split_nodes(14, 8) == [8, 4, 2]
    assert split_nodes(8, 8) == [8]


def test_k8s_pods_wait_for_requests_and_count_in_act():
    sc = copy.deepcopy(read_scenario("tangram-coding"))
    sc["coding"]["workload"]["prompts_per_step"] = 4  # 64 trajectories
    sc["cluster"] = {"nodes": 1, "cores_per_node": 8, "numa_per_node": 1, "memory_gib_per_node": 512}
    res = run(sc, systems=["k8s-per-trajectory", "tangram"], steps=1, seed=1)
    k8s = res["systems"]["k8s-per-trajectory"]["actions"]
    # 8 cores / 0.5 request = 16 pods for 64 trajectories: most first tool calls wait for a pod,
    # while tangram's sandboxes only wait for cores.
    assert k8s["mean_queue_s"] > 1.5 * res["systems"]["tangram"]["actions"]["mean_queue_s"]
    sc["systems"]["k8s-per-trajectory"]["sandbox_before_generation"] = True
    held = run(sc, systems=["k8s-per-trajectory"], steps=1, seed=1)["systems"]["k8s-per-trajectory"]
    # Holding generation until the pod is ready moves the wait out of ACT into the step time.
    assert held["actions"]["mean_queue_s"] < k8s["mean_queue_s"]
    assert held["mean_step_time_s"] >= res["systems"]["k8s-per-trajectory"]["mean_step_time_s"] * 0.9


def test_cli_simulate_runs_a_tangram_scenario(tmp_path):
    r = run_cli("simulate", "--scenario", "tangram-mopd", "--steps", "1", "--out", str(tmp_path), "--json",
                "--set", "mopd.prompts_per_step=48", "--set", "equal_act.step=8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["systems"]["tangram"]["actions"]["gpus"] == 40 and "gpus_for_equal_act" in out
    # The error path through the same libra.cli.main in this process (conftest.run_main); a real
    # process's bad --set values are test_sim_pipeline's.
    bad = run_main("simulate", "--scenario", "tangram-mopd", "--set", "mopd.decode_tok_s=-1")
    assert bad.returncode == 2 and "decode_tok_s" in bad.stderr and "Traceback" not in bad.stderr


def test_a_trajectory_cut_off_on_a_tool_call_still_gets_its_reward_call():
    import random

    from libra.core.config import build
    from libra.core.trajectory import Trajectory, Turn
    from libra.sim.tangram.config import TangramScenario
    from libra.sim.tangram.runner import CodingSetup

    setup = CodingSetup(build(TangramScenario, read_scenario("tangram-coding"), "scenario"), None)
    cut = Trajectory("t", "p", 0, 500, [Turn(100, "execute_bash", 50, tool_latency_s=2.0)])
    kinds = [a.kind if a else None for _, a in setup.workload._plan(cut, 0, random.Random(0)).segments]
    assert kinds[-2:] == ["reward-tests", None] and len(kinds) == 3
