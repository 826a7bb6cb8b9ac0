"""What sets a step's rollout time: GPUs, TP, or how many batches may overlap (the staleness bound).

The ablation ladder (issue 5) moves GPUs between training and rollout and changes the rollout
layout. Both help only if a batch's rollout gets faster with more or faster engines. This runs
`static-uniform` on the default scenario under a small grid and reports, per setting, the mean
rollout makespan (batch start until the step's GRPO groups were in), the training time and the
throughput:

- rollout GPUs a third or two thirds of the cluster (16 or 32 of 48; the rest train), at
  staleness k = 1, 2, 4;
- the homogeneous TP at 2, 4 and 8, at the scenario's split and k = 1.

If the makespan stays put while GPUs and TP change, rollout is bound by the trajectories' own
latency (turns, tool calls, the slowest groups a step waits for), not by engine capacity; then only
more overlap between batches (a larger k) raises throughput, until training binds. Each setting
also reports which batches a step's trained trajectories came from (`trained_from_batch`): with
completion order, fast groups of the next batch overtake the slow ones of this batch.

Run: .venv/bin/python benchmarks/bench_pipeline_bound.py [--steps N] [--scenario NAME]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.core.config import apply_overrides  # noqa: E402
from libra.core.errors import ConfigError  # noqa: E402
from libra.costmodel.catalog import Catalog, load_catalog  # noqa: E402
from libra.sim.rl.config import parse_rl  # noqa: E402
from libra.sim.rl.pipeline import Batches, RLSim  # noqa: E402
from libra.sim.rl.records import StepRecord  # noqa: E402
from libra.sim.rl.systems import make_system  # noqa: E402
from libra.sim.scenarios import read_scenario  # noqa: E402


def run_one(raw: dict, cat: Catalog, steps: int, overrides: list[str]) -> dict:
    sc = parse_rl(apply_overrides(raw, overrides), cat)
    sim = RLSim(sc, make_system("static-uniform"), Batches(sc, 0), steps, 0)
    res = sim.run()
    return {
        "rollout_makespan_s": round(res["mean_rollout_makespan_s"], 1),
        "train_s": round(res["mean_train_time_s"], 1),
        "tokens_per_s": round(res["throughput_tokens_per_s"]),
        "trained_from_batch": batch_mix(sim.history[2:]),
    }


def batch_mix(history: list[StepRecord]) -> dict[str, float]:
    """Which batches a step's trained trajectories come from, as shares: "0" its own, "+1" the
    next batch's fast groups that overtook it, "-1" and below the stragglers of earlier batches
    (completion order; the first two steps, which start together, are left out)."""
    counts = Counter(t.step - rec.step for rec in history for t in rec.trajs)
    n = sum(counts.values()) or 1
    return {f"{k:+d}" if k else "0": round(v / n, 3) for k, v in sorted(counts.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--scenario", default="libra-r2e-48gpu", help="an RL scenario name or YAML path")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps must be an integer >= 3 (the first two steps start together), got {args.steps}")
    cat = load_catalog()
    try:
        raw = read_scenario(args.scenario)
        cluster = parse_rl(raw, cat).cluster
    except ConfigError as e:
        ap.error(str(e))
    per_node = cat.hardware(cluster.hardware).gpus_per_node
    gpus = cluster.nodes * per_node
    third = max(per_node, gpus // 3 // per_node * per_node)  # 16 and 32 of the paper scenarios' 48
    grid: dict[str, dict] = {}
    for k in (1, 2, 4):
        for r in (third, gpus - third):
            over = [f"pipeline.staleness={k}", f"split.rollout_gpus={r}", f"split.train_gpus={gpus - r}"]
            grid[f"k={k},rollout_gpus={r}"] = run_one(raw, cat, args.steps, over)
    for tp in (2, 4, 8):
        grid[f"k=1,tp={tp}"] = run_one(raw, cat, args.steps, [f"rollout.homogeneous_tp={tp}"])
    report("pipeline_bound", {"scenario": args.scenario, "steps": args.steps, "static_uniform": grid})


if __name__ == "__main__":
    main()
