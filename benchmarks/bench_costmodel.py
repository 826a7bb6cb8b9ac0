"""Cost-model evaluation speed: the simulator and planner call `step_time` millions of times.

Goal: one rollout iteration-time evaluation <= 20 us median.
Run: .venv/bin/python benchmarks/bench_costmodel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_time, report  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.costmodel.rollout import RolloutCostModel  # noqa: E402
from libra.costmodel.training import TrainCostModel, TrainParallel  # noqa: E402


def main() -> None:
    cat = load_catalog()
    dense = RolloutCostModel(cat.hardware("a800-80g"), cat.model("qwen3-14b"), 4)
    moe = RolloutCostModel(cat.hardware("h100-80g"), cat.model("qwen3-30b-a3b"), 2)
    train = TrainCostModel(cat.hardware("a800-80g"), cat.model("qwen3-14b"))
    lens = [4096] * 512
    figures = {
        "rollout_step_time_dense_us": 1e6
        * median_time(lambda: dense.step_time(512, 400000.0, 63, 258048.0), 20000),
        "rollout_step_time_moe_us": 1e6
        * median_time(lambda: moe.step_time(512, 400000.0, 63, 258048.0), 20000),
        "train_step_512_seqs_us": 1e6
        * median_time(lambda: train.step(TrainParallel(tp=4, dp=6), lens), 50, 7),
        "goal_rollout_us": 20.0,
    }
    report("costmodel", {k: round(v, 3) for k, v in figures.items()})


if __name__ == "__main__":
    main()
