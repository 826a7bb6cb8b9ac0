"""The backend pool: every engine instance the gateway routes to, its health and its admin state.

Each backend is an `InstanceView` (what the router sees) plus what only the mechanism needs: its
URL, its admin state and its health. Two things decide whether the router may pick it, and they
are kept apart because they change for different reasons:

- the admin state (`AdminState`: ACTIVE -> DRAINING -> REMOVED), changed by an operator or the
  elastic pool through the admin API. A draining instance finishes what it has but gets no new
  turns, so its sessions move (re-prefill) and it can be released without cutting a request;
- the health (`Health`: UNKNOWN, UP, DOWN), changed by periodic checks and by failed requests.
  A refused connection takes an instance out at once; a check that passes brings it back.

`view.healthy` is kept equal to "ACTIVE and UP", so the router never names an instance the gateway
would not send to. `outstanding` is kept current by the request path (incremented at dispatch,
decremented when the response is done), which is the load the placement rule balances.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import IntEnum

import aiohttp
from yarl import URL

from libra.core.errors import ConfigError, LibraError
from libra.rollout.base import Bucket, InstanceView
from libra.runtime.gateway.config import BackendConfig, HealthConfig

log = logging.getLogger("libra.gateway")


# The generation endpoints the gateway routes, by the kind of request (OpenAI's and SGLang's).
ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "tokens": "/inference/v1/generate",  # vLLM's token-in/token-out API (SkyRL)
}


class AdminState(IntEnum):
    ACTIVE = 0
    DRAINING = 1
    REMOVED = 2


class Health(IntEnum):
    UNKNOWN = 0
    UP = 1
    DOWN = 2


class StateError(LibraError):
    """An admin transition that the instance's current state does not allow (HTTP 409)."""


@dataclass(slots=True)
class Instance:
    cfg: BackendConfig
    view: InstanceView
    bucket_name: str
    state: AdminState = AdminState.ACTIVE
    health: Health = Health.UNKNOWN
    failed_checks: int = 0
    models: tuple[str, ...] = ()
    cards: tuple[dict, ...] = ()  # the backend's /v1/models cards, as it sent them
    last_error: str = ""
    misfit: str = ""  # why it can never be routable (a max_context its model cannot hold)
    changed_at: float = field(default_factory=time.monotonic)
    # Precomputed once, as parsed URLs and a ready header set: the hot path must not parse URLs or
    # build these per request.
    urls: dict[str, URL] = field(default_factory=dict)  # by endpoint kind: "chat", "completions"
    headers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.urls = {kind: URL(self.cfg.url + path) for kind, path in ENDPOINTS.items()}
        self.headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            self.headers["Authorization"] = "Bearer " + self.cfg.api_key

    @property
    def id(self) -> str:
        return self.view.id

    # ---- admin transitions: each checks where it starts ---------------------------------------

    def drain(self) -> None:
        self._expect("drain", AdminState.ACTIVE)
        self._set(AdminState.DRAINING)

    def resume(self) -> None:
        self._expect("resume", AdminState.DRAINING)
        self._set(AdminState.ACTIVE)

    def remove(self) -> None:
        self._expect("remove", AdminState.ACTIVE, AdminState.DRAINING)
        self._set(AdminState.REMOVED)

    def _expect(self, action: str, *allowed: AdminState) -> None:
        if self.state not in allowed:
            names = " or ".join(s.name.lower() for s in allowed)
            raise StateError(f"instance {self.id!r} is {self.state.name.lower()}; {action} needs it {names}")

    def _set(self, state: AdminState) -> None:
        self.state = state
        self.changed_at = time.monotonic()
        self._sync()

    # ---- health transitions ------------------------------------------------------------------

    def mark_up(self) -> bool:
        """A passing check. True when this brings the instance (back) up."""
        self.failed_checks = 0
        was = self.health
        self.health = Health.UP
        self.last_error = self.misfit  # an error that no longer holds is not shown
        self._sync()
        return was != Health.UP

    def mark_down(self, reason: str) -> bool:
        """A failure that takes the instance out now. True when it was not down already."""
        was = self.health
        self.health, self.last_error = Health.DOWN, reason
        self._sync()
        return was != Health.DOWN

    def check_failed(self, reason: str, threshold: int) -> bool:
        """A failed check: out after `threshold` in a row (an instance never seen up: at once)."""
        self.failed_checks += 1
        if self.failed_checks >= threshold or self.health == Health.UNKNOWN:
            return self.mark_down(reason)
        return False

    def _sync(self) -> None:
        self.view.healthy = self.state == AdminState.ACTIVE and self.health == Health.UP and not self.misfit

    def learn(self, cards: tuple[dict, ...]) -> None:
        """What the backend serves (its /v1/models): model names, and whether its context holds
        the bucket's max_context (vLLM and the built-in engine report `max_model_len`)."""
        self.cards = cards
        self.models = tuple(c["id"] for c in cards)
        holds = self.holds_at_most()
        if holds is not None and self.cfg.max_context > holds:
            self.misfit = f"max_context {self.cfg.max_context} exceeds the backend's max_model_len {holds} (its /v1/models)"  # fmt: skip
            self.last_error = self.misfit
            self._sync()

    def holds_at_most(self) -> int | None:
        """The longest context the backend says it holds (its /v1/models max_model_len), if known."""
        lens = [c["max_model_len"] for c in self.cards if isinstance(c.get("max_model_len"), int)]
        return max(lens) if lens else None

    def describe(self) -> dict:
        return {
            "id": self.id,
            "url": self.cfg.url,
            "bucket": self.bucket_name,
            "bucket_index": self.view.bucket,
            "tp": self.view.tp,
            "max_context": self.cfg.max_context,
            "node": self.view.node,
            "cap": self.view.cap,
            "state": self.state.name.lower(),
            "health": self.health.name.lower(),
            "routable": self.view.healthy,
            "outstanding": self.view.outstanding,
            "models": list(self.models),
            "control": self.cfg.control,
            "last_error": self.last_error,
        }


