"""How much of a rollout's makespan any GPU layout or router could remove: the tail bound.

Issue 5's targets (libra >= 1.25x static-optimal, a climbing ablation ladder) need rollout to get
faster when the layout and the router change. This measures how much room there is. For every
step it takes the batch's slowest trajectory *on its own*: each output token decoded at batch 1
on the fastest engine the node allows (TP = GPUs per node), no queueing, no prefill, plus the
trajectory's tool time. No placement of that trajectory can finish it sooner, so

    bound share = (slowest trajectory's solo critical path) / (measured rollout makespan)

is the part of the makespan that no layout or routing can remove; 1 - share is the most any of
them could save on that step. The makespan is measured with `static-uniform` (the scenario's own
split, one TP everywhere) with `pipeline.consume: batch`, where each step waits for its own batch;
the default (completion order) is the pipeline's answer to this bound. For that default it also
measures the floor of the batch's median GRPO group (a group ends with its slowest sample) against
the makespan until the step's groups were in, over all steps and over the last tenth (the longest,
most tool-heavy trajectories, after the workload's drift).

Run: .venv/bin/python benchmarks/bench_tail_bound.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.core.trajectory import Trajectory  # noqa: E402
from libra.costmodel.catalog import load_catalog  # noqa: E402
from libra.costmodel.rollout import RolloutCostModel  # noqa: E402
from libra.sim.rl.config import parse_rl  # noqa: E402
from libra.sim.rl.pipeline import Batches, RLSim  # noqa: E402
from libra.sim.rl.systems import make_system  # noqa: E402
from libra.sim.scenarios import read_scenario  # noqa: E402

SCENARIOS = ("libra-r2e-48gpu", "libra-searchr1-48gpu")


def solo_critical_path_s(t: Trajectory, cost: RolloutCostModel, tool_default_s: float) -> float:
    """Decode every output token at batch 1 (step time A + B * context), plus the tool calls."""
    a, b = cost.decode_coeffs(1)
    ctx, total = t.prompt_tokens, 0.0
    for turn in t.turns:
        total += turn.output_tokens * (a + b * (ctx + turn.output_tokens / 2))
        ctx += turn.output_tokens + turn.tool_return_tokens
        if turn.has_tool:
            total += turn.tool_latency_s if turn.tool_latency_s is not None else tool_default_s
    return total


def bound_shares(scenario: str, steps: int, consume: str = "batch") -> list[float]:
    """Per step: the solo floor over the measured rollout makespan of `static-uniform`.

    consume=batch: each step waits for exactly its batch, and the floor is the batch's slowest
    trajectory. consume=completion (the default pipeline): a step trains the first groups to
    finish, so the floor is the batch's *median group*, a group being as slow as its slowest sample.
    """
    cat = load_catalog()
    raw = read_scenario(scenario)
    raw["pipeline"] = {**raw.get("pipeline", {}), "consume": consume}
    sc = parse_rl(raw, cat)
    hw, model = cat.hardware(sc.cluster.hardware), cat.model(sc.model)
    tp = max(t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node and model.heads % t == 0)
    cost = RolloutCostModel(hw, model, tp)
    batches = Batches(sc, 0)
    sim = RLSim(sc, make_system("static-uniform"), batches, steps, 0)
    sim.run()
    default = sc.pipeline.tool_latency_default_s
    shares = []
    for r in sim.history:
        solo = [(t.prompt_id, solo_critical_path_s(t, cost, default)) for t in batches.get(r.step)]
        if consume == "batch":
            floor = max(v for _, v in solo)
        else:
            groups: dict[str, float] = {}
            for pid, v in solo:
                groups[pid] = max(v, groups.get(pid, 0.0))
            floor = statistics.median(groups.values())
        shares.append(floor / r.rollout_makespan)
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    figures = {"steps": args.steps}
    for name in SCENARIOS:
        s = sorted(bound_shares(name, args.steps))
        g = bound_shares(name, args.steps, "completion")
        last = g[-max(1, len(g) // 10) :]
        figures[name] = {
            "bound_share_median": round(statistics.median(s), 3),
            "bound_share_p10": round(s[len(s) // 10], 3),
            "most_any_layout_saves_median": round(1 - statistics.median(s), 3),
            "completion_group_floor_share_median": round(statistics.median(g), 3),
            "completion_group_floor_share_last_tenth": round(statistics.median(last), 3),
        }
    report("tail_bound", figures)


if __name__ == "__main__":
    main()
