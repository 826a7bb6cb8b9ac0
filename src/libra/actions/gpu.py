"""GPU service manager: "evict on execution" for reward models, teachers and other GPU services.

Instead of giving every service its own always-resident GPUs, services share a pool:

- every (service, DoP) pair keeps a copy of its GPU state in host memory, sharded for that DoP,
  and is restored onto a chunk of GPUs when an action needs it and it is not already there;
- GPUs keep whatever was loaded last; when memory is needed, entries are evicted least recently
  used first, with no write-back (the host copy is the truth);
- a chunk that already holds the service is preferred, so hot services rarely restore;
- one action runs per GPU at a time.

(service, DoP) pairs are separate services because their shards differ. Restoring moves each
GPU's shard over its own host link in parallel: state / (DoP * link bandwidth) plus a fixed part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from libra.actions.topology import Buddy, free_block_spans
from libra.core.errors import ConfigError


class GpuService(BaseModel):
    """A GPU service as the manager sees it: how big its state is and how fast it restores."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    name: str
    state_gib: float = Field(gt=0, description="weights and buffers that must be on the GPUs")
    workspace_gib: float = Field(4.0, ge=0, description="per-GPU activations, CUDA context, cache")
    restore_gbps: float = Field(24.0, gt=0, description="host-to-GPU copy rate per GPU, GB/s")
    restore_fixed_s: float = Field(0.5, ge=0, description="re-initialising the engine after a copy")

    def gib_per_gpu(self, dop: int) -> float:
        return self.state_gib / dop + self.workspace_gib

    def restore_s(self, dop: int) -> float:
        return self.restore_fixed_s + self.state_gib * 1.073741824 / (dop * self.restore_gbps)

    def dops(self, gpu_memory_gib: float, node_size: int) -> tuple[int, ...]:
        """Chunk sizes (powers of two up to a node) on which the service fits in memory."""
        out, d = [], 1
        while d <= node_size:
            if self.gib_per_gpu(d) <= gpu_memory_gib:
                out.append(d)
            d *= 2
        return tuple(out)


@dataclass(slots=True)
class _Entry:
    service: str
    dop: int
    node: int
    start: int
    last_used: float

    def gpus(self) -> range:
        return range(self.start, self.start + self.dop)


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    node: int
    gpus: tuple[int, ...]
    restore_s: float
    evicted: int


class GpuManager:
    def __init__(
        self, gpus_per_node: Sequence[int], gpu_memory_gib: float, services: Mapping[str, GpuService]
    ):
        for n in gpus_per_node:
            if n < 1 or n & (n - 1):
                raise ConfigError("gpus_per_node", n, "a power of two (GPUs are split buddy-fashion)")
        self.node_sizes = list(gpus_per_node)
        self.gpu_memory_gib = gpu_memory_gib
        self.services = dict(services)
        self.operator = Buddy(max(self.node_sizes))
        self._busy: list[list[str | None]] = [[None] * n for n in self.node_sizes]
        self._entries: list[_Entry] = []
        self._running: dict[str, tuple[_Entry, tuple[int, ...]]] = {}
        self.restores = 0

    @property
    def total(self) -> int:
        return sum(self.node_sizes)

    def busy_count(self) -> int:
        return sum(g is not None for node in self._busy for g in node)

    def idle_flags(self) -> list[list[bool]]:
        return [[g is None for g in node] for node in self._busy]

    def capacity(self) -> tuple[int, ...]:
        return self.operator.capacity(self.idle_flags())

    def resident_idle(self, service: str, dop: int) -> bool:
        """Is (service, dop) loaded on a chunk whose GPUs are all idle (so it starts without a restore)?"""
        return any(
            e.service == service and e.dop == dop and self._idle(e.node, e.start, dop) for e in self._entries
        )

    def _idle(self, node: int, start: int, size: int) -> bool:
        return all(g is None for g in self._busy[node][start : start + size])

    def place(self, action_id: str, service: str, dop: int, now: float) -> GpuPlacement:
        spec = self.services[service]
        chunks = [(n, s) for n, size in enumerate(self.node_sizes) for s in range(0, size - dop + 1, dop)]
        chunks = [(n, s) for n, s in chunks if self._idle(n, s, dop)]
        if not chunks:
            raise ValueError(f"no idle aligned chunk of {dop} GPUs")
        hit = [
            e for e in self._entries if (e.service, e.dop) == (service, dop) and (e.node, e.start) in chunks
        ]
        if hit:
            entry = max(hit, key=lambda e: e.last_used)
            entry.last_used = now
            return self._occupy(action_id, entry, 0.0, 0)
        node, start = min(chunks, key=lambda c: self._chunk_rank(*c, dop))
        evicted = self._make_room(node, start, dop, spec.gib_per_gpu(dop))
        entry = _Entry(service, dop, node, start, now)
        self._entries.append(entry)
        self.restores += 1
        return self._occupy(action_id, entry, spec.restore_s(dop), evicted)

    def _chunk_rank(self, node: int, start: int, dop: int) -> tuple:
        """Buddy best fit first (the smallest free block that holds the chunk), then the chunk
        whose contents were used longest ago (least recently used), then position."""
        flags = [g is None for g in self._busy[node]]
        block = _enclosing_free_block(flags, start, dop)
        recent = max(
            (e.last_used for e in self._entries if e.node == node and _overlaps(e, start, dop)), default=-1.0
        )
        return (block, recent, node, start)

    def _make_room(self, node: int, start: int, dop: int, need_gib: float) -> int:
        """Evict entries on the chunk's GPUs, least recently used first, until the new shard
        fits. No write-back: the host copy is authoritative."""
        evicted = 0
        for e in sorted(
            (e for e in self._entries if e.node == node and _overlaps(e, start, dop)),
            key=lambda e: e.last_used,
        ):
            if not self._over(node, start, dop, need_gib):
                break
            self._entries.remove(e)
            evicted += 1
        return evicted

    def _over(self, node: int, start: int, dop: int, need_gib: float) -> bool:
        for g in range(start, start + dop):
            used = sum(
                self.services[e.service].gib_per_gpu(e.dop)
                for e in self._entries
                if e.node == node and g in e.gpus()
            )
            if used + need_gib > self.gpu_memory_gib + 1e-9:
                return True
        return False

    def _occupy(self, action_id: str, entry: _Entry, restore_s: float, evicted: int) -> GpuPlacement:
        gpus = tuple(entry.gpus())
        for g in gpus:
            self._busy[entry.node][g] = action_id
        self._running[action_id] = (entry, gpus)
        return GpuPlacement(entry.node, gpus, restore_s, evicted)

    def release(self, action_id: str, now: float) -> None:
        entry, gpus = self._running.pop(action_id)
        for g in gpus:
            self._busy[entry.node][g] = None
        entry.last_used = now


def _overlaps(e: _Entry, start: int, size: int) -> bool:
    return e.start < start + size and start < e.start + e.dop


def _enclosing_free_block(flags: list[bool], start: int, size: int) -> int:
    """Size of the maximal free aligned block that contains the chunk [start, start + size)."""
    for b_start, b_size in free_block_spans(flags):
        if b_start <= start and start + size <= b_start + b_size:
            return b_size
    return size
