"""The planner's re-plans, carried out on the live fleet: engines change bucket, boundaries move.

The fleet planner (`libra.planner.fleet`, pure) decides how many engines serve each bucket and
where the boundaries lie; this module moves them, in the background so training never waits:

- the new boundaries go to the gateway (`POST /admin/buckets`): router thresholds, nothing restarts;
- each engine that changes bucket is drained (no new turns; its sessions move on their next turn;
  what it serves finishes), removed, and added again under its new bucket. The built-in engine is
  one process on one core whatever its TP label, so it moves without a restart (on GPUs an engine
  of another TP would be restarted by the launcher in between; the built-in engine needs none).

Engines that are the elastic pool's hybrid slots never move (their slot returns them to their own
bucket). A re-plan that would need one, or that arrives while the last is still being carried out,
is not carried out, and the step record says why. `plan` is the layout the gateway serves now,
which the controller compares candidates with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from libra.planner import Plan, Replan
from libra.runtime.train import cluster as procs
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.gateway_admin import AdminFailed, GatewayAdmin
from libra.runtime.train.planning import fleet_plan, initial_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Move:
    engine: str
    src: str  # bucket names
    dst: str


class CannotMove(RuntimeError):
    """The decided layout needs an engine this fleet may not move."""


def moves(where: dict[str, str], names: list[str], want: list[int], fixed: Iterable[str] = ()) -> list[Move]:
    """The fewest engine moves that give bucket `names[k]` `want[k]` engines: surplus buckets give
    their last movable engines to buckets short of engines, in bucket order. `where`: engine ->
    its bucket now; `fixed`: engines that must stay."""
    pinned = set(fixed)
    have = {n: [e for e, b in where.items() if b == n] for n in names}
    give = {n: len(have[n]) - w for n, w in zip(names, want, strict=True)}
    out, takers = [], [n for n in names for _ in range(max(0, -give[n]))]
    for n in names:
        free = [e for e in have[n] if e not in pinned]
        if give[n] > len(free):
            raise CannotMove(f"bucket {n!r} must give {give[n]} engines but only {free} may move")
        out += [Move(e, n, takers.pop(0)) for e in free[len(free) - max(0, give[n]) :]]
    return out


@dataclass(slots=True)
class FleetCounts:
    replans: int = 0  # re-plans carried out
    moved: int = 0  # engines moved between buckets
    events: list[str] = field(default_factory=list)  # since the last step record


class LiveFleet:
    def __init__(
        self, cfg: TrainConfig, cluster: procs.Cluster, admin: GatewayAdmin, fixed: Iterable[str] = ()
    ):
        self.cfg, self.cluster, self.admin, self.fixed = cfg, cluster, admin, set(fixed)
        self.plan: Plan = initial_plan(cfg)
        self.names = [b.name for b in cfg.buckets]
        # Engine -> the bucket it serves (or returns to, for a lent hybrid slot). Only this module
        # moves engines between buckets, so this is the fleet's layout.
        self.where = {procs.engine_name(b.name, i): b.name for b in cfg.buckets for i in range(b.instances)}
        self.counts = FleetCounts()
        self.task: asyncio.Task | None = None

    def carry_out(self, replan: Replan | None) -> None:
        if replan is None:
            return
        if self.task is not None and not self.task.done():
            self._event("re-plan not carried out: the last one is still being carried out")
            return
        self.task = asyncio.create_task(self._apply(replan.plan), name="re-plan")

    async def _apply(self, plan: Plan) -> None:
        before = self.plan.boundaries
        try:
            todo = moves(self.where, self.names, [b.instances for b in plan.buckets], self.fixed)
        except CannotMove as e:
            self._event(f"re-plan not carried out: {e}")
            return
        try:
            if plan.boundaries != self.plan.boundaries:
                await self.admin.retune(dict(zip(self.names, plan.boundaries, strict=True)))
                self._event(f"boundaries {list(self.plan.boundaries)} -> {list(plan.boundaries)}")
                self.plan = fleet_plan(
                    self.cfg, [b.instances for b in self.plan.buckets], list(plan.boundaries)
                )
            for m in todo:
                await self._move(m)
        except AdminFailed as e:
            self._event(f"re-plan stopped: {e}")
            self.plan = self._serving()
            return
        if todo or plan.boundaries != before:  # a re-plan that changes nothing is not counted
            self.counts.replans += 1
        self.plan = plan

    async def _move(self, m: Move) -> None:
        proc = next((p for p in self.cluster.of("engine") if p.handle.name == m.engine), None)
        if proc is None:
            raise AdminFailed(f"{m.engine} is not running")
        await self.admin.drain_and_remove(m.engine, self.cfg.elastic.drain_timeout_s)
        try:
            await self.admin.add({"url": proc.url, "bucket": m.dst, "name": m.engine})
        except AdminFailed:
            await self.admin.add({"url": proc.url, "bucket": m.src, "name": m.engine})  # back where it was
            raise
        proc.bucket = self.where[m.engine] = m.dst
        self.counts.moved += 1
        self._event(f"{m.engine}: {m.src} -> {m.dst}")

    def _serving(self) -> Plan:
        """After a partial re-plan: the new boundaries, if they were set, with the engines where
        they are now."""
        counts = [sum(1 for b in self.where.values() if b == n) for n in self.names]
        return fleet_plan(self.cfg, counts, list(self.plan.boundaries))

    def record(self) -> dict:
        c, events = self.counts, self.counts.events
        self.counts.events = []
        return {"replans": c.replans, "moved": c.moved, "buckets": self.layout(), "events": events}

    def layout(self) -> list[dict]:
        return [{"name": n, "max_context": top, "engines": sorted(e for e, b in self.where.items() if b == n)}
                for n, top in zip(self.names, self.plan.boundaries, strict=True)]  # fmt: skip

    def _event(self, what: str) -> None:
        log.info("fleet: %s", what)
        self.counts.events.append(what)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
