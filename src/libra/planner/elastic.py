"""The elastic hybrid pool: whole DP replicas that move between rollout and training.

The planner balances the two stages on average; within a planning interval the balance drifts
step to step. The hybrid pool absorbs that drift without a re-plan: some rollout GPUs are grouped
as whole training DP replicas (same TP/PP/CP as the core), which training may borrow. Because a
replica joins or leaves *whole*, the core TP/PP groups never change.

**Roles.** `Role.CORE_TRAIN`, `Role.CORE_ROLLOUT` and `Role.HYBRID` GPUs.

**Join state machine** (`HybridReplica`): ROLLOUT -> REQUESTED -> FETCHING_STATE -> ZERO_SYNC ->
ACTIVATING -> ACTIVE, and ACTIVE -> RELEASING -> ROLLOUT to give it back.
- FETCHING_STATE: the replica fetches a snapshot of weights and optimizer in the background;
- ZERO_SYNC: it takes part in the gradient all-reduce sending zeros while it restores and catches
  up. Core replicas add what they receive to their own gradients, so zeros change nothing and
  training never waits for the joiner;
- ACTIVATING: a two-phase handshake: a core replica proposes the step from which the joiner's
  gradients count, the joiner acknowledges, and the core commits the new membership at a step
  boundary (the live mechanism, `libra.runtime.elastic`; the simulator passes through at once);
- only ACTIVE contributes gradients.
Cancel (before ACTIVE) or failure (any time) rolls the *whole* replica back to ROLLOUT. Every
join and every rollback bumps the replica's generation; a transition carrying an older generation
is refused (returns False), so a late callback from an abandoned join cannot move a newer one.
A transition from the wrong state with the current generation is a mechanism bug and raises.

**Controller** (`ElasticController`): hysteresis on r = T_train / T_rollout (or, with
`ElasticConfig.schedule`, a fixed timeline of how many replicas training holds from which step). Borrow replicas when
r >= 1.15, release when r <= 0.90, nothing in between, never borrow while rollout pressure is
high, and nothing while a transition is in flight (the measured r would mix two layouts). How
many to move is the count whose predicted pipeline step time (`plan.pipeline_period`: training
scales with 1/DP, rollout with 1/GPUs) is least; a move that predicts no shorter step is not
made, so the controller never overshoots past the opposite threshold and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from libra.planner.config import ElasticConfig
from libra.planner.plan import Plan, pipeline_period


class Role(IntEnum):
    CORE_TRAIN = 0
    CORE_ROLLOUT = 1
    HYBRID = 2


class JoinState(IntEnum):
    ROLLOUT = 0  # a hybrid replica serving rollout
    REQUESTED = 1
    FETCHING_STATE = 2
    ZERO_SYNC = 3
    ACTIVATING = 4  # proposed a step to count from; waiting for the acknowledgement and the commit
    ACTIVE = 5
    RELEASING = 6  # giving the GPUs back: the inference engine restarts


JOINING = (JoinState.REQUESTED, JoinState.FETCHING_STATE, JoinState.ZERO_SYNC, JoinState.ACTIVATING)


class TransitionError(RuntimeError):
    """A transition was asked of a replica in the wrong state (a mechanism bug, not bad input)."""


@dataclass(slots=True)
class HybridReplica:
    """One hybrid DP replica and its join state. The mechanism drives the transitions."""

    id: str
    gpus: int
    state: JoinState = JoinState.ROLLOUT
    generation: int = 0
    rollbacks: int = 0
    stale_refusals: int = 0

    @property
    def contributes_gradients(self) -> bool:
        return self.state == JoinState.ACTIVE

    @property
    def sends_zero_gradients(self) -> bool:
        return self.state in (JoinState.ZERO_SYNC, JoinState.ACTIVATING)

    @property
    def serves_rollout(self) -> bool:
        return self.state == JoinState.ROLLOUT

    @property
    def in_transition(self) -> bool:
        return self.state in JOINING or self.state == JoinState.RELEASING

    def request_join(self) -> int:
        """ROLLOUT -> REQUESTED. Returns the join's generation; later transitions must carry it."""
        self._expect((JoinState.ROLLOUT,), "request_join")
        self.generation += 1
        self.state = JoinState.REQUESTED
        return self.generation

    def begin_fetch(self, generation: int) -> bool:
        return self._move(generation, (JoinState.REQUESTED,), JoinState.FETCHING_STATE, "begin_fetch")

    def state_fetched(self, generation: int) -> bool:
        return self._move(generation, (JoinState.FETCHING_STATE,), JoinState.ZERO_SYNC, "state_fetched")

    def propose_activation(self, generation: int) -> bool:
        """ZERO_SYNC -> ACTIVATING: the core proposed the step from which this replica counts."""
        return self._move(generation, (JoinState.ZERO_SYNC,), JoinState.ACTIVATING, "propose_activation")

    def activate(self, generation: int) -> bool:
        """ACTIVATING -> ACTIVE: the joiner acknowledged and the core committed the membership."""
        return self._move(generation, (JoinState.ACTIVATING,), JoinState.ACTIVE, "activate")

    def release(self, generation: int) -> bool:
        return self._move(generation, (JoinState.ACTIVE,), JoinState.RELEASING, "release")

    def released(self, generation: int) -> bool:
        return self._move(generation, (JoinState.RELEASING,), JoinState.ROLLOUT, "released")

    def cancel(self, generation: int) -> bool:
        """Abandon a join before it is ACTIVE: the whole replica goes back to rollout."""
        return self._rollback(generation, JOINING, "cancel")

    def fail(self, generation: int) -> bool:
        """A rank failed or timed out: whatever the replica was doing, all of it returns to rollout."""
        return self._rollback(generation, (*JOINING, JoinState.ACTIVE, JoinState.RELEASING), "fail")

    def _rollback(self, generation: int, allowed: tuple[JoinState, ...], what: str) -> bool:
        if not self._move(generation, allowed, JoinState.ROLLOUT, what):
            return False
        self.generation += 1  # in-flight callbacks of the abandoned join are now stale
        self.rollbacks += 1
        return True

    def _move(self, generation: int, allowed: tuple[JoinState, ...], to: JoinState, what: str) -> bool:
        if generation != self.generation:
            self.stale_refusals += 1
            return False
        self._expect(allowed, what)
        self.state = to
        return True

    def _expect(self, allowed: tuple[JoinState, ...], what: str) -> None:
        if self.state not in allowed:
            names = ", ".join(s.name for s in allowed)
            raise TransitionError(f"replica {self.id}: {what} needs state {names}, it is {self.state.name}")


