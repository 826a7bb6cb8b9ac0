"""The tail lane: as a batch drains, its stragglers get engines of their own.

Why: a trajectory's decode speed is its engine's iteration time, and that grows with everything
else the engine runs (the KV reads of the whole batch, per-sequence CPU work). While a batch
drains, its last trajectories share engines with the next batch's hundreds of fresh ones and
decode several times slower than they would alone, and the training step waits for their groups.
The tail lane reserves a few engines of the largest TP for them, so they decode at near batch-1
speed:

- **Who is a straggler.** A trajectory whose context has passed `long_quantile` of the final
  lengths of recently finished trajectories (agent lengths are heavy-tailed: one that is long so
  far has a long way to go), or one left in a batch that has drained so far that its running
  trajectories fit on the lanes. Admitted while the lanes have room (`lane_cap` each, on at most
  `max_share` of the engines of the largest TP), it stays on a lane until it finishes. The policy
  counts each batch's trajectories from the turns it routes and the trajectories that finish; it
  needs no clock.
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

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
    long_quantile: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a trajectory whose context passes this quantile of recent final lengths is a straggler (1: only a draining batch's)",
    )
    window: int = Field(
        512, ge=16, le=1 << 16, description="recent finished trajectories the quantile is taken over"
    )


@dataclass(slots=True)
class TailStats:
    """What the lane did over a run: straggler turns it served, and other turns moved off a lane."""

    lane_turns: int = 0
    evictions: int = 0


@dataclass(slots=True)
class _Batch:
    started: int = 0
    alive: int = 0  # trajectories started and not finished

    def draining(self, room: int) -> bool:
        """Some of it finished and what runs fits the lanes (a batch just starting is not draining)."""
        return 0 < self.alive <= room and self.alive < self.started


class TailLane:
    """Wraps a router: stragglers to the lanes, everyone else to the other engines."""

    def __init__(self, inner: Router, config: TailConfig | None = None, cost: MigrationCoster | None = None,
                 stats: TailStats | None = None):  # fmt: skip
        self.inner, self.cfg, self.cost = inner, config or TailConfig(), cost
        self.stats = stats or TailStats()
        self.name = f"{inner.name}+tail"
        self.batches: dict[int, _Batch] = {}
        self.alive: dict[str, int] = {}  # trajectory -> its batch, while it runs
        self.members: set[str] = set()  # stragglers admitted to the lanes (until they finish)
        self.lanes: list[str] = []
        self.room = 0  # stragglers the lanes can hold: lane_cap x the most lanes there may be
        self.finals: deque[int] = deque(maxlen=self.cfg.window)
        self.long: float = math.inf  # the context from which a trajectory counts as long
        self._since_refit = 0

    @property
    def buckets(self):
        return self.inner.buckets

    def retune(self, buckets) -> None:
        self.inner.retune(buckets)

    # ---- who is a straggler ---------------------------------------------------------------------

    def _seen(self, req: RouteRequest) -> None:
        if req.turn == 0 and req.traj_id not in self.alive:
            b = self.batches.setdefault(req.step, _Batch())
            b.started += 1
            b.alive += 1
            self.alive[req.traj_id] = req.step

    def _straggler(self, req: RouteRequest) -> bool:
        """Already on a lane, or newly one: long for its context, or left in a draining batch."""
        if req.traj_id in self.members:
            return True
        if len(self.members) >= self.room:
            return False
        b = self.batches.get(self.alive.get(req.traj_id, req.step))
        if req.context_tokens >= self.long or (b is not None and b.draining(self.room)):
            self.members.add(req.traj_id)
            return True
        return False

    # ---- the lanes --------------------------------------------------------------------------------

    def _lanes(self, instances: Sequence[InstanceView]) -> list[str]:
        """Open or close lanes for the stragglers admitted now; the ids of the open ones."""
        healthy = [i for i in instances if i.healthy]
        top = max((i.tp for i in healthy), default=0)
        pool = [i for i in healthy if i.tp == top]
        most = max(1, int(self.cfg.max_share * len(pool))) if len(pool) > 1 else 0  # leave the rest one
        self.room = most * self.cfg.lane_cap
        want = min(math.ceil(len(self.members) / self.cfg.lane_cap), most)
        ids = {i.id for i in pool}
        self.lanes = [x for x in self.lanes if x in ids][:want]
        free = sorted((i for i in pool if i.id not in self.lanes), key=lambda i: (i.outstanding, i.id))
        self.lanes += [i.id for i in free[: want - len(self.lanes)]]
        return self.lanes

    def route(self, req: RouteRequest, instances: Sequence[InstanceView]) -> RouteDecision:
        self._seen(req)
        self._lanes(instances)  # sets the room a new straggler is admitted against
        straggler = self._straggler(req)
        lanes = self._lanes(instances)
        if not lanes:
            return self.inner.route(req, instances)
        by_id = {i.id: i for i in instances}
        if straggler:
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
        self.members.discard(traj.traj_id)
        b = self.batches.get(step)
        if b is not None:
            b.alive -= 1
            if b.alive <= 0:
                del self.batches[step]
        self._learn(traj.final_tokens)
        self.inner.on_finish(traj)

    def _learn(self, final: int) -> None:
        """Recent final lengths; the long threshold is refit every eighth of the window."""
        self.finals.append(final)
        self._since_refit += 1
        if self.cfg.long_quantile < 1 and self._since_refit * 8 >= self.cfg.window:
            self._since_refit = 0
            ranked = sorted(self.finals)
            self.long = ranked[min(len(ranked) - 1, int(self.cfg.long_quantile * len(ranked)))]

    def on_step_end(self, step: int) -> None:
        self.inner.on_step_end(step)
