"""EARL's layout-aware data dispatch: per-sample tensors go from their producer to their trainer rank.

After rollout and reward, each sample has per-token tensors (old log-probabilities, advantages,
the loss mask) and a reward, made on the process that produced it. The trainer rank that will
train the sample is fixed by the training layout (`layout.balance_by_tokens`: token-balanced
over the ranks). Two ways to get them there, both over real torch.distributed gloo point-to-point
messages between real processes:
- `direct` (EARL): every producer sends each of its samples straight to the owning rank; the
  driver only decides the layout from the token counts it already has;
- `gather` (the baseline, a single controller): producers send everything to the driver, which
  scatters each sample to its rank, so every byte crosses the driver twice.
`run_dispatch` measures one dispatch of a batch: the bytes through the driver and the latency
from a common start to the last rank holding all of its samples, and returns what each rank got
(a checksum per sample) so a test can check every rank received exactly its samples.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from libra.runtime.layout import balance_by_tokens

MODES = ("direct", "gather")
FIELDS_PER_TOKEN = 3  # old log-probability, advantage, loss mask (as float32)
LAYOUT_BYTES_PER_SAMPLE = 8  # what the driver sends in either mode: a sample's owner and length


@dataclass(frozen=True, slots=True)
class Plan:
    tokens: tuple[int, ...]  # per sample
    producers: int
    ranks: int

    @property
    def shares(self) -> list[list[int]]:
        return balance_by_tokens(self.tokens, self.ranks)

    def producer_of(self, i: int) -> int:
        return i % self.producers

    # world: 0 the driver, 1..producers the producers, then the trainer ranks
    def producer_rank(self, p: int) -> int:
        return 1 + p

    def trainer_rank(self, r: int) -> int:
        return 1 + self.producers + r

    @property
    def world(self) -> int:
        return 1 + self.producers + self.ranks


@dataclass(frozen=True, slots=True)
class DispatchResult:
    mode: str
    driver_bytes: int
    latency_s: float  # median over repeats
    received: dict[int, dict[int, float]]  # trainer rank -> sample -> checksum


def sample_payload(i: int, tokens: int) -> torch.Tensor:
    """Sample i's packed tensors: [logprobs | advantages | mask] per token, then the reward."""
    g = torch.Generator().manual_seed(i)
    out = torch.empty(FIELDS_PER_TOKEN * tokens + 1)
    out[:tokens] = -torch.rand(tokens, generator=g)
    out[tokens : 2 * tokens] = torch.randn(tokens, generator=g)
    out[2 * tokens : 3 * tokens] = (torch.rand(tokens, generator=g) > 0.2).float()
    out[-1] = float(i % 2)
    return out


def checksum(t: torch.Tensor) -> float:
    return float(t.double().sum()) + float(t.numel())


def payload_bytes(tokens: int) -> int:
    return (FIELDS_PER_TOKEN * tokens + 1) * 4


def driver_bytes(plan: Plan, mode: str) -> int:
    """Bytes through the driver: the layout in both modes; in `gather` every payload, in and out."""
    through = 2 * sum(payload_bytes(t) for t in plan.tokens) if mode == "gather" else 0
    return through + LAYOUT_BYTES_PER_SAMPLE * len(plan.tokens)


def _dispatch(plan: Plan, mode: str, me: int) -> dict[int, float] | None:
    """This process's part of one dispatch; a trainer rank returns its samples' checksums."""
    works, bufs = [], {}
    owner = {i: r for r, share in enumerate(plan.shares) for i in share}
    if 1 <= me <= plan.producers:  # a producer
        for i, t in enumerate(plan.tokens):
            if plan.producer_of(i) == me - 1:
                dst = plan.trainer_rank(owner[i]) if mode == "direct" else 0
                works.append(dist.isend(sample_payload(i, t), dst, tag=i))
    elif me == 0 and mode == "gather":  # the single controller: everything in, then out
        for i, t in enumerate(plan.tokens):
            bufs[i] = torch.empty(FIELDS_PER_TOKEN * t + 1)
            works.append(dist.irecv(bufs[i], plan.producer_rank(plan.producer_of(i)), tag=i))
        for w in works:
            w.wait()
        works = [dist.isend(bufs[i], plan.trainer_rank(owner[i]), tag=i) for i in range(len(plan.tokens))]
    elif me > plan.producers:  # a trainer rank
        for i in plan.shares[me - 1 - plan.producers]:
            bufs[i] = torch.empty(FIELDS_PER_TOKEN * plan.tokens[i] + 1)
            src = plan.producer_rank(plan.producer_of(i)) if mode == "direct" else 0
            works.append(dist.irecv(bufs[i], src, tag=i))
    for w in works:
        w.wait()
    return {i: checksum(b) for i, b in bufs.items()} if me > plan.producers else None


def member_main(workdir: str, port: int, me: int, plan: Plan, modes: tuple[str, ...], repeats: int) -> None:
    """One process of a dispatch run: join the gloo world, then for each mode and repeat, a
    barrier, one dispatch, and (trainer ranks) the time it finished and what arrived."""
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    dist.init_process_group(
        "gloo", store=store, rank=me, world_size=plan.world, timeout=timedelta(seconds=300)
    )
    rows = []
    for mode in modes:
        for rep in range(repeats):
            dist.barrier()
            t0 = time.time()
            got = _dispatch(plan, mode, me)
            rows.append({"mode": mode, "repeat": rep, "t0": t0, "t1": time.time(), "got": got})
    dist.barrier()
    dist.destroy_process_group()
    Path(workdir, f"dispatch-{me}.json").write_text(json.dumps(rows))


def run_dispatch(
    plan: Plan, workdir: Path, modes: tuple[str, ...] = MODES, repeats: int = 1
) -> list[DispatchResult]:
    """One gloo world of driver, producers and trainer ranks (forked processes); each mode measured."""
    from libra.runtime.elastic.local import forkserver

    workdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    procs = [
        forkserver().Process(target=member_main, args=(str(workdir), store.port, m, plan, modes, repeats))
        for m in range(plan.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode is None:
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"dispatch processes failed: exit codes {[p.exitcode for p in procs]}")
    rows = [json.loads(Path(workdir, f"dispatch-{m}.json").read_text()) for m in range(plan.world)]
    return [_result(plan, mode, rows, repeats) for mode in modes]


def _result(plan: Plan, mode: str, rows: list[list[dict]], repeats: int) -> DispatchResult:
    latencies = []
    for rep in range(repeats):
        mine = [next(r for r in member if r["mode"] == mode and r["repeat"] == rep) for member in rows]
        latencies.append(max(r["t1"] for r in mine) - min(r["t0"] for r in mine))
    last = [
        next(r for r in rows[m] if r["mode"] == mode and r["repeat"] == repeats - 1)
        for m in range(plan.world)
    ]
    received = {
        r: {int(k): v for k, v in last[plan.trainer_rank(r)]["got"].items()} for r in range(plan.ranks)
    }
    return DispatchResult(mode, driver_bytes(plan, mode), statistics.median(latencies), received)