class Pool:
    """The instances by id, and the list of views the router is given (removed ones leave it)."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.bucket_index = {b.name: i for i, b in enumerate(buckets)}
        self.instances: dict[str, Instance] = {}
        self.views: list[InstanceView] = []
        # Set whenever some instance is routable; requests with nowhere to go wait on it.
        self.routable = asyncio.Event()

    def add(self, cfg: BackendConfig) -> Instance:
        if cfg.id in self.instances and self.instances[cfg.id].state != AdminState.REMOVED:
            raise StateError(f"instance {cfg.id!r} already exists")
        b = self.bucket_index.get(cfg.bucket)
        if b is None:
            raise ConfigError("bucket", cfg.bucket, sorted(self.bucket_index))
        bucket = self.buckets[b]
        for key in ("tp", "max_context"):
            mine, its = getattr(cfg, key), getattr(bucket, key)
            if mine is not None and mine != its:
                raise ConfigError(key, mine, f"{its}, the value of bucket {bucket.name!r}")
        cfg = cfg.model_copy(update={"tp": bucket.tp, "max_context": bucket.max_context})
        view = InstanceView(cfg.id, b, bucket.tp, 0, cfg.cap, False, cfg.node)
        inst = Instance(cfg, view, bucket.name)
        self.instances[cfg.id] = inst
        self._rebuild_views()
        return inst

    def get(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state == AdminState.REMOVED:
            raise KeyError(instance_id)
        return inst

    def remove(self, inst: Instance) -> None:
        inst.remove()
        self._rebuild_views()
        self.refresh()

    def mark_down(self, inst: Instance, reason: str) -> bool:
        """A request to `inst` could not connect: out now, without waiting for a health check."""
        changed = inst.mark_down(reason)
        self.refresh()
        return changed

    def refresh(self) -> None:
        """Recompute the 'some instance is routable' event after any state change."""
        if any(v.healthy for v in self.views):
            self.routable.set()
        else:
            self.routable.clear()

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.state != AdminState.REMOVED]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for inst in self.live():
            seen.update(dict.fromkeys(inst.models))
        return list(seen)

    def cards(self) -> dict[str, dict]:
        """One card per served model, as a backend sent it, with the largest `max_model_len`
        among the backends that serve it (the gateway holds a session up to its largest bucket)."""
        out: dict[str, dict] = {}
        for inst in self.live():
            for card in inst.cards:
                have = out.setdefault(card["id"], dict(card))
                mine, best = card.get("max_model_len"), have.get("max_model_len")
                if isinstance(mine, int) and (not isinstance(best, int) or mine > best):
                    have["max_model_len"] = mine
        return out

    def _rebuild_views(self) -> None:
        # The router reads this list on every turn; rebuilding it only on admin changes keeps the
        # hot path free of filtering.
        self.views = [i.view for i in self.instances.values() if i.state != AdminState.REMOVED]


class HealthChecker:
    """Checks every live instance each `interval_s`; learns served models when one comes up."""

    def __init__(self, pool: Pool, cfg: HealthConfig, http: aiohttp.ClientSession, on_change=None):
        self.pool, self.cfg, self.http = pool, cfg, http
        self.on_change = on_change or (lambda inst, up: None)
        self.timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self._probing: set[str] = set()

    async def run(self) -> None:
        """Check forever (the gateway runs one `check_all` before it starts serving)."""
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self.pool.live()))

    def probe_soon(self, inst: Instance) -> None:
        """Check one instance now (after a request to it failed), once at a time."""
        if inst.id not in self._probing:
            self._probing.add(inst.id)
            asyncio.get_running_loop().create_task(self._probe(inst))

    async def _probe(self, inst: Instance) -> None:
        try:
            await self.check(inst, threshold=1)
        finally:
            self._probing.discard(inst.id)

    async def check(self, inst: Instance, threshold: int | None = None) -> bool:
        try:
            async with self.http.get(inst.cfg.url + self.cfg.path, timeout=self.timeout) as r:
                await r.read()
                ok, why = r.status == 200, f"health check returned HTTP {r.status}"
        # ValueError: a host name the resolver refuses to encode (BackendConfig refuses most)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            ok, why = False, f"health check failed: {type(e).__name__}: {e}"
        if inst.state == AdminState.REMOVED:
            return False
        if ok:
            if not inst.models:
                inst.learn(await self._cards(inst))
            if inst.mark_up():
                log.info("instance %s is up", inst.id)
                self._changed(inst, True)
        elif inst.check_failed(why, threshold or self.cfg.failures):
            log.warning("instance %s taken out: %s", inst.id, why)
            self._changed(inst, False)
        return ok

    async def _cards(self, inst: Instance) -> tuple[dict, ...]:
        """The model cards the backend serves (its /v1/models); none if it does not say."""
        try:
            async with self.http.get(inst.cfg.url + "/v1/models", timeout=self.timeout) as r:
                data = await r.json(content_type=None)
            cards = data.get("data", [])
            return tuple(m for m in cards if isinstance(m, dict) and isinstance(m.get("id"), str))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError, TypeError, RecursionError):  # fmt: skip
            return ()

    def _changed(self, inst: Instance, up: bool) -> None:
        self.pool.refresh()
        self.on_change(inst, up)
