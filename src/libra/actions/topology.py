"""Topology operators: how units of a key resource can be split among actions.

The scheduler reasons about "units" (cores, GPUs); an operator hides which splits are physically
possible and solves the split exactly:

- `fungible`: CPU cores of one node. Any integer split whose sum fits is possible.
- `buddy`: GPUs in nodes of 2^L. An action gets an aligned chunk of 1, 2, 4 ... GPUs inside one
  node, split buddy-fashion. A set of power-of-two chunks fits into the free aligned blocks iff,
  for every level k, the chunks of size >= 2^k need no more than the free blocks of size >= 2^k
  hold (sizes divide each other, so placing largest first never strands space). The operator
  therefore tracks one usage number per level, and the split DP runs over that vector.

`split` returns the unit count of each item that minimises the sum of their durations (the
admitted actions' part of the total ACT), exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from libra.core.errors import ConfigError


@dataclass(slots=True)
class SplitItem:
    """One admitted action as the split sees it.

    `sizes` are its feasible unit counts, ascending (the first is its minimum). `cost(m)` is its
    duration on m units. Items of one `group` must have cost(m) = weight * g(m) for a shared g
    (same efficiency profile and sizes, `weight` = T1): then only the heaviest few of a group can
    profit from spare units, which keeps the exact split fast. `group=None` opts out of that.
    """

    sizes: tuple[int, ...]
    cost: Callable[[int], float]
    group: Hashable | None = None
    weight: float = 0.0


class TopologyOperator(ABC):
    """Base: usage and capacity are tuples compared element-wise; index 0 is total units."""

    name = "abstract"

    @abstractmethod
    def zero(self) -> tuple[int, ...]: ...

    @abstractmethod
    def charge(self, usage: tuple[int, ...], size: int) -> tuple[int, ...]: ...

    def sizes(self, options: Sequence[int]) -> tuple[int, ...]:
        """The subset of an action's feasible unit counts this topology can grant."""
        return tuple(options)

    @staticmethod
    def fits(usage: tuple[int, ...], capacity: tuple[int, ...]) -> bool:
        return all(u <= c for u, c in zip(usage, capacity, strict=True))

    @abstractmethod
    def split(self, items: Sequence[SplitItem], capacity: tuple[int, ...]) -> tuple[float, list[int]]: ...


class Fungible(TopologyOperator):
    """Interchangeable units (the cores of one node): capacity is `(free units,)`."""

    name = "fungible"

    def zero(self) -> tuple[int, ...]:
        return (0,)

    def charge(self, usage: tuple[int, ...], size: int) -> tuple[int, ...]:
        return (usage[0] + size,)

    def split(self, items: Sequence[SplitItem], capacity: tuple[int, ...]) -> tuple[float, list[int]]:
        mins = [it.sizes[0] for it in items]
        extra = capacity[0] - sum(mins)
        if extra < 0:
            raise ValueError(f"minimum units {sum(mins)} exceed capacity {capacity[0]}")
        costs0 = [it.cost(m) for it, m in zip(items, mins, strict=True)]
        alloc, total = list(mins), sum(costs0)
        if extra == 0:
            return total, alloc
        cands = _candidates(items, extra)
        tables = [_gain_table(items[i], mins[i], extra, costs0[i]) for i in cands]
        picks = _best_individual(tables, extra)
        if picks is None:
            picks = _knapsack(tables, extra)
        for i, (k, gain) in zip(cands, picks, strict=True):
            alloc[i] += k
            total -= gain
        return total, alloc


def _candidates(items: Sequence[SplitItem], extra: int) -> list[int]:
    """Items that can matter: in each group, the `extra` heaviest (at most `extra` items receive
    a spare unit, and within a group a heavier item gains more from the same units)."""
    out, groups = [], defaultdict(list)
    for i, it in enumerate(items):
        if len(it.sizes) < 2 or it.sizes[1] - it.sizes[0] > extra:
            continue
        if it.group is None:
            out.append(i)
        else:
            groups[it.group].append(i)
    for members in groups.values():
        members.sort(key=lambda i: -items[i].weight)
        out.extend(members[:extra])
    return sorted(out)


