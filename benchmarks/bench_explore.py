"""Time the default gains map (`libra explore`), the goal being under 10 minutes on 2 cores.

Runs the grid exactly as `libra explore --grid GRID --workers W` does (the same sweep, local
processes, the compiled simulator modules when a build of these sources exists), and prints one
JSON line: the wall time, the cells and systems simulated, and per mechanism its best gain over
the grid. With `--json` it prints the whole map instead of the summary's per-mechanism figures.

Run: .venv/bin/python benchmarks/bench_explore.py [--grid default] [--workers 2] [--steps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.sim import native  # noqa: E402

native.activate()  # before the simulator is imported, as `libra explore` does

from benchmarks.common import report  # noqa: E402
from libra.core.errors import ConfigError  # noqa: E402
from libra.sim.explore.grid import load_grid  # noqa: E402
from libra.sim.explore.sweep import local_map, sweep  # noqa: E402

GOAL_S = 600.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="default")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="RL steps per cell (default: the grid's)")
    ap.add_argument("--json", action="store_true", help="print the whole map as one JSON object")
    args = ap.parse_args()
    try:
        grid = load_grid(args.grid)
    except ConfigError as e:
        ap.error(str(e))
    if args.steps is not None:
        grid = grid.model_copy(update={"steps": args.steps})
    t0 = time.perf_counter()
    result = sweep(grid, local_map(args.workers))
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps({**result, "wall_s": wall, "workers": args.workers}))
        return
    best = {m: {"gain": round(b["gain"], 4), "cell": b["cell"]} for m, b in result["best_gain"].items()}
    report("explore", {"grid": grid.name, "cells": len(result["cells"]), "systems": len(result["systems"]),
                       "steps": grid.steps, "workers": args.workers, "compiled": native.active(),
                       "wall_s": round(wall, 1), "goal_s": GOAL_S, "best_gain": best})  # fmt: skip


if __name__ == "__main__":
    main()
