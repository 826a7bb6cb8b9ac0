"""The load price's scale (`libra.actions.orchestrator.PRICE_SCALE`), swept on tangram-coding.

The orchestrator prices a core-second of work by the node's occupancy, times PRICE_SCALE, so that
elastic test runs stay narrow while short commands are arriving. The shipped 0.5 comes from this
sweep: it prints tangram's mean ACT (and queueing) at each scale, 2 steps, seed 0.

Run: .venv/bin/python benchmarks/bench_actions_price.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from libra.actions import orchestrator  # noqa: E402
from libra.sim.scenarios import load_scenario  # noqa: E402
from libra.sim.tangram.runner import run  # noqa: E402

SCALES = (0.0, 0.1, 0.25, 0.35, 0.5, 0.7, 1.0, 2.0)


def main() -> None:
    shipped, rows = orchestrator.PRICE_SCALE, {}
    try:
        for scale in SCALES:
            orchestrator.PRICE_SCALE = scale
            a = run(load_scenario("tangram-coding"), systems=["tangram"], seed=0)["systems"]["tangram"][
                "actions"
            ]
            rows[str(scale)] = {
                "mean_act_s": round(a["mean_act_s"], 3),
                "mean_queue_s": round(a["mean_queue_s"], 3),
            }
    finally:
        orchestrator.PRICE_SCALE = shipped
    best = min(r["mean_act_s"] for r in rows.values())
    report("actions_price_scale", {
        "shipped": shipped,
        "shipped_vs_best": round(rows[str(shipped)]["mean_act_s"] / best, 3),
        "by_scale": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
