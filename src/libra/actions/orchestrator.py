"""The orchestrator: the scheduler and the CPU, GPU and quota managers as one policy object.

Mechanisms drive it with three calls: `submit` when an action arrives, `decide` whenever something
changed (it returns the actions to start now, with their cores or GPUs), and `complete` when one
ends. Time is always an argument; nothing here reads a clock, sleeps or does I/O. The simulator and
the live actions service therefore run the very same object, and a policy that behaves in
simulation is the one that runs live.

It also learns T1 per action kind (an exponential average of observed one-unit durations), so
actions whose duration nobody declared still get a sensible estimate.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from libra.actions.cpu import CpuManager
from libra.actions.gpu import GpuManager
from libra.actions.model import Action, ActionRecord, ActionState
from libra.actions.quota import QuotaManager, QuotaScratch
from libra.actions.scheduler import Decision, ElasticScheduler, Pool, SchedulerView
from libra.actions.topology import Fungible
from libra.core.errors import ConfigError

UNPINNED = ("cpu", "unpinned")


@dataclass(frozen=True, slots=True)
class Start:
    """An instruction to a mechanism: run this action now on these units."""

    action: Action
    units: int
    node: int | None = None
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    restore_s: float = 0.0

    @property
    def expected_s(self) -> float:
        return self.restore_s + self.action.duration(self.units)


class DurationEstimator:
    """T1 learned from completions (observed execution time times the speed-up it ran with).

    Kept per (trajectory, kind) and per kind: an agent reruns the same tests on the same
    repository, so its own last runs predict the next far better than the average over all
    repositories does; a trajectory's first call of a kind falls back to that average.
    """

    def __init__(self, alpha: float = 0.5, kind_alpha: float = 0.1):
        self.alpha, self.kind_alpha = alpha, kind_alpha
        self._kind: dict[str, float] = {}
        self._traj: dict[tuple[str, str], float] = {}

    def get(self, kind: str, default: float, traj: str | None = None) -> float:
        if traj is not None and (traj, kind) in self._traj:
            return self._traj[(traj, kind)]
        return self._kind.get(kind, default)

    def observe(self, action: Action, units: int, exec_s: float) -> None:
        speedup = action.profile.speedup(units) if action.profile is not None and units > 0 else 1.0
        t1 = exec_s * speedup
        _ewma(self._kind, action.kind, t1, self.kind_alpha)
        _ewma(self._traj, (action.traj, action.kind), t1, self.alpha)

    def forget_trajectory(self, traj: str) -> None:
        for key in [k for k in self._traj if k[0] == traj]:
            del self._traj[key]


def _ewma(table: dict, key, x: float, alpha: float) -> None:
    old = table.get(key)
    table[key] = x if old is None else old + alpha * (x - old)


PRICE_SCALE = 0.5


def load_price(busy: int, free: int) -> float:
    """What a core-second of work costs the others right now, in seconds of their waiting.

    It follows the M/M/1 delay factor rho / (1 - rho) of the node's current occupancy (0 when
    idle, growing without bound as it fills), scaled by PRICE_SCALE. Priced work is what keeps a
    test run from taking sixteen cores a moment before sixteen short commands arrive: the scale
    was chosen by a sweep on the tangram-coding scenario (with its reward calls, mean ACT over
    0.35 to 1.0 is within 2% of the best, at 0.7; 0.1 is 6% worse, no price 11%, 2.0 6%).
    """
    return PRICE_SCALE * busy / (free + 1.0)


class _QuotaLedger:
    """The scheduler's view of the quotas: a scratch copy it may take from while admitting."""

    def __init__(self, scratch: QuotaScratch):
        self.scratch = scratch

    def names(self, action: Action) -> tuple[Hashable, ...]:
        return tuple(("quota", n) for n, _ in action.demand.quotas())

    def fits(self, action: Action) -> bool:
        return self.scratch.fits(action.demand.quotas())

    def take(self, action: Action) -> None:
        self.scratch.take(action.demand.quotas())


