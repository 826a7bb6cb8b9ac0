"""Who counts in a step's gradient, agreed by every core replica without a coordinator.

Core replicas are fixed ranks 0..core-1 of a gloo group; hybrid slots 0..H-1 each have a fixed core
partner (slot h -> rank h % core). After each step's gradient all-reduce, the core all-reduces one
small int64 table (`CONTROL_FIELDS` per slot; a slot's row is written only by its partner, plus a
release request any rank may set), so every rank applies the same changes in the same order:
- ACTIVATE: the slot counts from the next step (its partner holds an acknowledged proposal for it);
- REMOVE: it no longer counts from the next step (it failed, or its release was requested).
Each change bumps the membership epoch; joiners tag their gradients with it and a partner rejects
a gradient tagged with another epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

from libra.planner import JoinState


class Op(IntEnum):
    NONE = 0
    ACTIVATE = 1
    REMOVE = 2


class Field(IntEnum):
    OP = 0
    STATE = 1
    GENERATION = 2
    JOINS = 3
    RELEASES = 4
    ROLLBACKS = 5
    RELEASE_REQUEST = 6
    REJECTED = 7


CONTROL_FIELDS = len(Field)


def partner_of(slot: int, core: int) -> int:
    return slot % core


@dataclass(slots=True)
class Membership:
    """The members of one step: the core ranks, then the ACTIVE hybrid slots in slot order."""

    core: int
    slots: int
    epoch: int = 0
    active: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.core + len(self.active)

    def index_of(self, slot: int) -> int:
        """The member index of an active slot (its share of the layout)."""
        return self.core + self.active.index(slot)

    def mask(self) -> int:
        return sum(1 << s for s in self.active)

    @classmethod
    def from_mask(cls, core: int, slots: int, epoch: int, mask: int) -> Membership:
        return cls(core, slots, epoch, tuple(s for s in range(slots) if mask >> s & 1))

    def apply(self, table: torch.Tensor) -> bool:
        """Apply a summed control table; True when the membership changed (epoch bumped)."""
        active = set(self.active)
        for s in range(self.slots):
            op, released = int(table[s, Field.OP]), int(table[s, Field.RELEASE_REQUEST]) > 0
            if op == Op.ACTIVATE:
                active.add(s)
            elif op == Op.REMOVE or (released and s in active):
                active.discard(s)
        changed = tuple(sorted(active)) != self.active
        if changed:
            self.active, self.epoch = tuple(sorted(active)), self.epoch + 1
        return changed


@dataclass(frozen=True, slots=True)
class ElasticStatus:
    """What a step reports about the pool (the `elastic` object of `steps.json`), cumulative."""

    epoch: int
    hybrid_active: int
    joins: int  # joins that reached ACTIVE
    releases: int  # replicas that left cleanly
    rollbacks: int  # joins or replicas rolled back to rollout after a failure or timeout
    rejected: int  # stale or duplicate messages refused
    states: tuple[JoinState, ...] = field(default_factory=tuple)
    active: tuple[int, ...] = ()  # the hybrid slots that count in the next step (epoch's members)

    @classmethod
    def from_table(cls, m: Membership, table: torch.Tensor) -> ElasticStatus:
        col = lambda f: int(table[:, f].sum())  # noqa: E731
        states = tuple(JoinState(int(table[s, Field.STATE])) for s in range(m.slots))
        return cls(
            m.epoch, len(m.active), col(Field.JOINS), col(Field.RELEASES), col(Field.ROLLBACKS),
            col(Field.REJECTED), states, m.active,
        )  # fmt: skip

    def to_json(self) -> dict:
        return {
            "joins": self.joins, "releases": self.releases, "rollbacks": self.rollbacks,
            "hybrid_active": self.hybrid_active, "epoch": self.epoch, "rejected": self.rejected,
            "states": [s.name for s in self.states], "active": list(self.active),
        }  # fmt: skip
