"""An elastic data-parallel run on local processes: fixed core replicas, hybrid joiners on demand.

What the tests and `benchmarks/bench_elastic.py` run: the parent starts a TCPStore on an
ephemeral port, `core` replica processes (one gloo group, the built-in model, AdamW, the
synthetic workload) and, when the core has finished a given step, a joiner process for a hybrid
slot, with faults injected as the spec says. Each process appends one JSON line per step (the
step's wall time, its duration and a hash of the parameters after the step), so a killed process
still leaves its record, and every core replica saves its final parameters.

Processes are forked from a forkserver that has imported torch once, so a run costs its steps
rather than a torch import per process (seconds each on a loaded two-core machine); they are
ordinary OS processes all the same (own memory, own sockets, killed by a real SIGKILL).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from libra.runtime.elastic.spec import JoinSpec, RunSpec, wait_step

__all__ = ["JoinSpec", "ProcessRecord", "RunResult", "RunSpec", "forkserver", "run_local"]


@dataclass(slots=True)
class ProcessRecord:
    role: str
    index: int
    returncode: int | None
    steps: list[dict] = field(default_factory=list)
    outcome: str | None = None
    started: float = 0.0  # wall time the parent started it
    decided: float = 0.0  # a joiner: wall time it was asked to join (its process was up or started)

    def hashes(self) -> dict[int, str]:
        return {r["step"]: r["hash"] for r in self.steps if "hash" in r}


@dataclass(slots=True)
class RunResult:
    core: list[ProcessRecord]
    joiners: list[ProcessRecord]
    final: dict[str, torch.Tensor]  # rank 0's parameters after the last step
    workdir: Path


def run_local(spec: RunSpec, workdir: Path) -> RunResult:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(spec.model_dump_json())
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout_s)
    )
    deadline = time.monotonic() + spec.timeout_s
    core = [_start(workdir, store.port, "core", r) for r in range(spec.core)]
    joiners = [
        (_start(workdir, store.port, "joiner", i), time.time())
        for i, j in enumerate(spec.joins)
        if j.prestart
    ]
    try:
        for i, js in enumerate(spec.joins):
            if js.prestart:
                continue
            if not wait_step(store, js.at_step, lambda: any(p.exitcode is not None for p in core), deadline):
                break
            joiners.append((_start(workdir, store.port, "joiner", i), time.time()))
        for p in core:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for p, _ in joiners:
            p.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    finally:
        for p in [*core, *(j for j, _ in joiners)]:
            if p.exitcode is None:
                p.kill()  # a joiner the core has left behind would wait forever; a hung run likewise
                p.join()
    return RunResult(
        [_record(workdir, "core", r, p.exitcode) for r, p in enumerate(core)],
        sorted(
            (_record(workdir, "joiner", i, p.exitcode, t) for i, (p, t) in _by_index(spec, joiners)),
            key=lambda r: r.index,
        ),
        torch.load(workdir / "final-0.pt", weights_only=True) if (workdir / "final-0.pt").exists() else {},
        workdir,
    )


def _by_index(spec: RunSpec, started: list[tuple[mp.process.BaseProcess, float]]) -> list[tuple[int, tuple]]:
    """Joiner processes by their index in `spec.joins` (prestarted ones were started first)."""
    order = [i for i, j in enumerate(spec.joins) if j.prestart] + [
        i for i, j in enumerate(spec.joins) if not j.prestart
    ]
    return list(zip(order, started, strict=False))


_CONTEXT: mp.context.ForkServerContext | None = None


def forkserver(*extra: str) -> mp.context.ForkServerContext:
    """The process context of local runs; `extra` modules are preloaded too (before its first use)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # torch.optim imports torch._dynamo (and sympy) the first time an optimizer is built:
        # seconds per process, paid once here instead.
        _CONTEXT.set_forkserver_preload(["libra.runtime.elastic.worker", "torch._dynamo", *extra])
    return _CONTEXT


def _start(workdir: Path, port: int, role: str, index: int) -> mp.process.BaseProcess:
    from libra.runtime.elastic.worker import process_main  # torch: only where processes start

    p = forkserver().Process(
        target=process_main, args=(str(workdir), port, role, index), name=f"{role}-{index}"
    )
    p.start()
    return p


def _record(workdir: Path, role: str, index: int, rc: int | None, started: float = 0.0) -> ProcessRecord:
    rec = ProcessRecord(role, index, rc, started=started)
    path = workdir / f"{role}-{index}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a SIGKILLed process may be cut
            if "outcome" in row:
                rec.outcome = row["outcome"]
            elif "decided" in row:
                rec.decided = row["decided"]
            else:
                rec.steps.append(row)
    return rec
