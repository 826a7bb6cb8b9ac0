"""The elastic hybrid pool of `libra train`: rollout engines that become trainer replicas and back.

The controller (`libra.planner`, pure) decides; this module moves processes, never blocking the
core's training (every slow part runs as a background task):

- borrow: the slot's `HybridReplica` goes ROLLOUT -> REQUESTED; its engine is drained through the
  gateway (no new turns, outstanding reaches 0, removed), stopped, and a hybrid trainer
  (`hybrid.py`) starts in its slot and joins through `libra.runtime.elastic` (FETCHING_STATE ->
  ZERO_SYNC -> ACTIVATING -> ACTIVE, driven by its core partner). After each step the driver
  mirrors the core's view of the join (`sync`) into the replica the controller reads;
- release: the replica goes RELEASING; the next step's /train asks the core to let it go at the
  step's end; the hybrid process says goodbye and exits; an engine starts in its slot and, at the
  next step boundary, loads the newest weights and is added to the gateway again -> ROLLOUT;
- any failure (drain timeout, the process dies or cannot start, the core rolls the join back):
  the hybrid process is stopped and the slot returns to rollout the same way (a rollback).

Which engines are hybrid: the last instances of buckets that have more than one, so every bucket
keeps an engine. Live elastic runs with the `local` launcher (a process started after the run's
start has no reserved bundle on Ray).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp

from libra.core.errors import ConfigError
from libra.planner import ElasticDecision, HybridReplica, JoinState, PoolView
from libra.runtime.launch.base import LISTENING, LaunchError, ProcessSpec, wait_for_line
from libra.runtime.train import cluster as procs
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.config import TrainConfig
from libra.runtime.train.gateway_admin import AdminFailed, GatewayAdmin

log = logging.getLogger(__name__)
JOIN_PATH = (JoinState.FETCHING_STATE, JoinState.ZERO_SYNC, JoinState.ACTIVATING, JoinState.ACTIVE)


@dataclass(slots=True)
class Slot:
    index: int
    engine: ProcessSpec  # the engine this slot runs while it serves rollout
    backend: dict  # how the gateway knows it (url filled in when it runs)
    replica: HybridReplica
    hybrid: procs.Proc | None = None  # the trainer process while it is borrowed
    task: asyncio.Task | None = None
    ready: procs.Proc | None = None  # an engine restarted, to be re-added at the next boundary
    failed: str = ""  # why the join is being rolled back ("" when it is not)


@dataclass(slots=True)
class PoolCounts:
    joins: int = 0  # borrows started
    releases: int = 0  # replicas given back cleanly
    rollbacks: int = 0
    events: list[str] = field(default_factory=list)  # what happened since the last step record


class HybridPool:
    def __init__(
        self, cfg: TrainConfig, cluster: procs.Cluster, admin: GatewayAdmin, http: aiohttp.ClientSession
    ):
        self.cfg, self.cluster, self.admin, self.http = cfg, cluster, admin, http
        self.slots = _choose(cfg, cluster)
        self.counts = PoolCounts()
        self.releasing: list[int] = []
        self.core_status: dict = {}

    # ---- what the controller reads -------------------------------------------------------------

    def view(self) -> PoolView:
        by_name = {b.name: b for b in self.cfg.buckets}
        serving = sum(by_name[p.bucket].tp for p in self.cluster.of("engine"))
        return PoolView([s.replica for s in self.slots], self.cfg.trainer.replicas, serving,
                        self.cfg.rollout.groups_per_step)  # fmt: skip

    # ---- carrying out a decision ---------------------------------------------------------------

    def carry_out(self, dec: ElasticDecision | None) -> None:
        if dec is None:
            return
        for j in dec.joins:
            slot = next(s for s in self.slots if s.replica.id == j.replica)
            gen = slot.replica.request_join()
            self.counts.joins += 1
            self._event(slot, f"borrow: {dec.reason}")
            slot.task = asyncio.create_task(self._borrow(slot, gen), name=f"borrow {slot.index}")
        for r in dec.releases:
            slot = next(s for s in self.slots if s.replica.id == r.replica)
            if slot.replica.release(r.generation):
                self.releasing.append(slot.index)
                self._event(slot, f"release: {dec.reason}")

    def take_releases(self) -> list[int]:
        """Slots the core lets go at the end of the coming step (sent with its /train)."""
        out, self.releasing = self.releasing, []
        return out

    async def _borrow(self, slot: Slot, gen: int) -> None:
        name = slot.engine.name
        try:
            await self.admin.drain_and_remove(name, self.cfg.elastic.drain_timeout_s)
        except AdminFailed as e:  # the engine still serves: nothing to restart
            slot.replica.fail(gen)
            self.counts.rollbacks += 1
            self._event(slot, f"rollback: {e}")
            return
        await asyncio.to_thread(self._stop_engine, name)
        try:
            slot.hybrid = await asyncio.to_thread(self._start_hybrid, slot)
            self._event(slot, f"trainer started in {name}'s slot")
        except LaunchError as e:
            self._fail(slot, f"hybrid trainer did not start: {str(e)[:200]}")

    def _stop_engine(self, name: str) -> None:
        for p in [p for p in self.cluster.procs if p.role == "engine" and p.handle.name == name]:
            p.handle.stop(timeout=10.0)
            self.cluster.procs.remove(p)

    def _start_hybrid(self, slot: Slot) -> procs.Proc:
        spec = procs.hybrid_spec(self.cfg, self.cluster.run, slot.index, self.cluster.store)
        p = procs.Proc("hybrid", self.cluster.launcher.start(spec))
        self.cluster.procs.append(p)
        p.url = wait_for_line(p.handle, LISTENING, procs.START_TIMEOUT_S).group(1)
        return p

    # ---- each step --------------------------------------------------------------------------------

    async def feed(self, step: int, samples: list[TrainSample], total: int) -> None:
        """Every running hybrid replica gets the step (its share is the membership's business)."""
        body = {"step": step, "global_tokens": total, "samples": [s.model_dump() for s in samples]}
        for slot in self.slots:
            if slot.hybrid is not None and slot.hybrid.url:
                try:
                    async with self.http.post(slot.hybrid.url + "/samples", json=body) as r:
                        await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass  # a dead replica: the core computes its share; `sync` rolls it back

    def sync(self, status: dict | None) -> None:
        """After a step: mirror the core partner's view of each join, and notice ended processes."""
        self.core_status = status or {}
        states = self.core_status.get("states") or []
        for slot in self.slots:
            r = slot.replica
            if slot.index < len(states) and r.state in (*JOIN_PATH[:-1], JoinState.REQUESTED):
                _advance(r, JoinState[states[slot.index]])
            done = slot.hybrid is not None and slot.hybrid.handle.returncode() is not None
            if done and not slot.failed and slot.ready is None and (slot.task is None or slot.task.done()):
                ok = r.state == JoinState.RELEASING
                self._event(slot, "the replica left at the step boundary" if ok else "the join ended")
                if not ok:
                    slot.failed = "the hybrid trainer exited (rolled back by its partner)"
                slot.task = asyncio.create_task(self._restart(slot), name=f"restart {slot.index}")

    def _fail(self, slot: Slot, why: str) -> None:
        slot.failed = why
        self._event(slot, f"rollback: {why}")
        slot.task = asyncio.create_task(self._restart(slot), name=f"restart {slot.index}")

    async def _restart(self, slot: Slot) -> None:
        """Stop the hybrid process, start the engine; it joins the gateway at the next boundary."""
        if slot.hybrid is not None:
            await asyncio.to_thread(slot.hybrid.handle.stop, 10.0)
            self.cluster.procs.remove(slot.hybrid)
            slot.hybrid = None
        try:
            slot.ready = await asyncio.to_thread(self._start_engine, slot)
        except LaunchError as e:
            self._event(slot, f"engine did not restart: {str(e)[:200]}")

    def _start_engine(self, slot: Slot) -> procs.Proc:
        p = procs.Proc("engine", self.cluster.launcher.start(slot.engine), bucket=slot.backend["bucket"])
        p.url = wait_for_line(p.handle, LISTENING, procs.START_TIMEOUT_S).group(1)
        return p

    async def boundary(self, model_path: str, version: int) -> None:
        """Restarted engines load the newest weights and serve again (between publications, so
        none misses a version)."""
        for slot in self.slots:
            p = slot.ready
            if p is None:
                continue
            slot.ready = None
            try:
                await self._load(p.url, model_path, version)
                await self.admin.add({**slot.backend, "url": p.url})
            except (AdminFailed, aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._event(slot, f"engine could not rejoin the gateway: {e}")
                await asyncio.to_thread(p.handle.stop, 10.0)
                continue
            self.cluster.procs.append(p)
            self._back_to_rollout(slot)

    def _back_to_rollout(self, slot: Slot) -> None:
        r = slot.replica
        if slot.failed:
            r.fail(r.generation)
            self.counts.rollbacks += 1
            self._event(slot, f"back in rollout after a rollback ({slot.failed})")
            slot.failed = ""
        else:
            r.released(r.generation)
            self.counts.releases += 1
            self._event(slot, "back in rollout with the newest weights")

    async def _load(self, url: str, model_path: str, version: int) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.publish.admin_token}"} if self.cfg.publish.admin_token else {}  # fmt: skip
        body = {"model_path": model_path, "weight_version": str(version)}
        async with self.http.post(url + "/update_weights_from_disk", json=body, headers=headers) as r:
            data = await r.json(content_type=None)
        if r.status != 200 or not data.get("success", data.get("ok", True)):
            raise AdminFailed(f"{url} did not load {model_path}: {str(data)[:200]}")

    # ---- what steps.json says --------------------------------------------------------------------

    def record(self) -> dict:
        c, events = self.counts, self.counts.events
        self.counts.events = []
        return {
            "joins": c.joins,
            "releases": c.releases,
            "rollbacks": c.rollbacks,
            # the core's count: a replica being released still trains until the step boundary
            "hybrid_active": int(self.core_status.get("hybrid_active", 0)),
            "states": {s.replica.id: s.replica.state.name for s in self.slots},
            "core": self.core_status,
            "events": events,
        }

    def _event(self, slot: Slot, what: str) -> None:
        log.info("%s: %s", slot.replica.id, what)
        self.counts.events.append(f"{slot.replica.id}: {what}")

    async def stop(self) -> None:
        for slot in self.slots:
            if slot.task is not None:
                slot.task.cancel()
            if slot.ready is not None:
                await asyncio.to_thread(slot.ready.handle.stop, 10.0)


def _advance(r: HybridReplica, core: JoinState) -> None:
    """Move the driver's replica along the join path up to the core's state (never backwards)."""
    steps = {JoinState.FETCHING_STATE: r.begin_fetch, JoinState.ZERO_SYNC: r.state_fetched,
             JoinState.ACTIVATING: r.propose_activation, JoinState.ACTIVE: r.activate}  # fmt: skip
    if core not in JOIN_PATH:
        return
    for state in JOIN_PATH[: JOIN_PATH.index(core) + 1]:
        if r.state < state:
            steps[state](r.generation)


def _choose(cfg: TrainConfig, cluster: procs.Cluster) -> list[Slot]:
    """The hybrid slots: the last instances of buckets with more than one (each bucket keeps one)."""
    specs = {s.name: (s, b) for s, b in procs.engine_specs(cfg, cluster.run / "logs")}
    by_name = {b.name: b for b in cfg.buckets}
    spare = [name for name, (_, b) in specs.items() if not name.endswith("-0")]
    if len(spare) < cfg.elastic.hybrid:
        raise ConfigError("elastic.hybrid", cfg.elastic.hybrid, f"at most {len(spare)} (engines beyond the first of each bucket)")  # fmt: skip
    out = []
    for k, name in enumerate(spare[-cfg.elastic.hybrid :]):
        spec, bucket = specs[name]
        b = by_name[bucket]
        backend = {"bucket": bucket, "tp": b.tp, "max_context": b.max_context, "name": name}
        out.append(Slot(k, spec, backend, HybridReplica(f"hybrid-{k}", gpus=b.tp)))
    return out


class StaticPool:
    """`elastic.enabled: false`: no hybrid replica; the same calls do nothing."""

    def view(self) -> None:
        return None

    def carry_out(self, dec: ElasticDecision | None) -> None:
        return None

    def take_releases(self) -> list[int]:
        return []

    async def feed(self, step: int, samples: list[TrainSample], total: int) -> None:
        return None

    def sync(self, status: dict | None) -> None:
        return None

    async def boundary(self, model_path: str, version: int) -> None:
        return None

    def record(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def make_pool(cfg: TrainConfig, cluster: procs.Cluster, admin: GatewayAdmin, http: aiohttp.ClientSession) -> HybridPool | StaticPool:  # fmt: skip
    return HybridPool(cfg, cluster, admin, http) if cfg.elastic.enabled else StaticPool()
