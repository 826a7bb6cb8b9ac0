"""Partial rollouts (APRIL): an over-provisioned step that stops at its target, and groups carried over.

Why its own module: the mechanism is not the system. APRIL (arXiv 2509.18521) runs it on slime's
synchronous pipeline, and any system (Libra's planner included) may choose it, so the bookkeeping
lives here and the pipeline only asks three questions: which groups to start, whether the step's
training batch is ready, and which groups it trains.

- **Over-provisioning.** A step keeps `over_provision` times its target number of GRPO groups in
  flight: the groups carried over from earlier steps first (they resume where they stopped), then
  new groups drawn from the prompt stream (the batches in order, as a data loader would serve
  them; a step may start prompts of the next batches).
- **Stop at the target.** The step's rollout ends once `target` groups have finished, and the
  pipeline aborts the rest (`RolloutDriver.interrupt`): each keeps the tokens it wrote, tagged with
  the weight version that wrote them, and resumes in the next step (it prefills its context again,
  its KV having been dropped for training).
- **The staleness bound.** A group is stamped with the weight version of its first submission,
  the oldest version any of its tokens can carry. APRIL bounds staleness by resuming carried
  groups first, so most finish in the next step, but a long one may be carried again. With
  `pipeline.strict_staleness` the bound is exact: a group trained at step s must have its stamp
  >= s - k (k = `pipeline.staleness`), so the step does not stop while a group stamped s - k or
  older is still running, and trains every finished group stamped that old even past the target
  (`StalenessGate.overdue`); the rest of the batch is the first groups to finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from libra.core.trajectory import Trajectory
from libra.planner.staleness import Finished, StalenessGate

GroupKey = tuple[int, str]  # (batch, prompt id)


@dataclass(slots=True)
class GroupInFlight:
    version: int  # the weight version of its first submission: the oldest its tokens can be
    order: int  # when it finished, in finishing order (-1 while it runs)
    members: list[Trajectory] = field(default_factory=list)


class GroupStream:
    """The prompt stream: every batch's GRPO groups in order (first appearance in the batch)."""

    def __init__(self, batch_of):
        self._batch_of = batch_of
        self._batches: Iterator[tuple[GroupKey, list[Trajectory]]] = self._groups()

    def _groups(self) -> Iterator[tuple[GroupKey, list[Trajectory]]]:
        b = 0
        while True:
            groups: dict[str, list[Trajectory]] = {}
            for t in self._batch_of(b):
                groups.setdefault(t.prompt_id, []).append(t)
            for pid, members in groups.items():
                yield (b, pid), members
            b += 1

    def next(self) -> tuple[GroupKey, list[Trajectory]]:
        return next(self._batches)


class PartialRollout:
    """APRIL's policy on top of any pipeline: what to start, when a step is full, what it trains."""

    def __init__(self, stream: GroupStream, target: int, over_provision: float, gate: StalenessGate):
        self.stream, self.target, self.gate = stream, target, gate
        self.keep = max(target, math.ceil(over_provision * target))
        self.running: dict[GroupKey, GroupInFlight] = {}  # started and not finished, carried included
        self.finished: dict[GroupKey, GroupInFlight] = {}  # finished and not trained yet
        self._order = 0
        self.carried_groups = 0  # groups a step stopped before they finished (over the run)

    def to_start(self, version: int) -> list[tuple[GroupKey, list[Trajectory]]]:
        """New groups to start so that `keep` groups are in flight, each stamped `version`."""
        out = []
        while len(self.running) < self.keep:
            key, members = self.stream.next()
            self.running[key] = GroupInFlight(version, -1)
            out.append((key, members))
        return out

    def done(self, key: GroupKey, members: list[Trajectory]) -> None:
        g = self.running.pop(key)
        g.order, g.members = self._order, members
        self._order += 1
        self.finished[key] = g

    def version_of(self, key: GroupKey) -> int:
        g = self.running.get(key) or self.finished[key]
        return g.version

    def ready(self, step: int) -> bool:
        """Whether step `step` may stop: its target has finished and no group it must train runs."""
        if len(self.finished) < self.target:
            return False
        return not any(self.gate.overdue(step, g.version) for g in self.running.values())

    def take(self, step: int) -> list[Finished[list[Trajectory]]]:
        """The groups step `step` trains: every finished overdue one (a strict gate), then the
        first to finish, up to the target."""
        by_order = sorted(self.finished.items(), key=lambda kv: kv[1].order)
        must = [(k, g) for k, g in by_order if self.gate.overdue(step, g.version)]
        rest = [(k, g) for k, g in by_order if not self.gate.overdue(step, g.version)]
        chosen = must + rest[: max(0, self.target - len(must))]
        for k, _ in chosen:
            del self.finished[k]
        self.carried_groups += len(self.running)
        return [Finished(g.version, g.members) for _, g in chosen]
