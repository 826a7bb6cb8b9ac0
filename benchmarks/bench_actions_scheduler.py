"""Elastic action scheduler decision latency (ARL-Tangram policy).

Goal: one decision <= 5 ms median with 1000 waiting actions on 256 cores.
The snapshot is a loaded node: 256 cores, half of them busy with running actions that end at
various times, and 1000 waiting actions in FCFS order, a third of them elastic test runs (1-16
cores, Amdahl profile), the rest one-core commands. A second figure uses the orchestrator's full
path (building the pools from the managers) on the same load, and a third a GPU pool (buddy
split) with 1000 waiting reward-model calls on 64 GPUs.
Run: .venv/bin/python benchmarks/bench_actions_scheduler.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.actions import Action, EfficiencyProfile, ElasticScheduler, Orchestrator, ResourceVector  # noqa: E402
from libra.actions.cpu import CpuManager, CpuNode  # noqa: E402
from libra.actions.gpu import GpuManager, GpuService  # noqa: E402
from libra.actions.scheduler import Pool, SchedulerView  # noqa: E402
from libra.actions.topology import Fungible  # noqa: E402

PYTEST = EfficiencyProfile.amdahl("pytest-xdist", 0.06, (1, 2, 4, 8, 16))
TP = EfficiencyProfile.from_mapping("tp", {1: 1.0, 2: 0.97, 4: 0.93, 8: 0.86})


def cpu_actions(rng: random.Random, n: int) -> list[Action]:
    out = []
    for i in range(n):
        elastic = rng.random() < 1 / 3
        demand = ResourceVector.of("cpu", cpu=[1, 16] if elastic else 1, memory=2)
        t1 = rng.lognormvariate(2.0, 1.0) if elastic else rng.lognormvariate(-0.5, 1.0)
        out.append(Action(f"a{i}", f"t{i % 400}", "run-tests" if elastic else "shell", t1, demand,
                          PYTEST if elastic else None, seq=i))  # fmt: skip
    return out


def median_ms(fn, repeats: int = 41) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def scheduler_only(rng: random.Random) -> float:
    waiting = cpu_actions(rng, 1000)
    releases = [(rng.uniform(0.1, 30.0), rng.choice([1, 1, 2, 4])) for _ in range(80)]
    busy = sum(u for _, u in releases)
    pool = Pool(0, Fungible(), (256 - busy,), releases, work_price=0.5 * busy / (256 - busy + 1))
    view = SchedulerView(0.0, waiting, {0: pool}, lambda a: 0)
    sched = ElasticScheduler()
    return median_ms(lambda: sched.decide(view))


def orchestrator_path(rng: random.Random) -> float:
    """submit 1000 + decide, then time further decisions while the same load waits."""

    def build() -> Orchestrator:
        orch = Orchestrator(cpu=CpuManager([CpuNode.uniform(256, 2, memory_gib=4096)]))
        for a in cpu_actions(random.Random(1), 1128):
            orch.submit(a, 0.0)
        orch.decide(0.0)  # fills the node; about 1000 stay waiting
        return orch

    orch = build()
    return median_ms(lambda: orch.decide(1.0))


def gpu_pool(rng: random.Random) -> float:
    services = {f"rm{i}": GpuService(name=f"rm{i}", state_gib=28) for i in range(10)}
    orch = Orchestrator(gpu=GpuManager([8] * 8, 80.0, services))
    for i in range(1064):
        demand = ResourceVector.of("gpu", gpu={"set": [1, 2, 4, 8]})
        orch.submit(
            Action(f"g{i}", f"t{i}", "score", rng.uniform(5, 60), demand, TP, service=f"rm{i % 10}"), 0.0
        )
    orch.decide(0.0)
    return median_ms(lambda: orch.decide(1.0))


def main() -> None:
    rng = random.Random(0)
    figures = {
        "decision_ms_1000_waiting_256_cores": scheduler_only(rng),
        "orchestrator_decision_ms_1000_waiting_256_cores": orchestrator_path(rng),
        "gpu_decision_ms_1000_waiting_64_gpus": gpu_pool(rng),
        "goal_ms": 5.0,
    }
    report("actions_scheduler", {k: round(v, 3) for k, v in figures.items()})


if __name__ == "__main__":
    main()
