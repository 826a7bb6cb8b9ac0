"""The long forms of the live tests' concurrency checks: the same functions the tests run, at the
sizes the tests ran before they were cut down to run in minutes on two cores (issue 42).

1. actions: 500 /run_code requests at once on one service, every one answered with its own output
   (tests/test_actions_hostile.py `concurrent_programs`, `assert_every_one_answered`);
2. actions side by side: two services on their own uid ranges, 300 programs on each at once, every
   one answered correctly (`side_by_side`, `assert_each_its_own`);
3. gateway: 1000 two-turn sessions, their first turns held together by the instant backends
   (tests/test_gateway_http.py `concurrent_sessions`);
4. engine: 64 chat requests (the engine's max_num_seqs) queued while paused, then batched
   (tests/test_engine_http.py `concurrent_requests`).

Each part prints whether it passed and how long it took (wall seconds; they scale with the load
average, which is reported). The actions parts need root and bubblewrap (`make sysdeps`), and are
reported as skipped without them.

Run: .venv/bin/python benchmarks/bench_live_scale.py [--parts actions,side,gateway,engine]
     [--scale 1.0]   (--scale 0.1 runs a tenth of each size, as a quick check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402

SIZES = {"actions": 500, "side": 300, "gateway": 1000, "engine": 64}


class Started:
    """Factories like the tests' fixtures (`instant_factory`, `gateway_factory`, `engine_factory`)
    that stop everything they started on close."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []

    def instant(self, *args: str, ports: int = 1):
        from tests.test_gateway_fixtures import start_instant

        return self._keep(start_instant(*args, ports=ports, log_dir=self.log_dir))

    def gateway(self, *args: str):
        from tests.test_gateway_fixtures import start_gateway

        return self._keep(start_gateway(*args, log_dir=self.log_dir))

    def engine(self, *args: str):
        from tests.engine_fixtures import start_engine

        return self._keep(start_engine(*args, log_dir=self.log_dir))

    def _keep(self, proc):
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def actions_part(n: int, log_dir: Path) -> None:
    from tests.test_actions_hostile import HOSTILE_CONFIG, assert_every_one_answered, concurrent_programs

    from libra.runtime.sandbox.client import ServiceProcess

    cfg = log_dir / "actions.json"
    cfg.write_text(json.dumps(HOSTILE_CONFIG))
    with ServiceProcess(str(cfg)) as svc:
        assert_every_one_answered(svc.url, concurrent_programs(svc.url, n), n)


def side_part(n: int, log_dir: Path) -> None:
    from tests.test_actions_hostile import assert_each_its_own, side_by_side, uid_range

    from libra.runtime.sandbox.client import ServiceProcess

    cfg = log_dir / "side.json"
    cfg.write_text(json.dumps({"warm_pool": 2, "sandbox": {"uid_count": 128}}))
    with ServiceProcess(str(cfg)) as a, ServiceProcess(str(cfg)) as b:
        assert not set(uid_range(a.url)) & set(uid_range(b.url))
        assert_each_its_own(side_by_side([a.url, b.url], n), n)


def gateway_part(n: int, log_dir: Path) -> None:
    from tests.test_gateway_http import concurrent_sessions

    started = Started(log_dir)
    try:
        concurrent_sessions(started.instant, started.gateway, n)
    finally:
        started.close()


def engine_part(n: int, log_dir: Path) -> None:
    from tests.test_engine_http import concurrent_requests

    started = Started(log_dir)
    try:
        concurrent_requests(started.engine("--max-num-seqs", str(max(64, n))), n)
    finally:
        started.close()


PARTS: dict[str, Callable[[int, Path], None]] = {
    "actions": actions_part,
    "side": side_part,
    "gateway": gateway_part,
    "engine": engine_part,
}


def sandbox_missing(part: str) -> str | None:
    if part not in ("actions", "side"):
        return None
    from tests.test_actions_service import sandbox_available

    return sandbox_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each size to run")
    args = ap.parse_args()
    figures: dict[str, dict] = {}
    for part in args.parts.split(","):
        n = max(1, round(SIZES[part] * args.scale))
        why = sandbox_missing(part)
        if why is not None:
            figures[part] = {"n": n, "skipped": why}
            continue
        t0 = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix=f"libra-scale-{part}-") as d:
                PARTS[part](n, Path(d))
            ok, error = True, None
        except Exception as e:  # reported, and the other parts still run
            ok, error = False, "".join(traceback.format_exception_only(e)).strip()[:500]
        figures[part] = {"n": n, "passed": ok, "wall_s": round(time.monotonic() - t0, 1)}
        if error:
            figures[part]["error"] = error
    report("live_scale", {"load_1min": round(os.getloadavg()[0], 2), "parts": figures})
    if not all(f.get("passed", True) for f in figures.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
