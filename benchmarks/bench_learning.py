"""What GRPO itself adds: the seeded in-process learning curve of `libra train`'s default config.

    python benchmarks/bench_learning.py [--seed S] [--steps N] [--set KEY=VALUE ...]

Runs `runtime.train.inprocess.quick_grpo` (the live task, agent loop, engine core, learner and
GRPO loss, without HTTP or separate processes; one torch thread): the warm-start to its probe's
target, then N synchronous GRPO steps. Prints one JSON object: `first_success` (the sampled
success of RL step 0, right after the warm-start), `final_success` (mean of the last 5 steps),
`grpo_rise` (mean of the last 5 steps minus the first 5: what the test asserts),
`steps_to_success_0_8` (first step whose 5-step mean reaches 0.8; null if never), the warm-start's
steps and probe, the wall seconds of each phase and the per-step success list.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import report  # noqa: E402
from libra.runtime.train.config import load_train_config  # noqa: E402
from libra.runtime.train.inprocess import quick_grpo  # noqa: E402
from libra.runtime.train.report import MOVING, moving  # noqa: E402


def _progress(rec: dict) -> None:
    print(f"step {rec['step']}: success {rec['success']:.3f}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_train_config(None, [f"seed={a.seed}", f"steps={a.steps}", *a.overrides])
    t0 = time.time()
    sft_done: list[float] = []
    run = asyncio.run(quick_grpo(cfg, on_step=_progress, on_sft=lambda i, loss: sft_done.append(time.time())))
    wall = time.time() - t0
    succ = [r["success"] for r in run.steps]
    avg = moving(succ)
    ws_s = (sft_done[-1] - t0) if sft_done else 0.0
    report(
        "learning",
        {
            "seed": a.seed,
            "task": cfg.task.model_dump(include={"lo", "hi", "ops"}),
            "trainer": cfg.trainer.model_dump(include={"lr", "negative_weight", "normalize_std"}),
            "warmstart_steps": run.warmstart.steps,
            "warmstart_probe": run.warmstart.success,
            "first_success": succ[0],
            "final_success": avg[-1],
            "grpo_rise": sum(succ[-MOVING:]) / MOVING - sum(succ[:MOVING]) / MOVING,
            "steps": len(succ),
            "steps_to_success_0_8": next((i for i, v in enumerate(avg) if v >= 0.8), None),
            "warmstart_s": round(ws_s, 1),
            "rl_s": round(wall - ws_s, 1),
            "wall_s": round(wall, 1),
            "success": [round(s, 3) for s in succ],
        },
    )


if __name__ == "__main__":
    main()
