"""Elastic data parallelism, libra against torchft, on the same machine, model, data and loop.

Both run two fixed core replicas of the built-in model (AdamW, the synthetic workload with the
loss over the step's global token count) and the same script of events:
- a hybrid replica is asked to join at step `JOIN1` (its process already up, as a trainer started
  in a drained engine's slot would be), counts for `LEAVE_AFTER` steps and leaves cleanly;
- a second one joins at step `JOIN2`, counts for `KILL_AFTER` steps and is SIGKILLed.
Figures per implementation: `join_to_active_s` (asked to join -> its first counted step),
`core_step_median_s`, the slowest core step around the join, the leave and the kill (a core
step is the interval between two committed steps on core replica 0, so a failed and retried step
counts whole), `peak_rss_mb` (the sum of each process's peak RSS) and `exact_max_abs_diff` (final
parameters against libra's run of the same core with no joiner). The top-level
`exact_max_abs_diff` is libra's.

torchft runs with a lighthouse tuned for quick joins (join_timeout 100 ms against a default of
60 s; the heartbeat timeout stays at its default 5 s: 1 s made quorums churn on this loaded
machine, replicas dropping out and healing again), and `init_sync=False` (both cores start from
the same seeded weights; a step-0 sync heals one core and drops its share of that step).
Needs the `bench` extra's torchft (`pip install -e '.[bench]'`).
Run: .venv/bin/python benchmarks/bench_elastic.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, report  # noqa: E402

STEPS, JOIN1, LEAVE_AFTER, JOIN2, KILL_AFTER = 44, 4, 6, 24, 4
LIGHTHOUSE_START_S = 60.0  # the lighthouse reports its address once bound (well under a second)
JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS = 100, 5000  # torchft's lighthouse (defaults 60 s and 5 s)
TIMEOUT_S = 300.0


def spec(joins: list):
    from libra.runtime.elastic.local import RunSpec

    return RunSpec(core=2, slots=2, steps=STEPS, batch=8, min_len=16, max_len=64, hashes=False, joins=joins)


def run_libra(work: Path) -> tuple[dict, dict, dict]:
    from libra.runtime.elastic import KillPoint
    from libra.runtime.elastic.local import JoinSpec, run_local

    ref = run_local(spec([]), work / "ref")
    joins = [
        JoinSpec(slot=0, at_step=JOIN1, release_after=LEAVE_AFTER),
        JoinSpec(slot=1, at_step=JOIN2, kill_at=KillPoint.ACTIVE, kill_after=KILL_AFTER),
    ]
    res = run_local(spec(joins), work / "libra")
    rows = res.core[0].steps
    first = lambda state, slot: next(r for r in rows if r["elastic"]["states"][slot] == state)  # noqa: E731
    events = {
        "decided": res.joiners[0].decided,
        "active": first("ACTIVE", 0)["t1"],
        "leave": first("RELEASING", 0)["t0"],
        "kill": res.joiners[1].steps[-1]["t1"],
    }
    rss = [max(r.get("rss_mb", 0) for r in p.steps) for p in [*res.core, *res.joiners] if p.steps]
    return figures(rows, events, rss, res.final, ref.final), ref.final, last_status(rows)


def last_status(rows: list[dict]) -> dict:
    e = rows[-1]["elastic"]
    return {k: e[k] for k in ("joins", "releases", "rollbacks", "rejected")}


def run_torchft(work: Path, ref_final: dict) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.elastic_torchft import Role, lighthouse_main, replica_main
    from libra.runtime.elastic.local import forkserver

    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(spec([]).model_dump_json())
    ctx = forkserver()
    here, there = ctx.Pipe()
    lh = ctx.Process(
        target=lighthouse_main, args=(str(work), there, 2, JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS)
    )
    lh.start()
    address = _receive(here, lh, LIGHTHOUSE_START_S, f"the torchft lighthouse's address (its log: {work / 'tft-lighthouse.log'})")  # fmt: skip
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S)
    )
    roles = [
        Role("core0"), Role("core1"), Role("hybrid0", JOIN1, leave_after=LEAVE_AFTER),
        Role("hybrid1", JOIN2, kill_after=KILL_AFTER),
    ]  # fmt: skip
    procs = [
        ctx.Process(target=replica_main, args=(str(work), store.port, address, r, TIMEOUT_S)) for r in roles
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    here.send("stop")
    lh.join(timeout=30)
    if lh.exitcode is None:  # it did not stop when told: it is of no more use
        lh.kill()
        lh.join()
    logs = {r.name: _rows(work / f"tft-{r.name}.jsonl") for r in roles}
    h0, h1 = logs["hybrid0"], logs["hybrid1"]
    events = {
        "decided": h0[0]["decided"],
        "active": next(r["t0"] for r in h0[1:] if r["participating"] and r["committed"]),
        "leave": h0[-1]["t1"],
        "kill": h1[-1]["t1"],
    }
    core = [r for r in logs["core0"] if r["committed"]]
    rss = [max((r.get("rss_mb", 0) for r in rows[1:] if "rss_mb" in r), default=0) for rows in logs.values()]
    final = torch.load(work / "tft-final.pt", weights_only=True)
    out = figures(core, events, rss, final, ref_final)
    out["retried_steps"] = sum(1 for r in logs["core0"] if not r["committed"])
    return out


def _receive(conn, proc, timeout_s: float, what: str):
    """The next message on `conn` from `proc`, or an error naming `what` was awaited: when `proc`
    dies first (a child that failed to start, e.g. on `import torchft`), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"waiting for {what}: the process exited with code {proc.exitcode} before sending it")  # fmt: skip
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"waiting for {what}: nothing came within {timeout_s:g} s")
    return conn.recv()


