"""Rollout under bounded staleness: batches of GRPO groups, produced ahead of training.

A background producer starts batch b as soon as the shared gate allows it
(`StalenessGate.may_start(b, trained)`: at least b - k training steps done) and runs all of its
groups at once; each finished group goes into the shared `GroupQueue` with the weight version its
batch started at, and training step s takes whole groups from it (`consume: completion` takes the
first to finish, `batch` exactly batch s's). This is the simulator's rule, in the same code.

The bound holds for what is trained: a group that would be trained more than k steps after the
weights it was sampled with (a slow group under `consume: completion`) is set aside by the queue;
it is counted as dropped with reason `stale` and the batch samples a replacement group with the
weights of the moment.

A group is trained whole or not at all: when one of its trajectories is dropped (an engine error
the gateway could not fail over, a token mismatch, a tool the service failed), the whole group is
dropped, every member counted with its reason, and the batch samples a replacement group, so a
step never waits for a group that will not come. Too many drops in one batch stop the run
(`RolloutFailed`) instead of looping; an unreachable actions service stops it at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field

from libra.planner.staleness import Finished, GroupQueue, StalenessGate
from libra.runtime.train.agent import AgentEnv, AgentLoop
from libra.runtime.train.task import Problem, ProblemStream
from libra.runtime.train.trajectory import DropReason, Trajectory, TrajState


class RolloutFailed(RuntimeError):
    """Rollout cannot go on: too many drops, or the actions service is unreachable."""


@dataclass(slots=True)
class Group:
    batch: int
    index: int
    problem: Problem
    trajs: list[Trajectory]
    version: int  # training steps done when its batch started

    @property
    def dropped(self) -> bool:
        return any(t.state == TrajState.DROPPED for t in self.trajs)


@dataclass(slots=True)
class DropLog:
    """Every dropped trajectory, by the step that reports it (nothing is lost silently)."""

    reasons: Counter = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    trajectories: int = 0
    stale_groups: int = 0

    def add(self, group: Group) -> None:
        for t in group.trajs:
            self.reasons[t.drop_reason or DropReason.GROUP] += 1
            if t.drop_detail and len(self.details) < 5:
                self.details.append(f"{t.id}: {t.drop_reason}: {t.drop_detail}")
        self.trajectories += len(group.trajs)

    def take(self) -> DropLog:
        out = DropLog(self.reasons, self.details, self.trajectories, self.stale_groups)
        self.reasons, self.details, self.trajectories, self.stale_groups = Counter(), [], 0, 0
        return out


@dataclass(frozen=True, slots=True)
class RolloutShape:
    groups_per_step: int = 8
    group_size: int = 8
    max_drop_fraction: float = 0.5  # of a batch's groups; more stops the run


class Rollouts:
    def __init__(self, shape: RolloutShape, gate: StalenessGate, problems: ProblemStream, loop: AgentLoop, env: AgentEnv, start_step: int = 0, last_step: int | None = None):  # fmt: skip
        self.shape, self.gate, self.problems, self.loop, self.env = shape, gate, problems, loop, env
        self.last_step = last_step  # no batch past the run's last step is started: nothing is left over
        self.queue: GroupQueue[Group] = GroupQueue(gate)
        self.trained = start_step
        self.drops = DropLog()
        self.started: dict[int, float] = {}  # batch -> loop time it started (for the timeline)
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self._next_batch = start_step
        self._ids = itertools.count()
        self.carried: int | None = None  # partial rollouts: groups in flight when a step stopped

    # ---- the driver's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._producer = asyncio.create_task(self._produce())

    async def take(self, step: int) -> list[Finished[Group]]:
        """The whole groups training step `step` trains (waits until they have finished)."""
        while True:
            self._raise_if_failed()
            got = self.queue.take(step, self.shape.groups_per_step)
            self._replace_expired(step)
            if got is not None:
                return list(got)
            self._changed.clear()
            await self._changed.wait()

    def mark_trained(self, steps: int) -> None:
        self.trained = steps
        self._poke()

    def running(self) -> int:
        """Trajectories still being generated (0 at the end of a run: none is lost)."""
        return sum(1 for t in asyncio.all_tasks() if t.get_name().startswith("traj ") and not t.done())

    async def stop(self) -> None:
        for t in [self._producer, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(
            *[t for t in [self._producer, *self._tasks] if t is not None], return_exceptions=True
        )

    # ---- the producer --------------------------------------------------------------------------

    async def _produce(self) -> None:
        while self.last_step is None or self._next_batch <= self.last_step:
            b = self._next_batch
            while not self.gate.may_start(b, self.trained):
                self._changed.clear()
                await self._changed.wait()
            self.started[b] = self._now()
            self._spawn(self._batch(b, self.trained))
            self._next_batch += 1

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
        self._poke()

    def _replace_expired(self, step: int) -> None:
        """Count every group the queue set aside as too old and sample a replacement for each,
        with the weights of now (the replacement joins the same queue)."""
        for f in self.queue.drain_expired():
            why = f"sampled at weight version {f.version}, trained at step {step}: older than pipeline.staleness={self.gate.staleness}"  # fmt: skip
            for t in f.group.trajs:
                t.drop(DropReason.STALE, why)
            self.drops.add(f.group)
            self.drops.stale_groups += 1
            self._spawn(self._group_until_whole(f.group.batch, f.group.index, self.trained))

    async def _batch(self, b: int, version: int) -> None:
        budget = int(self.shape.max_drop_fraction * self.shape.groups_per_step)
        runs = [self._group_until_whole(b, g, version) for g in range(self.shape.groups_per_step)]
        dropped = await asyncio.gather(*runs)
        if sum(dropped) > budget:
            raise RolloutFailed(f"batch {b}: {sum(dropped)} groups dropped (more than rollout.max_drop_fraction={self.shape.max_drop_fraction} of {self.shape.groups_per_step}); reasons {dict(self.drops.reasons)}; e.g. {self.drops.details[:2]}")  # fmt: skip

    async def _group_until_whole(self, b: int, g: int, version: int) -> int:
        """Run group g of batch b, replacing it while it comes back with a dropped member."""
        dropped = 0
        while True:
            group = await self._group(b, g, version)
            if not group.dropped:
                self._finished(b, g, version, group)
                self._poke()
                return dropped
            for t in group.trajs:
                t.drop(DropReason.GROUP)
            self.drops.add(group)
            dropped += 1
            if dropped > self.shape.groups_per_step:
                return dropped

    def _finished(self, b: int, g: int, version: int, group: Group) -> None:
        self.queue.add(b, version, group)

    async def _group(self, b: int, g: int, version: int) -> Group:
        problem = self.problems.next()
        trajs = [
            Trajectory(f"b{b}-g{g}-{next(self._ids)}", problem.id, g, b) for _ in range(self.shape.group_size)
        ]
        runs = [asyncio.create_task(self.loop.run(problem, t, self.env), name=f"traj {t.id}") for t in trajs]
        await asyncio.gather(*runs)
        return Group(b, g, problem, trajs, version)

    def _poke(self) -> None:
        self._changed.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
