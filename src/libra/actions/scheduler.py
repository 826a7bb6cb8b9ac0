"""The elastic action scheduler (ARL-Tangram): who starts now, and with how many units.

It minimises the total action completion time (ACT: queueing plus execution) of the actions it
knows about, by three steps on a snapshot:

1. FCFS order. Admit the longest prefix that fits at every action's minimum. Pools are
   independent: an action that does not fit blocks later actions only on the pools (key-resource
   domain, named quotas) it shares with them, so one full node does not stall the others.
2. For each key-resource pool, split the units exactly among the admitted actions (the topology
   operator's DP), then evict admitted actions from the back one at a time, handing their units
   to the rest, while the estimated total ACT improves.
3. The estimate is that DP plus a completion heap that plays out the queued actions as units
   come free. `depth` bounds how many waves of the queue it plays out (a wave is the set of
   actions started by releases of the previous wave); actions beyond are worked through as a
   fluid at the pool's full capacity from the next wave on, so every action stays counted. Two
   waves are where an eviction's effect is visible; past that every candidate shifts the rest of
   the queue alike, so the bound saves time, not quality.

The playout behaves as the scheduler will: nothing queued starts before the next release (the
next decision), and an elastic action starts at the release that finishes it first, so "wait a
moment and start wider" can beat "start now on one core". A pool may price work
(`work_price`): the split then minimises duration x (1 + price x units), which keeps elastic
actions narrow while the pool is busy and lets them go wide when it is idle.

Pure: the snapshot is an input, the decision an output; no clock, no I/O, no mutation of inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libra.actions.model import Action
from libra.actions.topology import SplitItem, TopologyOperator


@dataclass(slots=True)
class Pool:
    """One key-resource domain: the cores of a node, or a pool of GPUs.

    `releases` holds (seconds from now until a running action ends, units it frees) and feeds the
    playout. `cost(action, m)` is the action's duration on m units; a pool that adds terms which
    do not scale with T1 (a GPU restore) sets `profile_groups=False` so the split does not assume
    they do.
    """

    id: Hashable
    operator: TopologyOperator
    capacity: tuple[int, ...]
    releases: list[tuple[float, int]] = field(default_factory=list)
    cost: Callable[[Action, int], float] | None = None
    profile_groups: bool = True
    # Seconds of others' waiting that one unit-second of work costs now (0 on an idle pool).
    # The split widens an action only while the time it saves beats the work it adds at this
    # price, so under load elastic actions stay narrow (efficient) and when idle they go wide.
    work_price: float = 0.0


class Ledger(Protocol):
    """Non-key resources (quotas, memory): checked at admission, never split."""

    def names(self, action: Action) -> tuple[Hashable, ...]: ...

    def fits(self, action: Action) -> bool: ...

    def take(self, action: Action) -> None: ...


@dataclass(slots=True)
class SchedulerView:
    now: float
    waiting: Sequence[Action]  # FCFS order
    pools: Mapping[Hashable, Pool]
    pool_of: Callable[[Action], Hashable | None]
    ledger: Ledger | None = None  # a scratch copy: the scheduler takes from it while it admits


@dataclass(frozen=True, slots=True)
class Grant:
    action: Action
    pool: Hashable | None
    units: int


@dataclass(slots=True)
class Decision:
    grants: list[Grant]
    estimated_act_s: float = 0.0  # estimated sum of ACT from now of the pools' actions
    evicted: int = 0
    admitted_at_min: int = 0


@dataclass(slots=True)
class _Job:
    """An action prepared once per decision: its sizes, cost functions and minimum duration.
    `item.cost` is what the split minimises (duration plus priced work); `cost` is the duration."""

    action: Action
    item: SplitItem
    need: int
    dmin: float
    cost: Callable[[int], float]


class ElasticScheduler:
    name = "tangram"

    def __init__(self, depth: int = 2):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth = depth

    def decide(self, view: SchedulerView) -> Decision:
        ctx = {pid: _PoolCtx(p) for pid, p in view.pools.items()}
        free_grants = self._admit(view, ctx)
        grants, total, evicted, n_adm = list(free_grants), 0.0, 0, len(free_grants)
        for pid, c in ctx.items():
            if not c.admitted and not c.queued:
                continue
            cost, alloc, n = self._evict(c)
            total += cost
            evicted += len(c.admitted) - n
            n_adm += len(c.admitted)
            grants.extend(Grant(j.action, pid, m) for j, m in zip(c.admitted[:n], alloc, strict=True))
        grants.sort(key=lambda g: g.action.seq)
        return Decision(grants, total, evicted, n_adm)

    # ---- step 1: the FCFS prefix at minimum units --------------------------------------------

    def _admit(self, view: SchedulerView, ctx: dict[Hashable, _PoolCtx]) -> list[Grant]:
        blocked: set = set()
        free_grants: list[Grant] = []
        ledger = view.ledger
        for a in view.waiting:
            pid = view.pool_of(a)
            c = ctx[pid] if pid is not None else None
            names = (("pool", pid),) if pid is not None else ()
            if ledger is not None:
                names += ledger.names(a)
            if _hits(names, blocked):
                if c is not None:
                    c.queued.append(a)
                continue
            if (c is not None and not c.fits(c.quick(a)[0])) or (ledger is not None and not ledger.fits(a)):
                blocked.update(names)
                if c is not None:
                    c.queued.append(a)
                continue
            if ledger is not None:
                ledger.take(a)
            if c is None:
                free_grants.append(Grant(a, None, 0))
            else:
                c.take(c.job(a))
        return free_grants

    # ---- step 2: exact split, and eviction from the back -------------------------------------

    def _evict(self, c: _PoolCtx) -> tuple[float, list[int], int]:
        jobs = c.admitted
        best, alloc = self._estimate(c, jobs, [])
        n = len(jobs)
        # Evicting every admitted job only pays when something running will free units; with
        # nothing running, waiting could never be rewarded (and nothing would wake the pool).
        floor = 0 if c.pool.releases else 1
        while n > floor:
            cost, cand = self._estimate(c, jobs[: n - 1], jobs[n - 1 :])
            if cost >= best - 1e-9:
                break
            best, alloc, n = cost, cand, n - 1
        return best, alloc, n

    def _estimate(self, c: _PoolCtx, jobs: list[_Job], evicted: list[_Job]) -> tuple[float, list[int]]:
        pool = c.pool
        if jobs:
            _, alloc = pool.operator.split([j.item for j in jobs], pool.capacity)
            exec_total = sum(j.cost(m) for j, m in zip(jobs, alloc, strict=True))
        else:
            exec_total, alloc = 0.0, []
        if not evicted and not c.queued:
            return exec_total, alloc
        return exec_total + self._playout(c, jobs, alloc, evicted), alloc

    def _playout(self, c: _PoolCtx, jobs: list[_Job], alloc: list[int], evicted: list[_Job]) -> float:
        """Sum of (start + duration) of queued jobs, started FCFS as units free up.

        A queued job starts at its minimum, widened by whatever is free beyond the minimums of
        the jobs still behind it: the same rule the scheduler applies when that moment comes.
        """
        heap = [(t, u, 0) for t, u in c.pool.releases]
        heap += [(j.cost(m), m, 0) for j, m in zip(jobs, alloc, strict=True)]
        heapq.heapify(heap)
        free = c.pool.capacity[0] - sum(alloc)
        # gen: the wave of the last release popped; jobs that start on units free now are wave 0.
        t, gen, total = 0.0, -1, 0.0
        n_ev = len(evicted)
        ev_behind = [sum(j.need for j in evicted[k + 1 :]) for k in range(n_ev)]
        qneed, qdmin, qbehind = c.arrays()[:3]
        for k in range(n_ev + len(c.queued)):
            if k < n_ev:
                a, need, dmin = evicted[k].action, evicted[k].need, evicted[k].dmin
            else:
                a, need, dmin = c.queued[k - n_ev], qneed[k - n_ev], qdmin[k - n_ev]
            # Nothing queued starts before the next release: that is the next moment the
            # scheduler decides again (what was not started now waits, even on spare units).
            while (free < need or gen < 0) and heap:
                if heap[0][2] >= self.depth:
                    return total + self._beyond_depth(c, evicted, k, heap[0][0])
                rt, units, gen = heapq.heappop(heap)
                free += units
                t = rt if rt > t else t
            if free < need:  # can never fit this pool; charged as if it started now
                total += t + dmin
                continue
            behind = ev_behind[k] + qbehind[0] if k < n_ev else qbehind[k - n_ev + 1]
            m, d = c.widen(a, need, dmin, free - behind)
            if a.profile is not None and heap and c.total - behind > need:
                t, free, gen, m, d = self._wait_for_width(c, heap, a, need, dmin, behind, t, free, gen, m, d)
            total += t + d
            free -= m
            heapq.heappush(heap, (t + d, m, gen + 1))
        return total

    def _wait_for_width(self, c, heap, a, need, dmin, behind, t, free, gen, m, d):
        """An elastic job may finish sooner by waiting for releases and starting wider. Scan the
        coming releases (within the played-out waves) and start at the point that finishes it
        first; the scheduler makes the same choice when that moment comes, so the playout does."""
        best_i, best = -1, (t + d, t, free, gen, m, d)
        popped, cur_t, cur_free = [], t, free
        while heap and heap[0][2] < self.depth and len(popped) < _MAX_SCAN and heap[0][0] < best[0]:
            rt, units, g2 = heapq.heappop(heap)
            popped.append((rt, units, g2))
            cur_t, cur_free = max(cur_t, rt), cur_free + units
            m2, d2 = c.widen(a, need, dmin, cur_free - behind)
            if cur_t + d2 < best[0]:
                best_i, best = len(popped) - 1, (cur_t + d2, cur_t, cur_free, g2, m2, d2)
        for r in popped[best_i + 1 :]:  # releases after the chosen start stay in the future
            heapq.heappush(heap, r)
        return best[1:]

    @staticmethod
    def _beyond_depth(c: _PoolCtx, evicted: list[_Job], k: int, t_next: float) -> float:
        """Queued actions past the played-out waves: from the next release on, the pool works
        through them as a fluid at full capacity, in FCFS order. Every action stays counted,
        and an eviction's extra work still delays those behind it."""
        cap = max(1, c.total)
        total, work = 0.0, 0.0
        for j in evicted[k:]:
            total += t_next + work / cap + j.dmin
            work += j.need * j.dmin
        q0 = max(0, k - len(evicted))
        n_q = len(c.queued) - q0
        _, _, _, dsum, xsum = c.arrays()
        dmin_sum, wait_work = dsum[q0], xsum[q0]
        return total + n_q * (t_next + work / cap) + dmin_sum + wait_work / cap


