"""The torchft side of `bench_elastic.py`: the same model, data, optimizer and loop, on torchft.

Each replica is one process and its own torchft replica group (group world size 1): a TCPStore,
a `torchft.ProcessGroupGloo` that the Manager reconfigures at each new quorum, a Manager talking
to one Lighthouse, and torchft's `OptimizerWrapper` (`zero_grad` starts the quorum, `step` asks
`should_commit`). Gradients are one flat tensor summed with `manager.allreduce(..., SUM)`; the
step's samples are laid out over the quorum's participants by the same token-balanced layout,
with the step index taken from `manager.current_step()`, so a step that fails to commit is
retried on the same data and the run stays comparable with libra's to float rounding.

A joining replica is healed by torchft itself: the quorum marks it behind, it fetches a peer's
state dict over torchft's HTTP transport and contributes zeros for that step. A leaving one shuts
its Manager down; a killed one is SIGKILLed, as in libra's run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

STEP_KEY = "elastic/step"


@dataclass(frozen=True, slots=True)
class Role:
    name: str  # replica id: core0, core1, hybrid0, ...
    at_step: int = -1  # a joiner: join when core0 has committed this step
    leave_after: int = 0  # leave cleanly after this many participating steps (0: never)
    kill_after: int = 0  # SIGKILL itself after this many participating steps (0: never)


def replica_main(workdir: str, store_port: int, lighthouse: str, role: Role, timeout_s: float) -> None:
    log = os.open(Path(workdir) / f"tft-{role.name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    with open(Path(workdir) / f"tft-{role.name}.jsonl", "w") as out:
        _run(Path(workdir), store_port, lighthouse, role, timeout_s, out)
    sys.exit(0)


def _run(workdir: Path, store_port: int, lighthouse: str, role: Role, timeout_s: float, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from libra.runtime.elastic.reducer import flat_grads, set_grads, trainable
    from libra.runtime.elastic.spec import RunSpec, wait_step
    from libra.runtime.elastic.worker import _setup, peak_rss_mb
    from libra.runtime.layout import balance_by_tokens

    spec = RunSpec.model_validate_json((workdir / "spec.json").read_text())
    joiner = role.at_step >= 0
    model, inner, work = _setup(spec, spec.seed + (1000 if joiner else 0))
    shared = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    if joiner:
        wait_step(shared, role.at_step, lambda: False, time.monotonic() + timeout_s)
        _line(out, {"decided": time.time()})
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=spec.core,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=role.name, store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=timeout_s),
        connect_timeout=timedelta(seconds=10),
        init_sync=False,  # identical seeded init; a step-0 sync would heal one core and drop its samples
    )  # fmt: skip
    optimizer, params, counted = OptimizerWrapper(manager, inner), trainable(model), 0
    while manager.current_step() < spec.steps:
        t0 = time.time()
        optimizer.zero_grad()
        rank, n, step = manager.participating_rank(), manager.num_participants(), manager.current_step()
        if rank is not None:
            work.backward(model, step, balance_by_tokens(work.tokens(step), n)[rank])
        buf = flat_grads(params)
        manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
        set_grads(params, buf)
        optimizer.step()
        committed = manager.current_step() > step
        row = {
            "step": step,
            "t0": t0,
            "t1": time.time(),
            "committed": committed,
            "participating": rank is not None,
        }
        _line(out, {**row, "participants": n, "rss_mb": peak_rss_mb()})
        if role.name == "core0" and committed:
            shared.set(STEP_KEY, str(step))
        counted += int(committed and rank is not None and joiner)
        if role.kill_after and counted >= role.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if role.leave_after and counted >= role.leave_after:
            break
    if role.name == "core0":
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, workdir / "tft-final.pt")
    manager.shutdown(wait=False)


def lighthouse_main(
    workdir: str, conn, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int
) -> None:
    """The lighthouse in a process of its own, its (verbose) log in WORKDIR/tft-lighthouse.log."""
    log = os.open(Path(workdir) / "tft-lighthouse.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )  # fmt: skip
    conn.send(server.address())
    conn.recv()  # until the parent says stop
    server.shutdown()


def _line(out, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()
