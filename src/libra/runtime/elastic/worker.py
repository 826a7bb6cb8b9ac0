"""Entry point of one process of a local elastic run (`local.run_local` starts it).

`process_main` (forked by `local.run_local`), or by hand
`python -m libra.runtime.elastic.worker WORKDIR STORE_PORT core|joiner INDEX`: a core replica
(rank INDEX of the fixed gloo group) or the joiner of `spec.joins[INDEX]`. The training loop of a
core replica is the one `libra train` runs: this rank's samples of the layout, backward with the
loss over the global token count, `reducer.reduce(model)`, the optimizer's step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from libra.planner import JoinState
from libra.runtime.elastic.joiner import Faults, Joiner, default_update
from libra.runtime.elastic.reducer import ElasticReducer
from libra.runtime.elastic.spec import STEP_KEY, JoinSpec, RunSpec, ready_key, wait_step
from libra.runtime.elastic.wire import Kind
from libra.runtime.elastic.workload import SyntheticLM
from libra.runtime.engine.config import PRESETS
from libra.runtime.engine.model import TinyTransformer


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _setup(spec: RunSpec, seed: int) -> tuple[TinyTransformer, torch.optim.Optimizer, SyntheticLM]:
    torch.set_num_threads(1)
    model = TinyTransformer(PRESETS[spec.preset], seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    work = SyntheticLM(model.preset.vocab_size, spec.batch, spec.min_len, spec.max_len, spec.seed)
    return model, optimizer, work


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _line(out: IO[str], row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def run_core(spec: RunSpec, store: dist.Store, rank: int, out: IO[str], workdir: Path) -> None:
    model, optimizer, work = _setup(spec, spec.seed)
    timeout = timedelta(seconds=spec.timeout_s)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("core", store), rank=rank, world_size=spec.core, timeout=timeout
    )
    reducer = ElasticReducer(
        model, optimizer, rank=rank, core=spec.core, slots=spec.slots, store=store,
        recompute=lambda idx: work.backward(model, reducer.step, idx), config=spec.runtime,
    )  # fmt: skip
    active_for, seen = [0] * spec.slots, set()
    # Prestarted joiners are up before step 0, as trainers already started in drained engines'
    # slots would be: a join's timing then does not depend on how long a process takes to start.
    store.wait([ready_key(i) for i, j in enumerate(spec.joins) if j.prestart], timeout)
    for step in range(spec.steps):
        t0 = time.time()
        work.backward(model, step, reducer.begin_step(step, work.tokens(step)))
        reducer.reduce(model)
        default_update(model, optimizer)
        time.sleep(max(0.0, spec.step_min_s - (time.time() - t0)))
        row = {
            "step": step,
            "t0": t0,
            "t1": time.time(),
            "elastic": reducer.status.to_json(),
            "rss_mb": peak_rss_mb(),
        }
        if spec.hashes:
            row["hash"] = param_hash(model)
        _line(out, row)
        if rank == 0:
            store.set(STEP_KEY, str(step))
            _release_rule(spec, reducer, active_for, seen)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, workdir / f"final-{rank}.pt")
    reducer.close()
    dist.destroy_process_group()
    _line(out, {"outcome": "finished"})


def _release_rule(spec: RunSpec, reducer: ElasticReducer, active_for: list[int], seen: set[int]) -> None:
    """Rank 0 asks for a slot's release once it has counted for its spec's number of steps.

    One membership change at a time: while another slot of the run has yet to become ACTIVE, a
    slot's count waits, so a run that asks for two joins sees both count together however long
    the second takes on a loaded machine."""
    after = {j.slot: j.release_after for j in spec.joins if j.release_after}
    states = reducer.status.states
    seen |= {slot for slot, state in enumerate(states) if state == JoinState.ACTIVE}
    for slot, state in enumerate(states):
        waiting = {j.slot for j in spec.joins} - seen - {slot}
        if state == JoinState.ACTIVE and not waiting:
            active_for[slot] += 1
        elif state != JoinState.ACTIVE:
            active_for[slot] = 0
        if after.get(slot) and active_for[slot] == after[slot]:
            reducer.request_release(slot)


def run_joiner(spec: RunSpec, store: dist.Store, index: int, out: IO[str]) -> None:
    js: JoinSpec = spec.joins[index]
    model, optimizer, work = _setup(
        spec, spec.seed + 1000 + js.slot
    )  # its own init: the snapshot must replace it
    faults = Faults(
        kill_at=js.kill_at, after=js.kill_after, delay_s={Kind[k]: v for k, v in js.delay_s.items()},
        delay_times=js.delay_times, duplicate=frozenset(Kind[k] for k in js.duplicate),
    )  # fmt: skip

    if js.prestart:
        store.set(ready_key(index), "1")

    def on_step(step: int) -> None:
        row = {"step": step, "t1": time.time(), "rss_mb": peak_rss_mb()}
        if spec.hashes:
            row["hash"] = param_hash(model)
        _line(out, row)

    if js.prestart and not wait_step(store, js.at_step, lambda: False, time.monotonic() + spec.timeout_s):
        _line(out, {"outcome": "never asked"})
        return
    _line(out, {"decided": time.time()})
    joiner = Joiner(
        js.slot, spec.core, spec.slots, model, optimizer, work, store,
        config=spec.runtime, faults=faults, on_step=on_step,
    )  # fmt: skip
    _line(out, {"outcome": joiner.run()})


def process_main(workdir: str, port: int, role: str, index: int) -> None:
    """A forked process's body: its output goes to WORKDIR/ROLE-INDEX.log, its exit code is main's."""
    log = os.open(Path(workdir) / f"{role}-{index}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.exit(main([workdir, str(port), role, str(index)]))


def main(argv: list[str]) -> int:
    workdir, port, role, index = Path(argv[0]), int(argv[1]), argv[2], int(argv[3])
    spec = RunSpec.model_validate_json((workdir / "spec.json").read_text())
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout_s)
    )
    with open(workdir / f"{role}-{index}.jsonl", "w") as out:
        if role == "core":
            run_core(spec, store, index, out, workdir)
        else:
            run_joiner(spec, store, index, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
