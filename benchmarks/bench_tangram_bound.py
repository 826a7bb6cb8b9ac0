"""How large a mean-ACT win over k8s any scheduler could get on tangram-coding: the no-queue bound.

Issue 6 asks that `tangram` cut mean ACT to a third of `k8s-per-trajectory`'s. This measures how
much room the workload leaves. It runs the scenario as shipped (k8s and tangram on the same 4 x 32
cores), then tangram again with `--cores-scale` times the cores per node. With that many cores no
action ever queues and every elastic test run gets its widest useful grant, so tangram's mean ACT
there is a floor: what the actions themselves take. No scheduler on the real cores can go below it,
so

    best possible win = k8s mean ACT (shipped cores) / tangram mean ACT (ample cores)

and `needed_for_3x` is the mean ACT tangram would need on the shipped cores. The gap between the
two tangram runs is what queueing and narrow grants cost on the real cores.

The ample-cores floor ignores that the shipped cores are *saturated* at each step's start: every
trajectory starts at once, so `offered_load` gives, per 25-second window from a step's start, the
one-core work of the actions submitted in it over the window's core-seconds (mean over steps).
One core is an action's most efficient width, so a value near or above 1 means no scheduler can
run those actions wide, or all of them at once, and they must queue.

Run: .venv/bin/python benchmarks/bench_tangram_bound.py [--cores-scale 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.core.config import build  # noqa: E402
from libra.sim.scenarios import read_scenario  # noqa: E402
from libra.sim.tangram.config import TangramScenario  # noqa: E402
from libra.sim.tangram.runner import SETUPS, run, simulate_system  # noqa: E402


def mean_act(raw: dict, system: str) -> dict:
    a = run(build(TangramScenario, raw, "scenario"), systems=[system], seed=0)["systems"][system]["actions"]
    return {"mean_act_s": round(a["mean_act_s"], 3), "mean_queue_s": round(a["mean_queue_s"], 3)}


def offered_load(raw: dict, windows: int = 8, width_s: float = 25.0) -> list[float]:
    """One-core work submitted per window from each step's start, over the window's core-seconds."""
    sc = build(TangramScenario, raw, "scenario")
    setup = SETUPS[sc.workload](sc, None)
    res, recs = simulate_system(setup, "tangram", sc.systems["tangram"], sc.steps, 0, lambda *a: None)
    cores = sc.cluster.nodes * sc.cluster.cores_per_node
    starts = [0.0]
    for row in res["per_step"][:-1]:
        starts.append(starts[-1] + row["step_time_s"])
    load = [0.0] * windows
    for a in recs:
        t0 = max(s for s in starts if s <= a.submit)
        w = int((a.submit - t0) // width_s)
        if w < windows:
            load[w] += a.spec.t1 / (width_s * cores * len(starts))
    return [round(x, 2) for x in load]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores-scale", type=int, default=16, help="Cores per node multiplier of the ample run.")
    args = ap.parse_args()
    if args.cores_scale < 1:
        ap.error(f"--cores-scale must be an integer >= 1, got {args.cores_scale}")
    raw = read_scenario("tangram-coding")
    k8s = mean_act(raw, "k8s-per-trajectory")
    shipped = mean_act(raw, "tangram")
    cluster = raw["cluster"]
    ample_raw = {
        **raw,
        "cluster": {**cluster, "cores_per_node": cluster["cores_per_node"] * args.cores_scale},
    }
    ample = mean_act(ample_raw, "tangram")
    report("tangram_bound", {
        "cores": cluster["nodes"] * cluster["cores_per_node"],
        "ample_cores": cluster["nodes"] * cluster["cores_per_node"] * args.cores_scale,
        "k8s": k8s,
        "tangram": shipped,
        "tangram_ample_cores": ample,
        "win": round(k8s["mean_act_s"] / shipped["mean_act_s"], 2),
        "best_possible_win": round(k8s["mean_act_s"] / ample["mean_act_s"], 2),
        "needed_for_3x_s": round(k8s["mean_act_s"] / 3, 3),
        "offered_load_per_25s_from_step_start": offered_load(raw),
    })  # fmt: skip


if __name__ == "__main__":
    main()
