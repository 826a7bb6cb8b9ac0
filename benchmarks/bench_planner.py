"""Global planner: search time, and how its predictions and plans fare in the simulator.

Search time: the whole search (split, training parallelism, bucket DP) from cold, median of fresh
planners. Goals: <= 1 s at 128 GPUs and <= 10 s at 1024 GPUs. Published (Libra): 12.3 s at 128
GPUs without memoisation, 1.9 s with it; both variants are timed side by side. Cases: R2E-Gym,
Qwen3-14B on 16 x 8 A800 (128 GPUs, GRPO 32 x 16), and the shipped `scale-1024gpu` scenario
(Qwen3-32B on 128 x 8 H100, GRPO 512 x 16); history: the workload generator's step 0.

Against the simulator (`libra.sim`, 12 steps, seed 0) on the three 48-GPU paper scenarios, four
layouts each: the scenario's static-uniform split (one TP4 bucket), its three-bucket layout
(TP1/TP2/TP4, routed by true length), and the planner's homogeneous and heterogeneous plans made
from steps 0-2 (the heterogeneous one routed by true length, the routing the estimate assumes).
- `step_time`: predicted pipeline period (`Plan.step_time_s` from `GlobalPlanner.evaluate` on
  each step's trajectories, averaged) against the simulated mean step time of steps 1-10 (the
  first starts two batches at once, the last drains every straggler: see `against_sim`);
- `throughput_tok_s`: simulated generated tokens per second of each layout.

`--splits` instead: the steady-state step predicted against simulated for homogeneous TP4 layouts
on 16, 20, 24 and 28 training GPUs in seven cells of the default map (R2E-Gym early / late x
prompts x staleness), where the KV cache and the strict staleness gate bind; per cell, how much the
split the prediction ranks first loses against the best simulated one (`pick_loss`).
Run: .venv/bin/python benchmarks/bench_planner.py [--no-sim | --splits]
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
from libra.planner import (  # noqa: E402
    BucketPlan,
    GlobalPlanner,
    HomogeneousPlanner,
    Plan,
    PlannerConfig,
    PlanningProblem,
    WorkloadStats,
    place,
)
from libra.rollout.base import Bucket  # noqa: E402
from libra.sim.rl.config import RLScenario, parse_rl  # noqa: E402
from libra.sim.rl.config import problem_of as rl_problem  # noqa: E402
from libra.sim.rl.pipeline import Batches, RLSim  # noqa: E402
from libra.sim.rl.setup import InstanceSpec, Setup, System  # noqa: E402
from libra.sim.scenarios import read_scenario  # noqa: E402
from libra.sim.workloads import make_workload  # noqa: E402


def problem_of(
    name: str, nodes: int | None = None, sets: tuple[str, ...] = ()
) -> tuple[RLScenario, PlanningProblem]:
    """A shipped scenario (with `--set` overrides) and its planning problem, as the simulator
    builds them."""
    cat = load_catalog()
    sc = parse_rl(read_scenario(name, sets), cat, split=nodes is None and not sets)
    return sc, rl_problem(sc, cat.hardware(sc.cluster.hardware), cat, nodes)


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


def search_figures() -> dict:
    out = {}
    for label, name, nodes, runs in (
        ("128_gpus", "libra-r2e-48gpu", 16, 5),
        ("1024_gpus", "scale-1024gpu", None, 3),
    ):
        sc, problem = problem_of(name, nodes)
        stats = WorkloadStats.from_trajectories(make_workload(sc.workload).generate(0, random.Random(0)))
        out[f"search_{label}"] = search_s(problem, stats, runs)
        if label == "128_gpus":
            out["search_128_gpus_no_memo"] = search_s(problem, stats, 3, memoise=False)
    return out


class PlanSystem(System):
    """A simulated system that runs one fixed plan (placed with `place`), with a given router."""

    def __init__(self, plan: Plan, router: str, name: str):
        self.plan, self.router, self.name = plan, router, name

    def setup(self, sc, hw):
        where = place(self.plan, hw.gpus_per_node)
        engines = [
            InstanceSpec(b.tp, k, node)
            for k, (b, nodes) in enumerate(zip(self.plan.buckets, where.engines, strict=True))
            for node in nodes
        ]
        buckets = [Bucket(f"b{k}", b.tp, b.max_context) for k, b in enumerate(self.plan.buckets)]
        return Setup(False, self.plan.train_gpus, engines, buckets, self.router, self.plan.train)


def scenario_layouts(sc: RLScenario, problem: PlanningProblem) -> dict[str, Plan]:
    tr, ro, t = sc.split.train_gpus, sc.split.rollout_gpus, sc.train
    par = TrainParallel(t.tp, t.pp, tr // (t.tp * t.pp * t.cp), t.cp, t.micro_batch)
    per_node, counts = problem.hw.gpus_per_node, {}
    for tp in sc.rollout.layout_per_node:
        counts[tp] = counts.get(tp, 0) + ro // per_node
    three = tuple(BucketPlan(b.tp, counts[b.tp], b.max_context) for b in sc.rollout.buckets)
    uniform = (BucketPlan(sc.rollout.homogeneous_tp, ro // sc.rollout.homogeneous_tp, problem.max_length),)
    return {
        "static-uniform": Plan(problem.gpus, tr, ro, par, uniform, 0.0, 0.0, problem.max_length),
        "scenario-3-buckets": Plan(problem.gpus, tr, ro, par, three, 0.0, 0.0, problem.max_length),
    }


def steady_state(sc: RLScenario, batches: Batches, plan: Plan, router: str, label: str,
                 evaluator: GlobalPlanner, steps: int) -> tuple[dict, float, float]:  # fmt: skip
    """`plan` simulated for `steps` steps: (summary, simulated and predicted mean step of steps
    1 to steps - 2; see `against_sim` for why the first and last are left out)."""
    sim = RLSim(sc, PlanSystem(plan, router, label), batches, steps, 0)
    summary, per_step = sim.run(), sim.per_step()
    simulated = statistics.mean(p["step_time_s"] for p in per_step[1:-1])
    predicted = statistics.mean(
        evaluator.evaluate(plan, WorkloadStats.from_trajectories(batches.get(s))).step_time_s
        for s in range(1, steps - 1)
    )
    return summary, simulated, predicted


def against_sim(name: str, steps: int = 12) -> dict:
    """Predicted against simulated step time, per layout, in steady state.

    The first step is left out (two batches start together at t = 0) and so is the last: a run's
    final step must train every group still untrained, so it waits for all the stragglers, an end
    effect no steady-state estimate describes.
    """
    sc, problem = problem_of(name)
    batches = Batches(sc, 0)
    history = WorkloadStats.from_trajectories([t for s in range(3) for t in batches.get(s)])
    layouts = scenario_layouts(sc, problem)
    layouts["planner-homogeneous"] = HomogeneousPlanner(problem).plan(history)
    layouts["planner-heterogeneous"] = GlobalPlanner(problem).plan(history)
    evaluator, out = GlobalPlanner(problem), {}
    for label, plan in layouts.items():
        router = "oracle" if len(plan.buckets) > 1 else "least-loaded"
        summary, simulated, predicted = steady_state(sc, batches, plan, router, label, evaluator, steps)
        out[label] = {
            "split": f"{plan.train_gpus}/{plan.rollout_gpus}",
            "buckets": [f"TP{b.tp}x{b.instances}<={b.max_context}" for b in plan.buckets],
            "step_time_sim_s": round(simulated, 1),
            "step_time_predicted_s": round(predicted, 1),
            "throughput_tok_s": round(summary["throughput_tokens_per_s"], 1),
            "preemptions": summary["preemptions"],
        }
    errors = [abs(v["step_time_predicted_s"] / v["step_time_sim_s"] - 1) for v in out.values()]
    out["step_time_mape_pct"] = round(100 * statistics.mean(errors), 1)
    return out


SPLIT_CELLS = {"late-32-k1": (100, 32, 1), "late-32-k2": (100, 32, 2), "late-64-k1": (100, 64, 1),
               "late-64-k2": (100, 64, 2), "early-64-k2": (0, 64, 2), "early-32-k2": (0, 32, 2),
               "late-16-k2": (100, 16, 2)}  # fmt: skip
SPLIT_TRAIN = (16, 20, 24, 28)  # training GPUs of the splits, of 48


def split_plans(problem: PlanningProblem, stats: WorkloadStats, tp: int = 4) -> dict[int, Plan]:
    """Per training-GPU count of `SPLIT_TRAIN`: one TP bucket on the GPUs training leaves,
    training at its best parallelism on those GPUs (where one fits)."""
    planner = HomogeneousPlanner(problem)
    bound = planner.selector.context_bound(stats.max_final)
    best = planner.train_search.best_per_gpus(
        stats.batch_lengths(problem.batch_size), bound, problem.gpus - tp
    )
    return {
        train: Plan(
            problem.gpus,
            train,
            problem.gpus - train,
            best[train].par,
            (BucketPlan(tp, (problem.gpus - train) // tp, problem.max_length),),
            0.0,
            0.0,
            problem.max_length,
            staleness=problem.staleness,
        )  # fmt: skip
        for train in SPLIT_TRAIN
        if train in best
    }


def against_sim_splits(steps: int = 12) -> dict:
    out, errors = {}, []
    for cell, (first, prompts, k) in SPLIT_CELLS.items():
        sets = (
            f"workload.first_step={first}",
            f"workload.prompts_per_step={prompts}",
            f"pipeline.staleness={k}",
        )
        sc, problem = problem_of("libra-r2e-48gpu", sets=sets)
        batches = Batches(sc, 0)
        history = WorkloadStats.from_trajectories([t for s in range(3) for t in batches.get(s)])
        evaluator, rows = GlobalPlanner(problem), {}
        for train, plan in split_plans(problem, history).items():
            summary, simulated, predicted = steady_state(
                sc, batches, plan, "least-loaded", f"{cell}/{train}", evaluator, steps
            )
            errors.append(abs(predicted / simulated - 1))
            rows[train] = {"sim_s": round(simulated, 1), "predicted_s": round(predicted, 1),
                           "tok_s": round(summary["throughput_tokens_per_s"]), "preemptions": summary["preemptions"]}  # fmt: skip
        best_sim = min(rows, key=lambda t: rows[t]["sim_s"])
        pick = min(rows, key=lambda t: rows[t]["predicted_s"])
        out[cell] = {"splits": rows, "best": best_sim, "pick": pick,
                     "pick_loss": round(rows[best_sim]["sim_s"] / rows[pick]["sim_s"], 3)}  # fmt: skip
    out["step_time_mape_pct"] = round(100 * statistics.mean(errors), 1)
    return out


def main() -> None:
    if "--splits" in sys.argv:
        report("planner_splits", against_sim_splits())
        return
    figures = {
        **search_figures(),
        "goal_128_s": 1.0,
        "goal_1024_s": 10.0,
        "published_128_s": {"memoised": 1.9, "no_memo": 12.3},
    }
    if "--no-sim" not in sys.argv:
        names = ("libra-r2e-48gpu", "libra-searchr1-48gpu", "libra-dapo-48gpu")
        figures["against_simulator"] = {n: against_sim(n) for n in names}
    report("planner", figures)


if __name__ == "__main__":
    main()
