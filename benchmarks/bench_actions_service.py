"""Warm-start latency of the actions service: a trivial Python /run_code, end to end over HTTP.

Goal: p50 <= 50 ms for `print(1)` through the real service (HTTP, scheduling, bubblewrap
sandbox, interpreter, teardown), measured after a warm-up with requests 200 ms apart, as tool
calls of an agent are (generation separates them), so the warm pool has refilled. Side by side in
the same run: the same requests back to back (each one then shares the CPU with the start-up of
the sandbox that replaces the previous one), the cold path (a request with its own memory limit
skips the warm pool), and the throughput of 200 concurrent requests. The 1-minute load average is
reported because the figures scale with it on a shared machine. Needs root and bubblewrap.
Run: .venv/bin/python benchmarks/bench_actions_service.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import report  # noqa: E402
from libra.runtime.sandbox.client import ServiceProcess  # noqa: E402
from libra.runtime.sandbox.sandbox import host_problem  # noqa: E402


def latencies(c: httpx.Client, body: dict, n: int, gap_s: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        r = c.post("/run_code", json=body)
        out.append(time.perf_counter() - t0)
        assert r.json()["status"] == "Success", r.text
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def burst(url: str, n: int) -> float:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[c.post("/run_code", json={"code": f"print({i})"}) for i in range(n)])
        assert all(r.json()["status"] == "Success" for r in rs)
        return n / (time.perf_counter() - t0)


def main() -> None:
    if reason := host_problem():
        report("actions_service", {"skipped": reason})
        return
    cfg = Path(tempfile.mkdtemp()) / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 4}))
    with ServiceProcess(str(cfg)) as svc, httpx.Client(base_url=svc.url, timeout=60) as c:
        latencies(c, {"code": "print(1)"}, 10)  # warm-up: page cache, pool filled
        warm = latencies(c, {"code": "print(1)"}, 60, gap_s=0.2)
        back_to_back = latencies(c, {"code": "print(1)"}, 60)
        cold = latencies(c, {"code": "print(1)", "memory_limit_MB": 1000}, 30, gap_s=0.2)
        rps = asyncio.run(burst(svc.url, 200))
    report("actions_service", {
        "warm_run_code_p50_ms": round(1e3 * statistics.median(warm), 1),
        "warm_run_code_p90_ms": round(1e3 * pct(warm, 0.9), 1),
        "back_to_back_run_code_p50_ms": round(1e3 * statistics.median(back_to_back), 1),
        "cold_run_code_p50_ms": round(1e3 * statistics.median(cold), 1),
        "burst_200_requests_per_s": round(rps, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "goal_p50_ms": 50.0,
    })  # fmt: skip


if __name__ == "__main__":
    main()
