"""Partial rollouts (APRIL): when an over-provisioned step stops, and which groups it trains.

Why it is policy, beside the staleness gate it works with: the decisions (how many groups to keep
in flight, when a step's training batch is ready, which finished groups it trains) are the same
whatever carries them out, so the simulator uses this class and a live trainer can use the very
same object. Pure: no clock and no I/O; a group is any object under any hashable key.

- **Over-provisioning.** A step keeps `over_provision` times its target number of GRPO groups in
  flight (`room`): the groups carried over from earlier steps first (they resume where they
  stopped), then new ones, which the caller draws from the prompt stream (APRIL, arXiv
  2509.18521; a step may start prompts of the next batches).
- **Stop at the target.** The step's rollout ends once `target` groups have finished (`ready`);
  the caller aborts the rest, which keep their tokens (tagged with the weight version that wrote
  them) and resume in the next step.
- **The staleness bound.** A group is stamped with the weight version of its first submission, the
  oldest version any of its tokens can carry. APRIL bounds staleness by resuming carried groups
  first, so most finish in the next step, but a long one may be carried again. With a strict gate
  (`StalenessGate.strict`) the bound is exact: a step does not stop while an overdue group runs,
  and trains every finished overdue group even past its target (`StalenessGate.overdue`); the
  rest of its batch is the first groups to finish.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from libra.planner.staleness import Finished, StalenessGate

G = TypeVar("G")


@dataclass(slots=True)
class GroupInFlight(Generic[G]):
    version: int  # the weight version of its first submission: the oldest its tokens can be
    order: int = -1  # its place in finishing order (-1 while it runs)
    group: G | None = None


@dataclass(slots=True)
class PartialRollout(Generic[G]):
    """APRIL's policy on top of any pipeline: what to start, when a step is full, what it trains."""

    target: int
    over_provision: float
    gate: StalenessGate
    running: dict[Hashable, GroupInFlight[G]] = field(default_factory=dict)  # started, unfinished
    finished: dict[Hashable, GroupInFlight[G]] = field(default_factory=dict)  # finished, untrained
    carried_groups: int = 0  # groups a step stopped before they finished, over the run
    _order: int = 0

    @property
    def keep(self) -> int:
        return max(self.target, math.ceil(self.over_provision * self.target))

    def room(self) -> int:
        """New groups to start so that `keep` are in flight."""
        return max(0, self.keep - len(self.running))

    def started(self, key: Hashable, version: int) -> None:
        self.running[key] = GroupInFlight(version)

    def done(self, key: Hashable, group: G) -> None:
        g = self.running.pop(key)
        g.order, g.group = self._order, group
        self._order += 1
        self.finished[key] = g

    def ready(self, step: int) -> bool:
        """Whether step `step` may stop: its target has finished and no group it must train runs."""
        if len(self.finished) < self.target:
            return False
        return not any(self.gate.overdue(step, g.version) for g in self.running.values())

    def take(self, step: int) -> list[Finished[G]]:
        """The groups step `step` trains: every finished overdue one (a strict gate), then the
        first to finish, up to the target."""
        by_order = sorted(self.finished.items(), key=lambda kv: kv[1].order)
        must = [(k, g) for k, g in by_order if self.gate.overdue(step, g.version)]
        rest = [(k, g) for k, g in by_order if not self.gate.overdue(step, g.version)]
        chosen = must + rest[: max(0, self.target - len(must))]
        for k, _ in chosen:
            del self.finished[k]
        self.carried_groups += len(self.running)
        out: list[Finished[G]] = []
        for _, g in chosen:
            assert g.group is not None  # a finished group carries its members
            out.append(Finished(g.version, g.group))
        return out
