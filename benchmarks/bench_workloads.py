"""Workload generation speed: the simulator generates one RL step of trajectories per step.

Goal: 512 trajectories (32 prompts x 16 samples) well under a second for every family, at the end
of the drift horizon where r2e-gym trajectories are longest; the 1024-GPU scale scenario needs
8192 per step (512 x 16), reported too.
Run: .venv/bin/python benchmarks/bench_workloads.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_time, report  # noqa: E402
from libra.sim.workloads import FAMILIES, make_workload  # noqa: E402


def main() -> None:
    figures: dict[str, float] = {}
    for family in FAMILIES:
        for prompts, repeats in ((32, 7), (512, 3)):
            wl = make_workload({"family": family, "prompts_per_step": prompts, "samples_per_prompt": 16})
            step = wl.params.drift_steps  # the end of the horizon: the longest trajectories
            rng = random.Random(0)
            sec = median_time(lambda wl=wl, step=step, rng=rng: wl.generate(step, rng), 1, repeats)
            figures[f"{family}_{prompts * 16}_trajs_s"] = round(sec, 4)
    figures["goal_512_trajs_s"] = 1.0
    report("workloads", figures)


if __name__ == "__main__":
    main()