@dataclass(frozen=True, slots=True)
class JoinReplica:
    """Decision: start the join of this hybrid replica (the mechanism calls `request_join`)."""

    replica: str


@dataclass(frozen=True, slots=True)
class ReleaseReplica:
    """Decision: give this ACTIVE replica back to rollout, with the generation it joined under."""

    replica: str
    generation: int


@dataclass(frozen=True, slots=True)
class ElasticSignals:
    """What the controller reads: measured stage times and pressure, and the core's DP size."""

    t_train_s: float
    t_rollout_s: float
    rollout_pressure: float  # 0..1: how saturated rollout is (queue fill, KV use)
    core_dp: int
    rollout_gpus: int  # GPUs serving rollout now, hybrid replicas in ROLLOUT included
    prompts_per_step: int = 0  # for the GRPO divisibility rule; 0 disables it
    staleness: int = 1  # the pipeline's bound, for the predicted step time (plan.pipeline_period)
    # The rollout engines' busy seconds per batch, when measured. Unknown, it is taken equal to
    # T_rollout, and the predicted step is the paper's max(T_train, T_rollout) whatever the staleness.
    rollout_work_s: float | None = None
    step: int = 0  # the step just trained (read only by a scheduled pool, `ElasticConfig.schedule`)


@dataclass(frozen=True, slots=True)
class ElasticDecision:
    joins: tuple[JoinReplica, ...] = ()
    releases: tuple[ReleaseReplica, ...] = ()
    reason: str = ""

    @property
    def hold(self) -> bool:
        return not (self.joins or self.releases)


