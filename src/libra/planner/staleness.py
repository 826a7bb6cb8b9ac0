"""Bounded staleness: when a rollout batch may start, and which finished groups a training step takes.

Why it is policy, shared by the simulator and `libra train`: the pipeline's correctness (no group
trained on weights more than k steps old; only whole GRPO groups trained) must not differ between
the simulated clock and the live run. Both mechanisms ask the same two questions here:

- `may_start(batch, trained)`: batch s may start once at least s - k training steps are done (its
  weights are then at most k steps old), as slime and AReaL bound it. Colocated systems roll out
  one whole batch at a time, after its previous step trained. Under `strict` the lead ramps up
  (below, "The start").
- `GroupQueue.take(step, n)`: training step s takes n whole finished groups. `consume: completion`
  takes the first n to finish, from any batch (AReaL); `consume: batch` takes exactly batch s's.

The bound k holds for what is trained, not only for when a batch starts: with `consume:
completion` a slow group of an early batch can finish after later batches' groups have filled the
steps its own batch was meant for, and would be trained k + 2 or more steps after its weights.
`take` never returns a group older than k (step - version > k): it sets such a group aside as
expired, and the mechanism that owns the rollouts drains them (`drain_expired`), counts them and
regenerates each one with the weights of the moment. `strict` keeps the bound by waiting instead:
step s first takes every finished group sampled at version s - k or older (the batch may grow past
n), and is not ready while such a group still runs (`oldest_running`); nothing then expires.

**The start** (`strict` only). Before the first update every batch is sampled at version 0, so
with the plain rule batches 0..k all start at once, share one deadline (step k) and the strict
gate makes step k wait for the slowest group of all k + 1 of them, run side by side on the same
engines; that step then trains the stragglers of k + 1 batches at once. On R2E-Gym late in
training (64 prompts, k = 2, `static-optimal`) that one step took 3,200 s against about 650 s in
steady state, and made k = 2 slower over 12 steps than k = 1 (4,617 against 5,253 tok/s), though
k = 2 is faster in steady state. So the lead ramps up: batch s may start once trained >=
s - min(k, trained + 1), i.e. at most two batches per weight version (as k = 1 starts), then the
full lead k from step k - 1 on. k = 1 is unchanged; under a larger k every batch starts no later
than under k = 1 and its deadline is no earlier, so the k = 1 schedule stays open. Under expiry the
clump costs expired groups, not a wait, and the live `libra train` (which runs expiry) keeps the
plain rule.

Pure: no clock and no I/O; a group is any object, carried with the weight version it was sampled at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

G = TypeVar("G")
Consume = Literal["completion", "batch"]


@dataclass(frozen=True, slots=True)
class StalenessGate:
    staleness: int = 1
    consume: Consume = "completion"
    colocated: bool = False  # rollout and training take turns on the same GPUs
    strict: bool = False  # keep the bound on trained tokens too (see the module docstring)

    def may_start(self, batch: int, trained: int, busy: bool = False) -> bool:
        """Whether batch `batch` may start now, with `trained` training steps done. `busy`: for a
        colocated system, a step is training or a batch is still rolling out."""
        if self.colocated:
            return trained >= batch and not busy
        return trained >= batch - self.lead(trained)

    def lead(self, trained: int) -> int:
        """How many batches rollout may run ahead of training with `trained` steps done: k, ramped
        up from 1 under `strict` (the module docstring's "The start")."""
        return min(self.staleness, trained + 1) if self.strict else self.staleness

    def by_completion(self) -> bool:
        return self.consume == "completion" and not self.colocated

    def overdue(self, step: int, version: int) -> bool:
        """Whether a group sampled at `version` must be trained by step `step` under `strict`
        (a step later, its tokens would be more than `staleness` versions old)."""
        return self.strict and version <= step - self.staleness

    def queue_of(self, batch: int) -> int:
        """Where a finished group of batch `batch` waits: one queue in completion order, else its own."""
        return 0 if self.by_completion() else batch


@dataclass(slots=True)
class Finished(Generic[G]):
    """A whole finished GRPO group and the weight version (training steps done) it was sampled at."""

    version: int
    group: G


@dataclass(slots=True)
class GroupQueue(Generic[G]):
    """Finished whole groups waiting to be trained, oldest first, per the gate's queue rule."""

    gate: StalenessGate
    _queues: dict[int, deque[Finished[G]]] = field(default_factory=dict)
    _expired: list[Finished[G]] = field(default_factory=list)

    def add(self, batch: int, version: int, group: G) -> None:
        self._queues.setdefault(self.gate.queue_of(batch), deque()).append(Finished(version, group))

    def ready(self, step: int, n_groups: int) -> bool:
        self._expire(step)
        q = self._queues.get(self.gate.queue_of(step))
        return q is not None and len(q) >= n_groups

    def take(
        self, step: int, n_groups: int, oldest_running: int | None = None
    ) -> Sequence[Finished[G]] | None:
        """The `n_groups` groups training step `step` trains, or None while too few have finished.

        Every group it returns is at most k steps old; older ones are set aside as expired. With a
        strict gate, also None while a running group (the oldest sampled at version
        `oldest_running`) is overdue, and every finished overdue group is taken, first."""
        if not self.ready(step, n_groups):
            return None
        q = self._queues[self.gate.queue_of(step)]
        if not self.gate.strict:
            return [q.popleft() for _ in range(n_groups)]
        if oldest_running is not None and self.gate.overdue(step, oldest_running):
            return None
        must = [f for f in q if self.gate.overdue(step, f.version)]
        rest = [f for f in q if not self.gate.overdue(step, f.version)]
        taken = must + rest[: max(0, n_groups - len(must))]
        left = rest[max(0, n_groups - len(must)) :]
        q.clear()
        q.extend(left)
        return taken

    def too_old(self, step: int, version: int) -> bool:
        """Whether a group sampled at `version` is past the bound for training step `step`."""
        return step - version > self.gate.staleness

    def _expire(self, step: int) -> None:
        for q in self._queues.values():
            if any(self.too_old(step, f.version) for f in q):
                keep = [f for f in q if not self.too_old(step, f.version)]
                self._expired += [f for f in q if self.too_old(step, f.version)]
                q.clear()
                q.extend(keep)

    def drain_expired(self) -> list[Finished[G]]:
        """The groups set aside as too old since the last call (the caller counts and replaces them)."""
        out, self._expired = self._expired, []
        return out

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())
