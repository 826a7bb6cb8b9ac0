"""The action model: one atomic call to an external resource, and its lifecycle.

An action is what happens between two generations of a trajectory: a shell command, a test run,
one reward-model request, one web API call. The scheduler sees its resource vector, its one-unit
duration T1 (an estimate: measured for known kinds, learned online for the rest) and its
efficiency profile. The lifecycle is a small state machine shared by the simulator and the live
service, so both count the same things the same way (queueing time, execution time, outcome).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from libra.actions.profiles import EfficiencyProfile
from libra.actions.resources import ResourceVector


@dataclass(slots=True)
class Action:
    """A unit of external work. `seq` is the FCFS order; `traj` groups a trajectory's actions."""

    id: str
    traj: str
    kind: str
    t1: float
    demand: ResourceVector
    profile: EfficiencyProfile | None = None
    arrival: float = 0.0
    seq: int = 0
    service: str | None = None  # a GPU service (reward model, teacher) the action runs on
    _options: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    # (pool shape, (units, duration) at the minimum): the scheduler's per-pool cache, kept here
    # because a waiting action is looked at again on every decision until it starts.
    _at_min: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str | None:
        return self.demand.key

    def key_options(self) -> tuple[int, ...]:
        """Unit counts of the key resource the scheduler may choose from (only the minimum when
        the action's elasticity is unknown, as the design prescribes). Computed once: the
        scheduler asks on every decision while the action waits."""
        if self._options is None:
            f = self.demand.get(self.key) if self.key else None
            if f is None:
                self._options = ()
            elif self.profile is None:
                self._options = (int(f.min),)
            else:
                self._options = tuple(int(v) for v in f.values())
        return self._options

    @property
    def memory_gib(self) -> float:
        """Sandbox memory its trajectory reserves on the node it is pinned to."""
        return self.demand.minimum("memory")

    @property
    def min_units(self) -> int:
        return int(self.demand.minimum(self.key)) if self.key else 0

    def duration(self, m: float) -> float:
        """T1 / (E(m) m). Without a profile, `t1` is simply the duration at the minimum."""
        if self.profile is None or m <= 0:
            return self.t1
        return self.profile.duration(self.t1, m)


class ActionState(IntEnum):
    QUEUED = 0
    RUNNING = 1
    SUCCEEDED = 2
    FAILED = 3
    TIMED_OUT = 4
    CANCELLED = 5

    @property
    def done(self) -> bool:
        return self >= ActionState.SUCCEEDED


class LifecycleError(RuntimeError):
    """A transition was asked from a state that does not allow it (a bug in a mechanism)."""


@dataclass(slots=True)
class ActionRecord:
    """One action's life: when it arrived, started and ended, and what it was given."""

    action: Action
    state: ActionState = ActionState.QUEUED
    started: float | None = None
    ended: float | None = None
    units: int = 0
    placement: tuple = field(default_factory=tuple)
    restore_s: float = 0.0

    def _expect(self, *states: ActionState) -> None:
        if self.state not in states:
            names = "/".join(s.name for s in states)
            raise LifecycleError(f"action {self.action.id}: expected {names}, is {self.state.name}")

    def start(self, now: float, units: int, placement: tuple = (), restore_s: float = 0.0) -> None:
        self._expect(ActionState.QUEUED)
        self.state, self.started, self.units = ActionState.RUNNING, now, units
        self.placement, self.restore_s = placement, restore_s

    def finish(self, now: float, state: ActionState = ActionState.SUCCEEDED) -> None:
        self._expect(ActionState.RUNNING)
        if not state.done or state == ActionState.CANCELLED:
            raise LifecycleError(f"action {self.action.id}: cannot finish as {state.name}")
        self.state, self.ended = state, now

    def cancel(self, now: float) -> None:
        self._expect(ActionState.QUEUED)
        self.state, self.ended = ActionState.CANCELLED, now

    @property
    def queue_s(self) -> float:
        return (self.started if self.started is not None else self.ended or 0.0) - self.action.arrival

    @property
    def act_s(self) -> float:
        """Action completion time: queueing plus execution."""
        if self.ended is None:
            raise LifecycleError(f"action {self.action.id} has not ended")
        return self.ended - self.action.arrival