class Orchestrator:
    def __init__(
        self,
        cpu: CpuManager | None = None,
        gpu: GpuManager | None = None,
        quota: QuotaManager | None = None,
        scheduler: ElasticScheduler | None = None,
        price_load: bool = True,
    ):
        self.cpu, self.gpu, self.quota = cpu, gpu, quota
        self.scheduler = scheduler or ElasticScheduler()
        self.estimator = DurationEstimator()
        self.price_load = price_load
        self.records: dict[str, ActionRecord] = {}
        self._waiting: dict[str, Action] = {}
        self._running: dict[str, Start] = {}
        self._seq = 0
        self.last_decision: Decision | None = None

    # ---- the three calls ---------------------------------------------------------------------

    def submit(self, action: Action, now: float) -> ActionRecord:
        self._validate(action)
        self._seq += 1
        action.seq, action.arrival = self._seq, now
        rec = self.records[action.id] = ActionRecord(action)
        self._waiting[action.id] = action
        return rec

    def decide(self, now: float) -> list[Start]:
        if not self._waiting:
            return []
        pins = {a.id: self._pin(a) for a in self._waiting.values() if a.key == "cpu"}
        pools = self._pools(now)
        ledger = _QuotaLedger(self.quota.scratch(now)) if self.quota is not None else None

        def pool_of(a: Action):
            if a.key == "cpu":
                node = pins[a.id]
                return UNPINNED if node is None else ("cpu", node)
            return ("gpu",) if a.key == "gpu" else None

        view = SchedulerView(now, list(self._waiting.values()), pools, pool_of, ledger)
        self.last_decision = dec = self.scheduler.decide(view)
        # Largest GPU chunks first: the split guarantees the sizes fit the free aligned blocks,
        # and placing largest first is the order in which that guarantee holds.
        order = sorted(dec.grants, key=lambda g: (-g.units if g.action.key == "gpu" else 0, g.action.seq))
        starts = {g.action.id: self._start(g.action, g.units, now) for g in order}
        return [starts[g.action.id] for g in dec.grants]

    def complete(
        self, action_id: str, now: float, state: ActionState = ActionState.SUCCEEDED
    ) -> ActionRecord:
        start = self._running.pop(action_id)
        rec = self.records[action_id]
        rec.finish(now, state)
        if self.cpu is not None and self.cpu.held(action_id) is not None:
            self.cpu.release(action_id)
        if start.gpus:
            self.gpu.release(action_id, now)
        if self.quota is not None:
            self.quota.release(action_id)
        if state == ActionState.SUCCEEDED and rec.started is not None:
            self.estimator.observe(start.action, start.units, now - rec.started - start.restore_s)
        return rec

    def cancel(self, action_id: str, now: float) -> ActionRecord:
        """Withdraw a queued action (its client went away)."""
        self._waiting.pop(action_id)
        rec = self.records[action_id]
        rec.cancel(now)
        return rec

    def end_trajectory(self, traj: str) -> None:
        """The trajectory's sandbox is gone: its node memory is free again."""
        if self.cpu is not None:
            self.cpu.unpin(traj)
        self.estimator.forget_trajectory(traj)

    def forget(self, action_id: str) -> None:
        """Drop a finished record (a long-running service keeps only what it still reports)."""
        rec = self.records.get(action_id)
        if rec is not None and rec.state.done:
            del self.records[action_id]

    # ---- what mechanisms and reports read ----------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def wake_at(self, now: float) -> float | None:
        """When a quota window refills for a waiting action that its tokens hold back."""
        if self.quota is None:
            return None
        times = []
        for a in self._waiting.values():
            for name, tokens in a.demand.quotas():
                spec = self.quota.specs[name]
                if (
                    spec.tokens_per_period is not None
                    and self.quota.used(name, now) + tokens > spec.tokens_per_period
                ):
                    times.append(self.quota.next_window(name, now))
        return min(times) if times else None

    # ---- internals ---------------------------------------------------------------------------

    def _validate(self, a: Action) -> None:
        if a.id in self.records:
            raise ConfigError("action.id", a.id, "an id not used before")
        if a.t1 < 0:
            raise ConfigError("action.t1", a.t1, ">= 0 seconds")
        if a.key == "cpu":
            self._validate_cpu(a)
        elif a.key == "gpu":
            self._validate_gpu(a)
        elif a.key is not None:
            raise ConfigError("action.key", a.key, ["cpu", "gpu", "none (quota-only actions)"])
        for name, tokens in a.demand.quotas():
            if self.quota is None:
                raise ConfigError("quota", name, "a quota manager (none is configured)")
            self.quota.check(name, tokens)

    def _validate_cpu(self, a: Action) -> None:
        if self.cpu is None:
            raise ConfigError("action.key", "cpu", "a CPU manager (none is configured)")
        biggest = max(n.cores for n in self.cpu.nodes)
        if a.min_units > biggest or a.min_units < 1:
            raise ConfigError("cpu", a.min_units, f"1..{biggest} cores (the largest node)")
        if not self.cpu.can_ever_pin(a.memory_gib):
            raise ConfigError("memory", a.memory_gib, "at most the largest node's sandbox memory")

    def _validate_gpu(self, a: Action) -> None:
        if self.gpu is None:
            raise ConfigError("action.key", "gpu", "a GPU manager (none is configured)")
        if a.service not in self.gpu.services:
            raise ConfigError("action.service", a.service, sorted(self.gpu.services))
        spec = self.gpu.services[a.service]
        allowed = spec.dops(self.gpu.gpu_memory_gib, max(self.gpu.node_sizes))
        bad = [m for m in a.key_options() if m not in allowed]
        if bad or not a.key_options():
            raise ConfigError("gpu", list(a.key_options()), f"DoPs in {list(allowed)} (memory and node size)")

    def _pin(self, a: Action) -> int | None:
        node = self.cpu.node_of(a.traj)
        return node if node is not None else self.cpu.pin(a.traj, a.memory_gib)

    def _pools(self, now: float) -> dict:
        releases = self._releases(now)
        pools = {}
        if self.cpu is not None:
            for n in range(len(self.cpu.nodes)):
                key = ("cpu", n)
                free = self.cpu.free_count(n)
                price = load_price(self.cpu.nodes[n].cores - free, free) if self.price_load else 0.0
                pools[key] = Pool(key, Fungible(), (free,), releases.get(key, []), work_price=price)
            pools[UNPINNED] = Pool(UNPINNED, Fungible(), (0,))
        if self.gpu is not None:
            gpu = self.gpu

            def cost(a: Action, m: int) -> float:
                restore = 0.0 if gpu.resident_idle(a.service, m) else gpu.services[a.service].restore_s(m)
                return a.duration(m) + restore

            key = ("gpu",)
            pools[key] = Pool(key, gpu.operator, gpu.capacity(), releases.get(key, []), cost, False)
        return pools

    def _releases(self, now: float) -> dict[tuple, list[tuple[float, int]]]:
        """(seconds until it is expected to end, units) of each running action, by pool."""
        out: dict[tuple, list[tuple[float, int]]] = {}
        for s in self._running.values():
            key = ("gpu",) if s.gpus else ("cpu", s.node) if s.cores else None
            if key is not None:
                started = self.records[s.action.id].started
                out.setdefault(key, []).append((max(0.0, started + s.expected_s - now), s.units))
        return out

    def _start(self, a: Action, units: int, now: float) -> Start:
        del self._waiting[a.id]
        node, cores, gpus, restore = None, (), (), 0.0
        if a.key == "cpu":
            node = self.cpu.node_of(a.traj)
            cores = self.cpu.allocate(a.id, node, units)
        elif a.key == "gpu":
            p = self.gpu.place(a.id, a.service, units, now)
            node, gpus, restore = p.node, p.gpus, p.restore_s
        if self.quota is not None and a.demand.quotas():
            self.quota.acquire(a.id, a.demand.quotas(), now)
        start = self._running[a.id] = Start(a, units, node, cores, gpus, restore)
        self.records[a.id].start(now, units, cores or gpus, restore)
        return start