class ElasticController:
    """Hysteresis on T_train / T_rollout; pure: reads replicas, never changes them."""

    __slots__ = ("config",)

    def __init__(self, config: ElasticConfig | None = None):
        self.config = config or ElasticConfig()

    def decide(self, sig: ElasticSignals, replicas: Sequence[HybridReplica]) -> ElasticDecision:
        if any(r.in_transition for r in replicas):
            return ElasticDecision(reason="a transition is in flight")
        target = self.config.scheduled(sig.step)
        if target is not None:
            return self._follow(target, sig.step, replicas)
        if sig.t_rollout_s <= 0 or sig.t_train_s <= 0:
            return ElasticDecision(reason="no measured stage times yet")
        ratio = sig.t_train_s / sig.t_rollout_s
        c = self.config
        active = [r for r in replicas if r.state == JoinState.ACTIVE]
        dp = sig.core_dp + len(active)
        if ratio >= c.borrow_ratio:
            if sig.rollout_pressure >= c.high_pressure:
                return ElasticDecision(
                    reason=f"r={ratio:.2f} but rollout pressure {sig.rollout_pressure:.2f} is high"
                )
            return self._borrow(sig, dp, [r for r in replicas if r.serves_rollout], ratio)
        if ratio <= c.release_ratio:
            return self._release(sig, dp, active, ratio)
        return ElasticDecision(reason=f"r={ratio:.2f} inside the hysteresis band")

    def _follow(self, target: int, step: int, replicas: Sequence[HybridReplica]) -> ElasticDecision:
        """The schedule's count: borrow idle replicas up to it, release active ones down to it."""
        active = [r for r in replicas if r.state == JoinState.ACTIVE]
        idle = [r for r in replicas if r.serves_rollout]
        why = f"schedule: {target} from step {step}"
        if target > len(active) and idle:
            k = min(target - len(active), len(idle))
            return ElasticDecision(
                joins=tuple(JoinReplica(r.id) for r in idle[:k]), reason=f"{why}: borrow {k}"
            )
        if target < len(active):
            rel = tuple(ReleaseReplica(r.id, r.generation) for r in active[target:])
            return ElasticDecision(releases=rel, reason=f"{why}: release {len(rel)}")
        return ElasticDecision(reason=f"{why}: held")

    def _borrow(
        self, sig: ElasticSignals, dp: int, idle: list[HybridReplica], ratio: float
    ) -> ElasticDecision:
        if not idle:
            return ElasticDecision(reason=f"r={ratio:.2f} but no hybrid replica is serving rollout")
        k = self._best_k(sig, dp, idle[0].gpus, len(idle), +1)
        if not k:
            return ElasticDecision(reason=f"r={ratio:.2f} but no borrow shortens the step")
        return ElasticDecision(
            joins=tuple(JoinReplica(r.id) for r in idle[:k]), reason=f"r={ratio:.2f}: borrow {k}"
        )

    def _release(
        self, sig: ElasticSignals, dp: int, active: list[HybridReplica], ratio: float
    ) -> ElasticDecision:
        if not active:
            return ElasticDecision(reason=f"r={ratio:.2f} but nothing is borrowed")
        k = self._best_k(sig, dp, active[0].gpus, len(active), -1)
        if not k:
            return ElasticDecision(reason=f"r={ratio:.2f} but no release shortens the step")
        rel = tuple(ReleaseReplica(r.id, r.generation) for r in active[-k:])
        return ElasticDecision(releases=rel, reason=f"r={ratio:.2f}: release {k}")

    def _best_k(self, sig: ElasticSignals, dp: int, replica_gpus: int, available: int, sign: int) -> int:
        """How many replicas to move (0 for none) so the predicted pipeline step time is least.

        Training time scales with 1/DP (whole replicas, same layout); rollout time with 1/GPUs;
        the step time is `pipeline_period` at the signals' staleness (at a large staleness, the
        paper's max(T_train, T_rollout)). Counts that would leave GRPO groups dividing unevenly
        over DP are skipped.
        """
        work = sig.t_rollout_s if sig.rollout_work_s is None else sig.rollout_work_s
        best_k, best_t = 0, pipeline_period(sig.t_train_s, sig.t_rollout_s, work, sig.staleness)
        for k in range(1, available + 1):
            new_dp = dp + sign * k
            roll = sig.rollout_gpus - sign * k * replica_gpus
            if new_dp < 1 or roll < 1 or not self._even(sig, new_dp):
                continue
            scale = sig.rollout_gpus / roll
            t_train, t_roll = sig.t_train_s * dp / new_dp, sig.t_rollout_s * scale
            t = pipeline_period(t_train, t_roll, work * scale, sig.staleness)
            if t < best_t:
                best_k, best_t = k, t
        return best_k

    def _even(self, sig: ElasticSignals, dp: int) -> bool:
        return not (self.config.require_even_groups and sig.prompts_per_step and sig.prompts_per_step % dp)


