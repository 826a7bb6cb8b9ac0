"""The tail lane: as a batch drains, its stragglers get engines of their own.

Why: a trajectory's decode speed is its engine's iteration time, and that grows with everything
else the engine runs (the KV reads of the whole batch, per-sequence CPU work). While a batch
drains, its last trajectories share engines with the next batch's hundreds of fresh ones and
decode several times slower than they would alone, and the training step waits for their groups.
The tail lane reserves a few engines of the largest TP for them, so they decode at near batch-1
speed:

- **Who is a straggler.** A trajectory of a batch that has drained so far that all its running
  trajectories fit on the lanes (`lane_cap` each, on at most `max_share` of the engines of the
  largest TP). The policy counts each batch's trajectories from the turns it routes (every
  trajectory's first turn) and the trajectories that finish; it needs no clock.
- **The lanes.** While stragglers are running, `ceil(stragglers / lane_cap)` of those engines,
  the least loaded when a lane opens; a lane stays until no straggler needs it. Stragglers move
  there at their next turn (KV transfer or re-prefill, whichever the cost model prices lower),
  the lane with the fewest of them first.
- **The cost, carried out and measured by the mechanism.** Other trajectories do not start turns
  on a lane: those it held move out at their next turn (the same migration), and new work goes
  to the remaining engines, so the lane's capacity is lost to the rest of the batch while it is
  open.

A pure policy, like every router: `TailLane` wraps any router and changes only where turns go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from libra.rollout.base import (
    FinishedTrajectory,
    InstanceView,
    MigrationCoster,
    MigrationMethod,
    RouteDecision,
    Router,
    RouteRequest,
)
from libra.rollout.placement import migration_method


class TailConfig(BaseModel):
    """The scenario's `tail:` mapping (used by systems that run the tail lane)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)
    lane_cap: int = Field(8, ge=1, le=256, description="stragglers per lane engine")
    max_share: float = Field(0.25, gt=0, le=1, description="most of the largest-TP engines that may be lanes")


@dataclass(slots=True)
class TailStats:
    """What the lane did over a run: straggler turns it served, and other turns moved off a lane."""

    lane_turns: int = 0
    evictions: int = 0


@dataclass(slots=True)
class _Batch:
    members: dict[str, int] = field(default_factory=dict)  # prompt id -> trajectories started
    finished: dict[str, int] = field(default_factory=dict)  # prompt id -> trajectories finished
    done_groups: int = 0
    alive: int = 0  # trajectories started and not finished


class TailLane:
    """Wraps a router: stragglers to the lanes, everyone else to the other engines."""

    def __init__(self, inner: Router, config: TailConfig | None = None, cost: MigrationCoster | None = None,
                 stats: TailStats | None = None):  # fmt: skip
        self.inner, self.cfg, self.cost = inner, config or TailConfig(), cost
        self.stats = stats or TailStats()
        self.name = f"{inner.name}+tail"
        self.batches: dict[int, _Batch] = {}
        self.alive: dict[str, int] = {}  # trajectory -> its batch, while it runs
        self.lanes: list[str] = []
        self.room = 0  # stragglers the lanes can hold: lane_cap x the most lanes there may be

    @property
    def buckets(self):
        return self.inner.buckets

    @buckets.setter
    def buckets(self, value) -> None:
        self.inner.buckets = value

    # ---- who is a straggler ---------------------------------------------------------------------

    def _seen(self, req: RouteRequest) -> None:
        if req.turn == 0 and req.traj_id not in self.alive:
            b = self.batches.setdefault(req.step, _Batch())
            b.members[req.prompt_id] = b.members.get(req.prompt_id, 0) + 1
            b.alive += 1
            self.alive[req.traj_id] = req.step

    def stragglers(self) -> int:
        return sum(b.alive for b in self.batches.values() if 0 < b.alive <= self.room)

    def _draining(self, step: int) -> bool:
        b = self.batches.get(step)
        return b is not None and 0 < b.alive <= self.room

    # ---- the lanes --------------------------------------------------------------------------------

    def _lanes(self, instances: Sequence[InstanceView]) -> list[str]:
        """Open or close lanes for the stragglers running now; the ids of the open ones."""
        healthy = [i for i in instances if i.healthy]
        top = max((i.tp for i in healthy), default=0)
        pool = [i for i in healthy if i.tp == top]
        most = max(1, int(self.cfg.max_share * len(pool))) if len(pool) > 1 else 0  # leave the rest one
        self.room = most * self.cfg.lane_cap
        n = self.stragglers()
        if n == 0:
            self.lanes = []
            return self.lanes
        want = min(math.ceil(n / self.cfg.lane_cap), most)
        ids = {i.id for i in pool}
        self.lanes = [x for x in self.lanes if x in ids][:want]
        free = sorted((i for i in pool if i.id not in self.lanes), key=lambda i: (i.outstanding, i.id))
        self.lanes += [i.id for i in free[: want - len(self.lanes)]]
        return self.lanes

    def route(self, req: RouteRequest, instances: Sequence[InstanceView]) -> RouteDecision:
        self._seen(req)
        lanes = self._lanes(instances)
        if not lanes:
            return self.inner.route(req, instances)
        by_id = {i.id: i for i in instances}
        if self._draining(self.alive.get(req.traj_id, req.step)):
            return self._to_lane(req, instances, [by_id[x] for x in lanes])
        dec = self.inner.route(req, [i for i in instances if i.id not in lanes])
        if req.current_instance in lanes:  # moved off a lane: priced with the lane still visible
            self.stats.evictions += 1
            method = migration_method(
                self.cost, instances, req.current_instance, by_id[dec.instance], req.context_tokens
            )
            dec = RouteDecision(
                dec.bucket, dec.instance, True, method, dec.predicted_final_tokens, dec.target
            )
        return dec

    def _to_lane(
        self, req: RouteRequest, instances: Sequence[InstanceView], lanes: list[InstanceView]
    ) -> RouteDecision:
        """The inner router still decides (its learning and its scored choice stay its own); only
        the instance is the lane's."""
        dec = self.inner.route(req, instances)
        here = next((x for x in lanes if x.id == req.current_instance), None)
        lane = here or min(lanes, key=lambda x: (x.outstanding, x.id))
        self.stats.lane_turns += 1
        method = migration_method(self.cost, instances, req.current_instance, lane, req.context_tokens)
        moved = method != MigrationMethod.NONE
        return RouteDecision(lane.bucket, lane.id, moved, method, dec.predicted_final_tokens, dec.target)

    # ---- feedback -----------------------------------------------------------------------------------

    def on_finish(self, traj: FinishedTrajectory) -> None:
        step = self.alive.pop(traj.traj_id, traj.step)
        b = self.batches.get(step)
        if b is not None:
            n = b.finished[traj.prompt_id] = b.finished.get(traj.prompt_id, 0) + 1
            b.alive -= 1
            if n == b.members.get(traj.prompt_id, 0):
                b.done_groups += 1
            if b.alive == 0 and b.done_groups == len(b.members):
                del self.batches[step]
        self.inner.on_finish(traj)

    def on_step_end(self, step: int) -> None:
        self.inner.on_step_end(step)
