"""Talking to the other processes: the trainer replicas, and the engines through the gateway.

`Trainers` calls every replica at once (the step's samples split by tokens) and gathers their
answers; a replica that does not answer is a dead replica, and the run stops with
`TrainerLost`, naming the checkpoint to resume from.

`publish` is weight publication through the gateway's control broadcast: pause every engine
(SGLang's modes: `retract`, the default, sends in-flight requests back to the queue and recomputes
their KV with the new weights on resume, as AReaL's interruptible generation does; `in_place`
keeps them paused with the KV of the old weights), load the checkpoint's `model.pt`
(`update_weights_from_disk`, the engines' own model class, no conversion), resume. Tokens sampled
after the update carry the new `weight_version`, and with `in_place` the older version of the KV
they read (`token_kv_versions`), so the trainer never takes them for the new weights' own. Continue is sent even when the
update fails, so engines are never left paused.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from libra.runtime.train.batch import TrainSample, shard


class TrainerLost(RuntimeError):
    """A trainer replica died or its collective failed."""


class TrainerRefused(RuntimeError):
    """A replica refused the call for a reason that retrying cannot fix: a checkpoint it cannot
    use, or a step whose weights are not finite (its message says which)."""


class PublishFailed(RuntimeError):
    """The engines could not take the new weights."""


@dataclass(slots=True)
class TrainResult:
    version: int
    checkpoint: str | None  # the step's checkpoint folder; None between two (`checkpoint_every`)
    weights: str  # the file the engines load: the checkpoint's model.pt, or the weights alone
    seconds: float
    replicas: list[dict]

    @property
    def equal(self) -> bool:
        return len({r["fingerprint"] for r in self.replicas}) == 1

    def total(self, key: str) -> float:
        return sum(float(r[key]) for r in self.replicas)


class Trainers:
    def __init__(self, urls: list[str], http: aiohttp.ClientSession, timeout_s: float):
        self.urls, self.http = urls, http
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _post(self, url: str, path: str, body: dict) -> dict:
        # The warm-start runs many steps in one call: no deadline (the driver watches the processes,
        # and a replica whose peer died fails its collective within collective_timeout_s).
        timeout = aiohttp.ClientTimeout(total=None) if path == "/warmstart" else self.timeout
        try:
            async with self.http.post(url + path, json=body, timeout=timeout) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise TrainerLost(f"trainer {url} did not answer {path} ({type(e).__name__}: {e})") from None
        if r.status == 422 and isinstance(data, dict) and data.get("refused"):
            raise TrainerRefused(str(data.get("error")))
        if r.status != 200:
            raise TrainerLost(f"trainer {url} failed {path}: HTTP {r.status}: {data}")
        return data

    async def all(self, path: str, bodies: list[dict]) -> list[dict]:
        """Every replica at once; the first failure cancels the rest."""
        tasks = [asyncio.create_task(self._post(u, path, b)) for u, b in zip(self.urls, bodies, strict=True)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def warmstart(self) -> list[dict]:
        return await self.all("/warmstart", [{}] * len(self.urls))

    async def resume(self, path: str) -> list[dict]:
        return await self.all("/resume", [{"path": path}] * len(self.urls))

    async def train(self, step: int, samples: list[TrainSample], whole: bool = False, extra: dict | None = None) -> TrainResult:  # fmt: skip
        """One step. `whole`: every replica gets every sample and takes its share by the elastic
        membership; otherwise the driver splits them by tokens. `extra` goes into every body."""
        t0 = time.perf_counter()
        total = sum(s.n_model_tokens for s in samples)
        parts = [samples] * len(self.urls) if whole else shard(samples, len(self.urls))
        bodies = [
            {"step": step, "global_tokens": total, "samples": [s.model_dump() for s in part], **(extra or {})}
            for part in parts
        ]
        out = await self.all("/train", bodies)
        writer = next(r for r in out if r.get("weights"))  # rank 0
        return TrainResult(int(out[0]["version"]), writer.get("checkpoint"), writer["weights"], time.perf_counter() - t0, out)  # fmt: skip


@dataclass(slots=True)
class PublishResult:
    seconds: float
    engines: int
    lost: list[str] = field(default_factory=list)  # engines that were already down


class Publisher:
    def __init__(self, gateway_url: str, http: aiohttp.ClientSession, pause_mode: str, token: str | None, timeout_s: float = 120.0):  # fmt: skip
        self.url, self.http, self.mode = gateway_url.rstrip("/"), http, pause_mode
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _post(self, path: str, body: dict) -> dict:
        try:
            async with self.http.post(
                self.url + path, json=body, headers=self.headers, timeout=self.timeout
            ) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise PublishFailed(f"gateway {path}: {type(e).__name__}: {e}") from None
        if r.status >= 400 and not isinstance(data, dict):
            raise PublishFailed(f"gateway {path}: HTTP {r.status}: {data}")
        return data

    async def pause(self) -> None:
        """Every engine stops stepping (the publish pause mode) until the next publication
        continues them: the colocated pipeline's turn for training."""
        await self._post("/pause_generation", {"mode": self.mode})

    async def publish(self, model_path: str, version: int) -> PublishResult:
        t0 = time.perf_counter()
        await self.pause()
        try:
            res = await self._post("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)})  # fmt: skip
        finally:
            await self._post("/continue_generation", {})
        results = res.get("results") or {}
        failed = [
            eid
            for eid, r in results.items()
            if not (isinstance(r, dict) and r.get("success", r.get("ok", True)))
        ]
        down = await self._down()
        if [e for e in failed if e not in down] or not results:
            raise PublishFailed(f"engines did not load weights version {version}: {res}")
        return PublishResult(time.perf_counter() - t0, len(results) - len(failed), failed)

    async def _down(self) -> set[str]:
        """Engines the gateway has taken out (killed or unhealthy): a failed update there is no
        split-brain, since they get no turns."""
        try:
            async with self.http.get(self.url + "/admin/instances", headers=self.headers, timeout=self.timeout) as r:  # fmt: skip
                data = await r.json(content_type=None)
            return {i["id"] for i in data["instances"] if not i["routable"]}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            return set()

    async def end_step(self) -> None:
        """The RL step ended: the gateway's router rebuilds its tree every K steps."""
        async with self.http.post(self.url + "/steps/end", json={}, headers=self.headers, timeout=self.timeout) as r:  # fmt: skip
            await r.read()
