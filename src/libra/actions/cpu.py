"""CPU manager: "allocate on execution" of sandbox cores.

A trajectory's sandbox keeps its files and memory between actions but holds cores only while an
action runs. At its first action a trajectory is pinned to one node and its memory is reserved
there (the sandbox lives there from then on); each action then gets exclusive cores on that node,
preferring cores of one NUMA domain, and gives them back when it ends. Cores are named by the ids
the mechanism uses (simulated numbers, or the host's CPU ids for sched_setaffinity live).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libra.core.errors import ConfigError


@dataclass(slots=True)
class CpuNode:
    """One machine: its cores grouped by NUMA domain, and memory for sandboxes."""

    numa: list[list[int]]
    memory_gib: float

    @classmethod
    def uniform(cls, cores: int, numa_domains: int = 1, memory_gib: float = 256.0, first: int = 0) -> CpuNode:
        if cores < 1 or numa_domains < 1 or cores % numa_domains:
            raise ConfigError(
                "cores_per_node", cores, f"a positive multiple of numa_per_node ({numa_domains})"
            )
        per = cores // numa_domains
        return cls(
            [list(range(first + d * per, first + (d + 1) * per)) for d in range(numa_domains)], memory_gib
        )

    @property
    def cores(self) -> int:
        return sum(len(d) for d in self.numa)


class CpuManager:
    def __init__(self, nodes: Sequence[CpuNode]):
        if not nodes:
            raise ConfigError("cpu.nodes", [], "at least one node")
        self.nodes = list(nodes)
        self._free = [[set(d) for d in n.numa] for n in self.nodes]
        self._mem_free = [n.memory_gib for n in self.nodes]
        self._pins: dict[str, tuple[int, float]] = {}
        self._held: dict[str, tuple[int, tuple[int, ...]]] = {}

    # ---- trajectories ------------------------------------------------------------------------

    def node_of(self, traj: str) -> int | None:
        pin = self._pins.get(traj)
        return None if pin is None else pin[0]

    def pin(self, traj: str, memory_gib: float) -> int | None:
        """The trajectory's node, pinning it now if this is its first action. None: no node has
        the memory yet (the action waits until a trajectory ends)."""
        node = self.node_of(traj)
        if node is not None:
            return node
        fits = [i for i in range(len(self.nodes)) if self._mem_free[i] >= memory_gib]
        if not fits:
            return None
        node = max(fits, key=lambda i: (self.free_count(i), self._mem_free[i], -i))
        self._mem_free[node] -= memory_gib
        self._pins[traj] = (node, memory_gib)
        return node

    def unpin(self, traj: str) -> None:
        pin = self._pins.pop(traj, None)
        if pin is not None:
            self._mem_free[pin[0]] += pin[1]

    def can_ever_pin(self, memory_gib: float) -> bool:
        return any(n.memory_gib >= memory_gib for n in self.nodes)

    # ---- cores -------------------------------------------------------------------------------

    def free_count(self, node: int) -> int:
        return sum(len(d) for d in self._free[node])

    def busy_count(self) -> int:
        return sum(len(cores) for _, cores in self._held.values())

    def allocate(self, action_id: str, node: int, n: int) -> tuple[int, ...]:
        """Exclusive cores for one action: inside one NUMA domain when one has room (the fullest
        that fits, keeping big domains whole), else across the emptiest domains first."""
        if action_id in self._held:
            raise ValueError(f"action {action_id} already holds cores")
        doms = self._free[node]
        if n > self.free_count(node):
            raise ValueError(f"node {node} has {self.free_count(node)} free cores, {n} asked")
        fitting = [d for d in doms if len(d) >= n]
        order = [min(fitting, key=len)] if fitting else sorted(doms, key=len, reverse=True)
        got: list[int] = []
        for d in order:
            take = sorted(d)[: n - len(got)]
            d.difference_update(take)
            got.extend(take)
            if len(got) == n:
                break
        self._held[action_id] = (node, tuple(sorted(got)))
        return self._held[action_id][1]

    def release(self, action_id: str) -> None:
        node, cores = self._held.pop(action_id)
        for d, dom_cores in zip(self._free[node], self.nodes[node].numa, strict=True):
            members = set(dom_cores)
            d.update(c for c in cores if c in members)

    def held(self, action_id: str) -> tuple[int, tuple[int, ...]] | None:
        return self._held.get(action_id)
