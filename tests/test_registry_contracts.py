"""A contract over every entry of every registry (routers have their own suite, test_router_contract).

- Planners: a feasible plan for a small problem; `decide` on the same statistics keeps the plan.
- RL systems: every name `libra simulate` accepts runs a short scenario, and the same seed gives
  the same result; a system with a controller has a plan to hand it.
- Action systems: every system type runs one step of a small tangram scenario, and every action
  ends once.
- Workload families: a step of prompts x samples trajectories, reproducible from its seed.
- The registry type itself: outside code by dotted path, errors naming the field.
"""

from __future__ import annotations

import json
import random

import pytest

from libra.core.errors import ConfigError
from libra.core.registry import Registry, import_dotted
from libra.costmodel.catalog import load_catalog
from libra.planner import PLANNERS, PlanDecision, PlanningProblem, WorkloadStats, check_plan, make_planner
from libra.sim.rl import pipeline
from libra.sim.rl.systems import known_systems, make_system
from libra.sim.scenarios import parse_scenario, read_scenario
from libra.sim.tangram import runner
from libra.sim.tangram.systems import SYSTEM_TYPES
from libra.sim.workloads import FAMILIES, WorkloadConfig, make_workload, step_rng
from tests.test_sim_pipeline import SMALL


@pytest.fixture(scope="module")
def small_problem() -> tuple[PlanningProblem, WorkloadStats]:
    cat = load_catalog()
    problem = PlanningProblem(cat.hardware("a800-80g"), 2, cat.model("qwen3-8b"), 4, 4, 40960)
    wl = make_workload(WorkloadConfig(family="r2e-gym", prompts_per_step=4, samples_per_prompt=4))
    return problem, WorkloadStats.from_trajectories(wl.generate(0, step_rng(0, 0)))


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_returns_a_feasible_plan_and_keeps_it(name, small_problem):
    problem, stats = small_problem
    planner = make_planner(name, problem)
    plan = planner.plan(stats)
    check_plan(plan, problem)
    assert plan.train_gpus + plan.rollout_gpus <= problem.gpus
    dec = planner.decide(stats, plan)
    assert isinstance(dec, PlanDecision) and dec.plan.layout_key() == plan.layout_key()


@pytest.mark.parametrize("name", known_systems())
def test_every_rl_system_runs_and_is_reproducible(name):
    sc = parse_scenario({**SMALL, "steps": 2})
    a = pipeline.run(sc, [name], 2, 5, None, lambda *x: None, isolate=False)["systems"][name]
    b = pipeline.run(sc, [name], 2, 5, None, lambda *x: None, isolate=False)["systems"][name]
    assert a["throughput_tokens_per_s"] > 0 and a["generated_tokens"] > 0
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    system = make_system(name)
    setup = system.setup(sc, load_catalog().hardware(sc.cluster.hardware))
    assert system.controller is None or setup.plan is not None


def _small_tangram(kind: str) -> dict:
    sc = read_scenario(f"tangram-{kind}")
    if kind == "mopd":
        sc["mopd"]["prompts_per_step"] = 16
        sc["equal_act"] = None
    else:
        sc["coding"]["workload"] = {
            **sc["coding"]["workload"],
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
        }
    return sc


@pytest.mark.parametrize("kind", sorted(SYSTEM_TYPES))
def test_every_action_system_type_runs_a_step(kind):
    scenario = "coding" if kind in ("tangram", "k8s") else "mopd"
    data = _small_tangram(scenario)
    name = next(n for n, s in data["systems"].items() if s["type"] == kind)
    out = runner.run(parse_scenario(data), systems=[name], steps=1, seed=0)
    acts = out["systems"][name]["actions"]
    assert acts["count"] > 0 and acts["mean_act_s"] > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_workload_family_makes_a_reproducible_step(family):
    wl = make_workload(WorkloadConfig(family=family, prompts_per_step=3, samples_per_prompt=2))
    a, b = wl.generate(4, step_rng(1, 4)), wl.generate(4, step_rng(1, 4))
    assert len(a) == 6 and [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert all(t.step == 4 and t.total_tokens > 0 for t in a)


def test_registry_resolves_outside_code_and_names_the_field():
    reg: Registry[type] = Registry("thing", "section.kind", {"a": random.Random}, outside=True)
    assert reg.get_entry("a") is random.Random
    assert reg.get_entry("random:Random") is random.Random
    with pytest.raises(ConfigError) as e:
        reg.get_entry("b")
    assert e.value.field == "section.kind" and "package.module:Attr" in str(e.value)
    with pytest.raises(ConfigError, match="importable"):
        reg.get_entry("no.such.module:X")
    closed: Registry[type] = Registry("thing", "f", {"a": int}, outside=False)
    with pytest.raises(ConfigError):
        closed.get_entry("random:Random")
    lazy: Registry[object] = Registry("command", "cmd", {"r": "random:Random"})
    assert lazy.is_lazy("r") and lazy["r"] is random.Random and not lazy.is_lazy("r")
    assert import_dotted("random:Random.seed", "x") is random.Random.seed
