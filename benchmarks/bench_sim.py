"""Simulator speed and memory on the shipped scenarios (each case in a fresh subprocess).

Goals: libra-r2e-48gpu, static-uniform, 100 steps <= 30 s on one core; scale-1024gpu,
static-uniform, 5 steps <= 120 s; peak memory <= 4 GB. The simulator is single-threaded, so one
process uses one core.
Run: .venv/bin/python benchmarks/bench_sim.py [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402

CASES = {
    "r2e_48gpu_100_steps": ("libra-r2e-48gpu", "static-uniform", 100, 30.0),
    "scale_1024gpu_5_steps": ("scale-1024gpu", "static-uniform", 5, 120.0),
}

CHILD = """
import json, resource, sys, time
from libra.sim.pipeline import run
from libra.sim.scenarios import load_scenario
t = time.perf_counter()
res = run(load_scenario(sys.argv[1]), [sys.argv[2]], int(sys.argv[3]), 0, None, lambda a, b: None)
wall = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024
print(json.dumps({"seconds": wall, "peak_gib": rss, "sim_tok_s": res["systems"][sys.argv[2]]["throughput_tokens_per_s"]}))
"""


def main() -> None:
    quick = "--quick" in sys.argv
    figures = {}
    for name, (scenario, system, steps, goal) in CASES.items():
        steps = max(1, steps // 10) if quick else steps
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, scenario, system, str(steps)], capture_output=True, text=True
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        figures[name] = {"steps": steps, "seconds": round(r["seconds"], 2), "goal_s": goal,
                         "peak_gib": round(r["peak_gib"], 3), "process_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    report("simulator", figures)


if __name__ == "__main__":
    main()
