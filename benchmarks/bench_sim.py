"""Simulator speed and memory on the shipped scenarios, compiled and pure Python side by side.

Each case runs in a fresh subprocess (one process uses one core: the simulator is single-threaded),
once with the compiled modules (`libra.sim.native`) and once with LIBRA_PURE_PYTHON=1, so the speed-up
is a ratio measured in one run. Both must give the same throughput, to the last bit.
Goals: the default job (`libra simulate`: libra-r2e-48gpu, 8 systems, 100 steps, plots included)
<= 120 s on one core; libra-r2e-48gpu static-uniform 100 steps <= 30 s; scale-1024gpu
static-uniform 5 steps <= 120 s; peak memory <= 4 GB.
Run: .venv/bin/python benchmarks/bench_sim.py [--quick] [--compiled-only]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402

# name -> (scenario, systems or None for the scenario's default list, steps, goal in seconds)
CASES = {
    "default_job": ("libra-r2e-48gpu", None, 100, 120.0),
    "r2e_48gpu_100_steps": ("libra-r2e-48gpu", "static-uniform", 100, 30.0),
    "scale_1024gpu_5_steps": ("scale-1024gpu", "static-uniform", 5, 120.0),
}

CHILD = """
import json, resource, sys, time
from libra.sim import native
native.activate()  # as `libra simulate` does: the compiled build when there is one (and not LIBRA_PURE_PYTHON)
from libra.sim.rl.pipeline import run
from libra.sim.scenarios import load_scenario
systems = sys.argv[2].split(",") if sys.argv[2] else None
out = sys.argv[4] or None
t = time.perf_counter()
res = run(load_scenario(sys.argv[1]), systems, int(sys.argv[3]), 0, out, lambda a, b: None)
wall = time.perf_counter() - t
# Each system simulates in a forked child (libra.sim.isolation): the peak is the larger of the two.
rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024 / 1024
tok = {k: v["throughput_tokens_per_s"] for k, v in res["systems"].items()}
print(json.dumps({"seconds": wall, "peak_gib": rss, "compiled": native.active(), "tok_s": tok}))
"""


def _case(scenario: str, systems: str | None, steps: int, pure: bool) -> dict:
    env = dict(os.environ, LIBRA_PURE_PYTHON="1" if pure else "0")
    with tempfile.TemporaryDirectory() as out:
        args = [scenario, systems or "", str(steps), out if systems is None else ""]
        proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    quick, compiled_only = "--quick" in sys.argv, "--compiled-only" in sys.argv
    figures = {}
    for name, (scenario, systems, steps, goal) in CASES.items():
        steps = max(1, steps // 10) if quick else steps
        t0 = time.perf_counter()
        fast = _case(scenario, systems, steps, pure=False)
        row = {"steps": steps, "goal_s": goal, "compiled": fast["compiled"], "seconds": round(fast["seconds"], 2),
               "peak_gib": round(fast["peak_gib"], 3)}  # fmt: skip
        if not compiled_only:
            slow = _case(scenario, systems, steps, pure=True)
            row.update(pure_seconds=round(slow["seconds"], 2), speedup=round(slow["seconds"] / fast["seconds"], 2),
                       identical=slow["tok_s"] == fast["tok_s"])  # fmt: skip
        row["process_s"] = round(time.perf_counter() - t0, 2)
        figures[name] = row
    report("simulator", figures)


if __name__ == "__main__":
    main()
