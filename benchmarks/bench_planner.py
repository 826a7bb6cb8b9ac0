"""Global planner search time: the whole search (split, training parallelism, bucket DP) from cold.

Goals: <= 1 s at 128 GPUs and <= 10 s at 1024 GPUs. Published (Libra): 12.3 s at 128 GPUs
without memoisation, 1.9 s with it; the same two variants are timed here side by side.
Cases: R2E-Gym, Qwen3-14B on 16 x 8 A800 (128 GPUs, GRPO 32 x 16), and the shipped
`scale-1024gpu` scenario (Qwen3-32B on 128 x 8 H100, GRPO 512 x 16). The history is the
scenario workload generator's step 0. Each figure is the median of fresh planners (no warm cache).
Also measured: the rollout estimate's error against the simulator (`libra.sim`), per scenario
and layout, as MAPE and mean bias over 8 steps: the planner's `evaluate` of the very layout the
simulator ran (static-uniform: one TP4 bucket; router:oracle: the scenario's TP1/TP2/TP4 buckets,
routed by true length, which is what the estimate assumes) on that step's trajectories.
Run: .venv/bin/python benchmarks/bench_planner.py [--no-accuracy]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.costmodel.training import TrainParallel  # noqa: E402
from libra.planner import BucketPlan, GlobalPlanner, Plan, PlannerConfig, PlanningProblem, WorkloadStats  # noqa: E402
from libra.sim.pipeline import run as simulate  # noqa: E402
from libra.sim.scenarios import load_scenario  # noqa: E402
from libra.sim.workloads import WorkloadConfig, make_workload  # noqa: E402


def case(scenario: str, nodes: int | None) -> tuple[PlanningProblem, WorkloadStats]:
    sc, cat = load_scenario(scenario), load_catalog()
    wl = sc["workload"]
    problem = PlanningProblem(
        cat.hardware(sc["cluster"]["hardware"]), nodes or sc["cluster"]["nodes"], cat.model(sc["model"]),
        wl["prompts_per_step"], wl["samples_per_prompt"], wl["max_length"],
    )  # fmt: skip
    trajs = make_workload(WorkloadConfig(**wl)).generate(0, random.Random(0))
    return problem, WorkloadStats.from_trajectories(trajs)


def search_s(problem: PlanningProblem, stats: WorkloadStats, repeats: int, memoise: bool = True) -> dict:
    """Median wall and CPU seconds of a cold search. The CPU time is what one core spends; on a
    shared machine it is the steadier figure (the wall time includes waiting for a core)."""
    wall, cpu, plan = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = GlobalPlanner(problem, PlannerConfig(memoise=memoise)).plan(stats)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert plan is not None
    return {
        "median_s": round(statistics.median(wall), 3),
        "median_cpu_s": round(statistics.median(cpu), 3),
        "plan_step_s": round(plan.step_time_s, 2),
    }


def accuracy(scenario: str, steps: int = 8) -> dict:
    """Predicted vs simulated rollout makespan of two fixed layouts, step by step."""
    sc = load_scenario(scenario)
    problem, _ = case(scenario, None)
    planner, wl = GlobalPlanner(problem), make_workload(WorkloadConfig(**sc["workload"]))
    tr, ro, t = sc["split"]["train_gpus"], sc["split"]["rollout_gpus"], sc["train"]
    par = TrainParallel(t["tp"], t["pp"], tr // (t["tp"] * t["pp"] * t["cp"]), t["cp"], t["micro_batch"])
    per_node = problem.hw.gpus_per_node
    hetero = {}
    for tp in sc["rollout"]["layout_per_node"]:
        hetero[tp] = hetero.get(tp, 0) + ro // per_node
    layouts = {
        "static-uniform": [(sc["rollout"]["homogeneous_tp"], ro // sc["rollout"]["homogeneous_tp"])],
        "router:oracle": sorted(hetero.items()),
    }
    out = {}
    for system, engines in layouts.items():
        tops = (
            [b["max_context"] for b in sc["rollout"]["buckets"]] if len(engines) > 1 else [problem.max_length]
        )
        buckets = tuple(BucketPlan(tp, n, top) for (tp, n), top in zip(engines, tops, strict=True))
        plan = Plan(problem.gpus, tr, ro, par, buckets, 0.0, 0.0, problem.max_length)
        sim = simulate(sc, [system], steps, 0, None, lambda *_: None)["per_step"][system]
        errs = []
        for r in sim:
            trajs = wl.generate(r["step"], random.Random(r["step"]))  # the simulator's batch (seed 0)
            est = planner.evaluate(plan, WorkloadStats.from_trajectories(trajs)).t_rollout_s
            errs.append(est / r["rollout_makespan_s"] - 1)
        out[system] = {
            "mape_pct": round(100 * statistics.mean(abs(e) for e in errs), 1),
            "bias_pct": round(100 * statistics.mean(errs), 1),
        }
    return out


def main() -> None:
    p128, s128 = case("libra-r2e-48gpu", nodes=16)
    p1024, s1024 = case("scale-1024gpu", nodes=None)
    figures = {
        "search_128_gpus": search_s(p128, s128, 5),
        "search_128_gpus_no_memo": search_s(p128, s128, 3, memoise=False),
        "search_1024_gpus": search_s(p1024, s1024, 3),
        "goal_128_s": 1.0,
        "goal_1024_s": 10.0,
        "published_128_s": {"memoised": 1.9, "no_memo": 12.3},
    }
    if "--no-accuracy" not in sys.argv:
        names = ("libra-r2e-48gpu", "libra-searchr1-48gpu", "libra-dapo-48gpu")
        figures["rollout_estimate_vs_sim"] = {n: accuracy(n) for n in names}
    report("planner", figures)


if __name__ == "__main__":
    main()
