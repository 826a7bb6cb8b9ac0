"""The prompt stream a partial-rollout step draws new groups from (APRIL's over-provisioning).

The policy (how many groups to keep in flight, when a step stops, what it trains) is
`libra.planner.partial.PartialRollout`; this is the simulator's side: every batch's GRPO groups in
order, as a data loader would serve them, so a step may start prompts of the next batches and
every system still runs the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from libra.core.trajectory import Trajectory

GroupKey = tuple[int, str]  # (batch, prompt id)


class GroupStream:
    """Every batch's GRPO groups in order (first appearance in the batch)."""

    def __init__(self, batch_of: Callable[[int], list[Trajectory]]):
        self._batch_of = batch_of
        self._groups: Iterator[tuple[GroupKey, list[Trajectory]]] = self._all()

    def _all(self) -> Iterator[tuple[GroupKey, list[Trajectory]]]:
        b = 0
        while True:
            groups: dict[str, list[Trajectory]] = {}
            for t in self._batch_of(b):
                groups.setdefault(t.prompt_id, []).append(t)
            for pid, members in groups.items():
                yield (b, pid), members
            b += 1

    def next(self) -> tuple[GroupKey, list[Trajectory]]:
        return next(self._groups)