def require(module: str, why: str) -> None:
    """A missing optional dependency is named at start, not found by a child that then dies."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        print(f"error: {why} needs {module!r}, which is not installed (the bench extra: pip install -e '.[bench]')", file=sys.stderr)  # fmt: skip
        sys.exit(2)


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # the cut last line of a SIGKILLed process
    return rows


def figures(core: list[dict], events: dict, rss: list[float], final: dict, ref: dict) -> dict:
    """Step times on core replica 0 (end to end between committed steps) around each event."""
    ends = [r["t1"] for r in core]
    steps = [(b, b - a) for a, b in zip(ends, ends[1:], strict=False)]
    after = lambda t, n: [d for end, d in steps if end >= t][:n]  # noqa: E731
    during_join = [d for end, d in steps if events["decided"] <= end <= events["active"]] + after(
        events["active"], 1
    )
    return {
        "join_to_active_s": round(events["active"] - events["decided"], 3),
        "core_step_median_s": round(statistics.median(d for _, d in steps), 4),
        "core_step_max_during_join_s": round(max(during_join), 4),
        "core_step_max_during_leave_s": round(max(after(events["leave"], 2)), 4),
        "core_step_max_during_kill_s": round(max(after(events["kill"], 3)), 4),
        "peak_rss_mb": round(sum(rss), 1),
        "exact_max_abs_diff": max(float((final[k] - ref[k]).abs().max()) for k in ref),
    }


def _median(runs: list[dict]) -> dict:
    """Per figure, the median over repeats (the largest for the exactness difference)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["exact_max_abs_diff"] = max(r["exact_max_abs_diff"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each; figures are medians")
    args = ap.parse_args()
    require("torchft", "bench_elastic.py (it runs torchft side by side with libra)")
    from libra.runtime.elastic.local import forkserver

    forkserver("torchft")  # both implementations' processes fork from one warm server
    runs: dict[str, list[dict]] = {"libra": [], "torchft": []}
    for i in range(max(1, args.repeats)):
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
            one, ref_final, counts = run_libra(Path(tmp))
            runs["libra"].append({**one, **counts})
            runs["torchft"].append(run_torchft(Path(tmp) / "torchft", ref_final))
        print(f"repeat {i + 1}: libra {runs['libra'][-1]}, torchft {runs['torchft'][-1]}", file=sys.stderr)
    libra, torchft = _median(runs["libra"]), _median(runs["torchft"])
    result = {
        "libra": {**libra, **counts}, "torchft": torchft, "exact_max_abs_diff": libra["exact_max_abs_diff"],
        "steps": STEPS, "repeats": len(runs["libra"]), "machine": machine(),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    keys = [k for k in libra if k != "exact_max_abs_diff"] + ["exact_max_abs_diff"]
    print(f"{'figure':32} {'libra':>12} {'torchft':>12}")
    for k in keys:
        print(f"{k:32} {libra[k]!s:>12} {torchft.get(k)!s:>12}")
    report("elastic", result)


if __name__ == "__main__":
    main()
