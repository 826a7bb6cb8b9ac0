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
import time
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
DRAINED_STOP_S = 3.0  # how long a drained engine gets to exit on SIGTERM
RETIRE_WAIT_S = 15.0  # how long a released trainer may take to exit after its goodbye
JOIN_PATH = (JoinState.FETCHING_STATE, JoinState.ZERO_SYNC, JoinState.ACTIVATING, JoinState.ACTIVE)


@dataclass(slots=True)
class Slot:
    index: int
    engine: ProcessSpec  # the engine this slot runs while it serves rollout
    backend: dict  # how the gateway knows it (url filled in when it runs)
    replica: HybridReplica
    hybrid: procs.Proc | None = None  # the slot's trainer process: on standby, or joined while borrowed
    joined: bool = False  # the hybrid process was told to join
    standby: asyncio.Task | None = None  # prestarting the hybrid trainer
    task: asyncio.Task | None = None  # the borrow in progress
    engine_next: asyncio.Task | None = None  # the engine (re)starting for the slot's return to rollout
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

    def slot_engines(self) -> list[str]:
        """The engines that are hybrid slots (the fleet never moves them between buckets)."""
        return [s.engine.name for s in self.slots]

    def prestart(self) -> None:
        """Start each slot's hybrid trainer on standby in the background (it waits for /join)."""
        for slot in self.slots:
            slot.standby = asyncio.create_task(self._standby(slot), name=f"standby {slot.index}")

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
                # Its engine starts now, while the replica trains its last step, so the slot
                # can serve again at that step's boundary.
                self._restart_engine(slot)

    def take_releases(self) -> list[int]:
        """Slots the core lets go at the end of the coming step (sent with its /train)."""
        out, self.releasing = self.releasing, []
        return out

    async def _borrow(self, slot: Slot, gen: int) -> None:
        name, t0 = slot.engine.name, time.monotonic()
        try:
            await self.admin.drain_and_remove(name, self.cfg.elastic.drain_timeout_s)
        except AdminFailed as e:  # the engine still serves: nothing to restart
            slot.replica.fail(gen)
            self.counts.rollbacks += 1
            self._event(slot, f"rollback: {e}")
            return
        t1 = time.monotonic()
        await asyncio.to_thread(self._stop_engine, name)
        t2 = time.monotonic()
        try:
            if slot.standby is not None:
                await slot.standby
            if slot.hybrid is None:  # the standby did not start: one more try, on the critical path
                await self._standby(slot)
            if slot.hybrid is None:
                raise LaunchError("no hybrid trainer")
            await self._post(slot.hybrid.url + "/join")
        except (LaunchError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._fail(slot, f"hybrid trainer did not join: {str(e)[:200]}")
            return
        slot.joined = True
        took = f"drained in {t1 - t0:.1f} s, engine stopped in {t2 - t1:.1f} s"
        self._event(slot, f"trainer joins in {name}'s slot: {took}, standby trainer told to join "
                          f"{time.monotonic() - t2:.1f} s later")  # fmt: skip

    async def _post(self, url: str) -> None:
        async with self.http.post(url, json={}, timeout=aiohttp.ClientTimeout(total=30)) as r:
            await r.read()
            r.raise_for_status()

    def _stop_engine(self, name: str) -> None:
        for p in [p for p in self.cluster.procs if p.role == "engine" and p.handle.name == name]:
            # Drained: nothing in flight, so a short grace (then SIGKILL) loses nothing; the
            # engine's own shutdown waits for its generation thread, ~10 s on a loaded machine.
            p.handle.stop(timeout=DRAINED_STOP_S)
            self.cluster.remove(p)

    async def _standby(self, slot: Slot) -> None:
        t0 = time.monotonic()
        try:
            slot.hybrid = await asyncio.to_thread(self._start_hybrid, slot)
            self._event(slot, f"hybrid trainer on standby ({time.monotonic() - t0:.1f} s to start)")
        except LaunchError as e:
            self._event(slot, f"hybrid trainer did not start: {str(e)[:200]}")

    def _start_hybrid(self, slot: Slot) -> procs.Proc:
        spec = procs.hybrid_spec(self.cfg, self.cluster.run, slot.index, self.cluster.store)
        p = procs.Proc("hybrid", self.cluster.launcher.start(spec))
        self.cluster.add(p)
        p.url = wait_for_line(p.handle, LISTENING, procs.START_TIMEOUT_S).group(1)
        self.cluster.write_index()
        return p

    # ---- each step --------------------------------------------------------------------------------

    async def feed(self, step: int, samples: list[TrainSample], total: int) -> None:
        """Every joined hybrid replica gets the step (its share is the membership's business)."""
        body = {"step": step, "global_tokens": total, "samples": [s.model_dump() for s in samples]}
        for slot in self.slots:
            if slot.joined and slot.hybrid is not None:
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
            ended = slot.joined and slot.hybrid is not None and slot.hybrid.handle.returncode() is not None
            if ended and not slot.failed and r.state != JoinState.RELEASING:
                self._fail(slot, "the hybrid trainer exited (rolled back by its partner)")

    def _left(self, slot: Slot) -> bool:
        """The core no longer counts a releasing replica (it let it go at the last step's end)."""
        states = self.core_status.get("states") or []
        core = states[slot.index] if slot.index < len(states) else "ACTIVE"
        return slot.replica.state == JoinState.RELEASING and core != JoinState.ACTIVE.name

    def _fail(self, slot: Slot, why: str) -> None:
        slot.failed = why
        self._event(slot, f"rollback: {why}")
        self._restart_engine(slot)

    def _restart_engine(self, slot: Slot) -> None:
        if slot.engine_next is None:
            slot.engine_next = asyncio.create_task(self._start_engine(slot), name=f"engine {slot.index}")

    async def _start_engine(self, slot: Slot) -> procs.Proc:
        t0 = time.monotonic()
        p = procs.Proc("standby", self.cluster.launcher.start(slot.engine), bucket=slot.backend["bucket"])
        self.cluster.add(p)  # stopped with the run whatever happens
        p.url = (await asyncio.to_thread(wait_for_line, p.handle, LISTENING, procs.START_TIMEOUT_S)).group(1)
        self._event(slot, f"engine started ({time.monotonic() - t0:.1f} s), not yet serving")
        return p

    async def boundary(self, model_path: str, version: int) -> None:
        """Slots whose trainer has left (released at the last step's end, or rolled back) serve
        again: the engine started for them loads the newest weights and is added to the gateway
        (between publications, so it misses no version); a new hybrid trainer goes on standby."""
        for slot in self.slots:
            t = slot.engine_next
            if t is None or not t.done() or not (slot.failed or self._left(slot)):
                continue
            slot.engine_next = None
            if t.exception() is not None:
                self._event(slot, f"engine did not start: {str(t.exception())[:200]}; trying again")
                self._restart_engine(slot)
                continue
            await self._retire_hybrid(slot)
            p = t.result()
            try:
                await self._load(p.url, model_path, version)
                await self.admin.add({**slot.backend, "url": p.url})
            except (AdminFailed, aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._event(slot, f"engine could not rejoin the gateway: {e}; trying again")
                await asyncio.to_thread(p.handle.stop, 10.0)
                self.cluster.remove(p)
                self._restart_engine(slot)
                continue
            p.role = "engine"
            self.cluster.write_index()
            self._back_to_rollout(slot)
            slot.standby = asyncio.create_task(self._standby(slot), name=f"standby {slot.index}")

    async def _retire_hybrid(self, slot: Slot) -> None:
        """A released trainer exits by itself after its goodbye; give it a moment, then stop it."""
        p, slot.hybrid, slot.joined = slot.hybrid, None, False
        if p is None:
            return
        deadline = time.monotonic() + RETIRE_WAIT_S
        while p.handle.returncode() is None and time.monotonic() < deadline and not slot.failed:
            await asyncio.sleep(0.1)
        await asyncio.to_thread(p.handle.stop, 10.0)
        self.cluster.remove(p)

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
        """Cancel what is in flight; every process the pool started is in the cluster's list,
        which the driver stops."""
        for slot in self.slots:
            for t in (slot.standby, slot.task, slot.engine_next):
                if t is not None:
                    t.cancel()


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

    def prestart(self) -> None:
        return None

    def slot_engines(self) -> list[str]:
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
