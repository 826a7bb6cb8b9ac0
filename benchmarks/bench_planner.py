"""Global planner search time: the whole search (split, training parallelism, bucket DP) from cold.

Goals: <= 1 s at 128 GPUs and <= 10 s at 1024 GPUs. Published (Libra): 12.3 s at 128 GPUs
without memoisation, 1.9 s with it; the same two variants are timed here side by side.
Cases: R2E-Gym, Qwen3-14B on 16 x 8 A800 (128 GPUs, GRPO 32 x 16), and the shipped
`scale-1024gpu` scenario (Qwen3-32B on 128 x 8 H100, GRPO 512 x 16). The history is the
scenario workload generator's step 0. Each figure is the median of fresh planners (no warm cache).
Run: .venv/bin/python benchmarks/bench_planner.py
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
from libra.planner import GlobalPlanner, PlannerConfig, PlanningProblem, WorkloadStats  # noqa: E402
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
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = GlobalPlanner(problem, PlannerConfig(memoise=memoise)).plan(stats)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return {"median_s": round(statistics.median(times), 3), "plan_step_s": round(plan.step_time_s, 2)}


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
    report("planner", figures)


if __name__ == "__main__":
    main()
