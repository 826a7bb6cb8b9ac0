"""APRIL's over-provisioned partial rollouts, live: `pipeline.mode: colocated-partial`.

Why a subclass of `Rollouts`: the mechanics of a group (run whole through the gateway, replaced
when a member is dropped, every drop counted) stay the same; only two decisions differ, and the
object that makes them is `libra.planner.partial.PartialRollout`, the very one the simulator's
`april` and `libra` systems use:
- how many groups to keep in flight: `over_provision` times a step's target (`room`);
- when a step's rollout stops and what it trains: once its target has finished, the first groups
  to finish, every overdue one first under the strict staleness gate (`ready`, `take`), so no
  trained token is more than `pipeline.staleness` versions old, and nothing expires.

"Abort and resume", live: the driver pauses every engine through the gateway while the trainer
trains (the colocated pipeline: rollout and training take turns), so the groups still running
stop where they are, their trajectories waiting on the held turn. The new weights land under the
publish pause mode's rule (`retract`: their KV is recomputed with the new weights and each token
keeps the version that wrote it) and they resume with the next step's rollout: nothing is thrown
away, and a carried group keeps the version of its first turn, the oldest any of its tokens has.
No more groups are started than the run's remaining steps train, so the last step leaves none in
flight.
"""

from __future__ import annotations

import itertools

from libra.planner.partial import PartialRollout
from libra.planner.staleness import Finished, StalenessGate
from libra.runtime.train.agent import AgentEnv, AgentLoop
from libra.runtime.train.rollout import Group, RolloutFailed, Rollouts, RolloutShape
from libra.runtime.train.task import ProblemStream


class PartialRollouts(Rollouts):
    def __init__(self, shape: RolloutShape, staleness: int, over_provision: float, problems: ProblemStream, loop: AgentLoop, env: AgentEnv, start_step: int, last_step: int):  # fmt: skip
        gate = StalenessGate(staleness, "completion", strict=True)
        super().__init__(shape, gate, problems, loop, env, start_step, last_step)
        self.policy: PartialRollout[Group] = PartialRollout(shape.groups_per_step, over_provision, gate)
        self._steps_taken = start_step
        self._keys = itertools.count()

    async def take(self, step: int) -> list[Finished[Group]]:
        while True:
            self._raise_if_failed()
            if self.policy.ready(step):
                got = self.policy.take(step)
                self._steps_taken, self.carried = step + 1, len(self.policy.running)
                self._poke()
                return got
            self._changed.clear()
            await self._changed.wait()

    def _left(self) -> int:
        """Groups still to start so that every remaining step gets its target, and no more."""
        steps = self.last_step + 1 - self._steps_taken
        held = len(self.policy.running) + len(self.policy.finished)
        return max(0, steps * self.shape.groups_per_step - held)

    async def _produce(self) -> None:
        """At each rollout phase's start (the run's, then after each step trained), as the
        simulator does: new groups up to `over_provision` times the target in flight."""
        phase = None
        while self._steps_taken <= self.last_step:
            if self.trained != phase:
                phase = self.trained
                for _ in range(min(self.policy.room(), self._left())):
                    g = next(self._keys)
                    self.policy.started((phase, g), phase)
                    self.started.setdefault(phase, self._now())
                    self._spawn(self._whole(phase, g, phase))
            self._changed.clear()
            await self._changed.wait()

    async def _whole(self, b: int, g: int, version: int) -> None:
        dropped = await self._group_until_whole(b, g, version)
        if dropped > self.shape.groups_per_step:
            raise RolloutFailed(f"group {g} (started at step {b}) was dropped {dropped} times; reasons {dict(self.drops.reasons)}; e.g. {self.drops.details[:2]}")  # fmt: skip

    def _finished(self, b: int, g: int, version: int, group: Group) -> None:
        self.policy.done((b, g), group)
