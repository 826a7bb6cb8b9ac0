"""Measure an efficiency profile: the python test runner's speed-up with the cores it is granted.

A synthetic CPU-bound test suite (N tests of equal work) runs through the live service's
`python_tests` tool with `parallel` = 1, 2, 4 ... up to the machine's cores, alternating sizes
and repeating, and E(m) = T(1) / (m T(m)) is printed with the medians: paste the points into a
scenario's `profiles:` (or the service's `parallel_profile`). Needs root and bubblewrap.
Run: .venv/bin/python benchmarks/bench_actions_profile.py [TESTS] [SECONDS_PER_TEST]
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import report  # noqa: E402
from libra.runtime.sandbox.client import ServiceProcess  # noqa: E402
from libra.runtime.sandbox.config import SandboxConfig  # noqa: E402
from libra.runtime.sandbox.sandbox import probe  # noqa: E402

SUITE = """
import time

def burn(seconds):
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1
    return x

{tests}
"""


def suite(n: int, seconds: float) -> str:
    tests = "\n".join(f"def test_{i}():\n    assert burn({seconds}) > 0\n" for i in range(n))
    return SUITE.format(tests=tests)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    per = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    iso = probe(SandboxConfig())
    if not iso.sandboxed:
        report("actions_profile", {"skipped": iso.reason})
        return
    cores = len(os.sched_getaffinity(0))
    sizes = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= cores]
    cfg = Path(tempfile.mkdtemp()) / "actions.yaml"
    cfg.write_text(json.dumps({"sandbox": {"max_timeout_s": 600}}))
    times: dict[int, list[float]] = {m: [] for m in sizes}
    with ServiceProcess(str(cfg)) as svc, httpx.Client(base_url=svc.url, timeout=900) as c:
        files = {"test_burn.py": base64.b64encode(suite(n, per).encode()).decode()}
        sid = c.post("/sessions", json={"files": files}).json()["session_id"]
        for _ in range(3):
            for m in sizes:
                r = c.post(f"/sessions/{sid}/actions", json={"tool": "python_tests", "path": "test_burn.py",
                                                             "parallel": m, "timeout": 600}).json()  # fmt: skip
                assert r["tests"]["passed"] == n, r
                times.setdefault(r["parallel"], []).append(r["exec_s"])  # by the cores actually granted
        c.delete(f"/sessions/{sid}")
    t = {m: statistics.median(v) for m, v in sorted(times.items()) if v}
    eff = {m: round(t[1] / (m * t[m]), 3) for m in t} if 1 in t else {}
    report("actions_profile", {"tests": n, "cpu_s_per_test": per, "exec_s": {m: round(v, 2) for m, v in t.items()},
                               "efficiency": eff, "load_avg_1m": round(os.getloadavg()[0], 2)})  # fmt: skip


if __name__ == "__main__":
    main()