def phase_seconds(state: JoinState, config: ElasticConfig | None = None) -> float:
    """How long a mechanism holds a replica in `state` before the next transition (published costs).

    Rollout -> training is 3.6 s of snapshot fetch (FETCHING_STATE) then 4.4 s of restore while
    sending zero gradients (ZERO_SYNC); training -> rollout is ~10.8 s of engine restart (RELEASING).
    """
    c = config or ElasticConfig()
    return {
        JoinState.FETCHING_STATE: c.snapshot_s,
        JoinState.ZERO_SYNC: c.restore_s,
        JoinState.RELEASING: c.train_to_rollout_s,
    }.get(state, 0.0)


def make_pool(plan: Plan) -> list[HybridReplica]:
    """The hybrid replicas a plan sets aside: `plan.hybrid_replicas` of `plan.replica_gpus` GPUs each.

    They start serving rollout; the mechanism places them on rollout GPUs of its choice, whole
    TP x CP groups inside a node, as it places the core training replicas.
    """
    return [HybridReplica(f"hybrid-{k}", plan.replica_gpus) for k in range(plan.hybrid_replicas)]


@dataclass(frozen=True, slots=True)
class EngineSlot:
    """A rollout engine as the host choice sees it."""

    id: str
    tp: int
    node: int


def hybrid_hosts(replicas: Sequence[HybridReplica], slots: Sequence[EngineSlot]) -> dict[str, list[str]]:
    """Which engines each hybrid replica takes: whole engines of one node whose TPs sum to the
    replica's GPUs, largest TP first, the highest-numbered node first, no engine twice. A replica
    with no such set of engines is left out (it cannot join)."""
    by_node: dict[int, list[EngineSlot]] = {}
    for e in slots:
        by_node.setdefault(e.node, []).append(e)
    hosts: dict[str, list[str]] = {}
    used: set[str] = set()
    for r in replicas:
        for node in sorted(by_node, reverse=True):
            pick = _subset(sorted(by_node[node], key=lambda e: -e.tp), r.gpus, used)
            if pick:
                hosts[r.id] = [e.id for e in pick]
                used.update(hosts[r.id])
                break
    return hosts


def _subset(engines: list[EngineSlot], gpus: int, used: set[str]) -> list[EngineSlot] | None:
    """Engines (in order) whose TPs sum to exactly `gpus`, none already used."""
    pick, total = [], 0
    for e in engines:
        if e.id in used or total + e.tp > gpus:
            continue
        pick.append(e)
        total += e.tp
        if total == gpus:
            return pick
    return None