def _gain_table(it: SplitItem, m0: int, extra: int, c0: float) -> list[tuple[int, float]]:
    """(extra units, time saved) for each size within budget, with the zero option first."""
    return [(0, 0.0)] + [(m - m0, c0 - it.cost(m)) for m in it.sizes[1:] if m - m0 <= extra]


def _best_individual(tables, extra: int) -> list[tuple[int, float]] | None:
    """When every candidate's own best choice fits together, that is the exact optimum."""
    picks = [max(t, key=lambda kg: (kg[1], -kg[0])) for t in tables]
    return picks if sum(k for k, _ in picks) <= extra else None


def _knapsack(tables, extra: int) -> list[tuple[int, float]]:
    """Exact multiple-choice knapsack over spare units: maximise the total time saved."""
    best = np.zeros(extra + 1)
    choice = []
    for t in tables:
        new, arg = best.copy(), np.zeros(extra + 1, dtype=np.int32)
        for j, (k, gain) in enumerate(t[1:], start=1):
            if gain <= 0:
                continue
            cand = best[: extra + 1 - k] + gain
            better = cand > new[k:]
            new[k:][better] = cand[better]
            arg[k:][better] = j
        best = new
        choice.append(arg)
    picks, c = [], extra
    for t, arg in zip(reversed(tables), reversed(choice), strict=True):
        k, gain = t[int(arg[c])]
        picks.append((k, gain))
        c -= k
    return picks[::-1]


class Buddy(TopologyOperator):
    """GPUs in nodes of `node_size` (a power of two), granted as aligned power-of-two chunks.

    Capacity is (C_0, C_1, ..., C_L): C_k counts the GPUs in free aligned blocks of size >= 2^k.
    Usage U_k counts the GPUs of granted chunks of size >= 2^k. A set of chunks fits iff U <= C.
    """

    name = "buddy"

    def __init__(self, node_size: int = 8):
        if node_size < 1 or node_size & (node_size - 1):
            raise ConfigError("gpus_per_node", node_size, "a power of two")
        self.node_size = node_size
        self.levels = node_size.bit_length()

    def zero(self) -> tuple[int, ...]:
        return (0,) * self.levels

    def charge(self, usage: tuple[int, ...], size: int) -> tuple[int, ...]:
        top = size.bit_length() - 1
        return tuple(u + size if k <= top else u for k, u in enumerate(usage))

    def sizes(self, options: Sequence[int]) -> tuple[int, ...]:
        return tuple(m for m in options if 0 < m <= self.node_size and not m & (m - 1))

    def capacity(self, free_by_node: Sequence[Sequence[bool]]) -> tuple[int, ...]:
        """Level capacities from each node's per-GPU idle flags."""
        cap = [0] * self.levels
        for flags in free_by_node:
            for size in free_blocks(flags):
                for k in range(size.bit_length()):
                    cap[k] += size
        return tuple(cap)

    def split(self, items: Sequence[SplitItem], capacity: tuple[int, ...]) -> tuple[float, list[int]]:
        """DP over items; the state is the level-usage vector, so every plan it keeps can be placed."""
        states: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {self.zero(): (0.0, ())}
        for it in items:
            nxt: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {}
            for usage, (cost, plan) in states.items():
                for m in it.sizes:
                    u = self.charge(usage, m)
                    if not self.fits(u, capacity):
                        continue
                    c = cost + it.cost(m)
                    if u not in nxt or c < nxt[u][0]:
                        nxt[u] = (c, plan + (m,))
            if not nxt:
                raise ValueError("minimum units do not fit the free GPU blocks")
            states = nxt
        cost, plan = min(states.values(), key=lambda cp: (cp[0], sum(cp[1])))
        return cost, list(plan)


def free_block_spans(flags: Sequence[bool], start: int = 0, size: int | None = None) -> list[tuple[int, int]]:
    """(first GPU, size) of the maximal free aligned blocks of one node (buddy decomposition)."""
    size = len(flags) if size is None else size
    if all(flags[start : start + size]):
        return [(start, size)]
    if size == 1:
        return []
    half = size // 2
    return free_block_spans(flags, start, half) + free_block_spans(flags, start + half, half)


def free_blocks(flags: Sequence[bool]) -> list[int]:
    return [size for _, size in free_block_spans(flags)]


TOPOLOGIES: dict[str, type[TopologyOperator]] = {"fungible": Fungible, "buddy": Buddy}