_MAX_SCAN = 64  # releases one elastic job looks ahead over in the playout


class _PoolCtx:
    """Per-decision state of one pool: its admitted jobs, its queue, usage, and caches."""

    __slots__ = ("pool", "total", "usage", "admitted", "queued", "_sizes", "_quick", "_arrays")

    def __init__(self, pool: Pool):
        self.pool = pool
        self.total = pool_total(pool)
        self.usage = pool.operator.zero()
        self.admitted: list[_Job] = []
        self.queued: list[Action] = []
        self._sizes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._quick: dict[str, tuple[int, float]] = {}
        self._arrays: tuple | None = None

    def sizes(self, a: Action) -> tuple[int, ...]:
        opts = a.key_options()
        sizes = self._sizes.get(opts)
        if sizes is None:
            sizes = self.pool.operator.sizes([m for m in opts if m <= self.total]) or (a.min_units,)
            self._sizes[opts] = sizes
        return sizes

    def cost(self, a: Action, m: int) -> float:
        return self.pool.cost(a, m) if self.pool.cost is not None else a.duration(m)

    def quick(self, a: Action) -> tuple[int, float]:
        """(units at minimum, duration at minimum): all the playout needs of a queued action.
        Where the duration depends on the action alone it is cached on the action itself."""
        if self.pool.cost is None:
            shape = (type(self.pool.operator), self.total)
            cached = a._at_min
            if cached is not None and cached[0] == shape:
                return cached[1]
            need = self.sizes(a)[0]
            a._at_min = (shape, (need, a.duration(need)))
            return a._at_min[1]
        q = self._quick.get(a.id)
        if q is None:
            need = self.sizes(a)[0]
            q = self._quick[a.id] = (need, self.cost(a, need))
        return q

    def arrays(self) -> tuple[list[int], list[float], list[int], list[float], list[float]]:
        """For the queued actions, computed once per decision: minimum units and minimum
        durations; then from each position on, the minimum units still queued, the sum of
        minimum durations, and the work (units x seconds) queued ahead of each action within
        that slice (job j's work is ahead of the n - 1 - j jobs after it, whatever the start)."""
        if self._arrays is None:
            n = len(self.queued)
            needs, dmins = [0] * n, [0.0] * n
            for j, a in enumerate(self.queued):
                needs[j], dmins[j] = self.quick(a)
            behind, dsum, xsum = [0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
            for j in range(n - 1, -1, -1):
                behind[j] = behind[j + 1] + needs[j]
                dsum[j] = dsum[j + 1] + dmins[j]
                xsum[j] = xsum[j + 1] + needs[j] * dmins[j] * (n - 1 - j)
            self._arrays = (needs, dmins, behind, dsum, xsum)
        return self._arrays

    def widen(self, a: Action, need: int, dmin: float, room: int) -> tuple[int, float]:
        """The size within `room` units (at least the minimum) the split would pick at the
        pool's work price, and its duration."""
        if room <= need or a.profile is None:
            return need, dmin
        price = self.pool.work_price
        best_m, best_c, best_d = need, dmin * (1.0 + price * need), dmin
        for m in self.sizes(a):
            if need < m <= room:
                d = self.cost(a, m)
                if d * (1.0 + price * m) < best_c:
                    best_m, best_c, best_d = m, d * (1.0 + price * m), d
        return best_m, best_d

    def job(self, a: Action) -> _Job:
        pool, sizes = self.pool, self.sizes(a)
        cost = (lambda m, a=a: pool.cost(a, m)) if pool.cost is not None else a.duration
        price = pool.work_price
        priced = (lambda m: cost(m) * (1.0 + price * m)) if price > 0 else cost
        group = (id(a.profile), sizes) if pool.profile_groups and a.profile is not None else None
        need, dmin = self.quick(a)
        return _Job(a, SplitItem(sizes, priced, group, a.t1), need, dmin, cost)

    def fits(self, need: int) -> bool:
        op = self.pool.operator
        return op.fits(op.charge(self.usage, need), self.pool.capacity)

    def take(self, job: _Job) -> None:
        self.usage = self.pool.operator.charge(self.usage, job.need)
        self.admitted.append(job)


def _hits(names: tuple, blocked: set) -> bool:
    for n in names:
        if n in blocked:
            return True
    return False


def pool_total(pool: Pool) -> int:
    """Units the pool could ever grant one action (its free units now plus those running)."""
    return pool.capacity[0] + sum(u for _, u in pool.releases)
