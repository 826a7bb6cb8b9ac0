"""The gateway's admin API as the driver uses it: read the pool, drain, remove and add engines,
move the bucket boundaries.

The elastic pool moves an engine out of rollout only through these calls (drain: no new turns;
wait until its outstanding requests reach 0; remove), and back in by adding it again, so the
router always knows which engines serve; the rollout pressure the planner reads comes from the
same listing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp


class AdminFailed(RuntimeError):
    """The gateway refused or did not answer an admin call."""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    id: str
    bucket: str
    outstanding: int
    routable: bool


class GatewayAdmin:
    def __init__(self, url: str, http: aiohttp.ClientSession, token: str | None, timeout_s: float = 30.0):
        self.url, self.http = url.rstrip("/"), http
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            async with self.http.request(method, self.url + path, json=body, headers=self.headers,
                                         timeout=self.timeout) as r:  # fmt: skip
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AdminFailed(f"gateway {method} {path}: {type(e).__name__}: {e}") from None
        if r.status >= 400:
            raise AdminFailed(f"gateway {method} {path}: HTTP {r.status}: {str(data)[:200]}")
        return data

    async def instances(self) -> list[InstanceInfo]:
        data = await self._call("GET", "/admin/instances")
        return [InstanceInfo(i["id"], i["bucket"], int(i["outstanding"]), bool(i["routable"])) for i in data["instances"]]  # fmt: skip

    async def pressure(self, admits_per_engine: int) -> float:
        """Requests in flight over what the serving engines admit (the planner's rollout pressure)."""
        serving = [i for i in await self.instances() if i.routable]
        return sum(i.outstanding for i in serving) / max(1, admits_per_engine * len(serving))

    async def drain_and_remove(self, iid: str, timeout_s: float) -> None:
        """No new turns go to `iid`; once what it serves has finished (outstanding 0), remove it."""
        await self._call("POST", f"/admin/instances/{iid}/drain")
        deadline = time.monotonic() + timeout_s
        while True:
            found = [i for i in await self.instances() if i.id == iid]
            if not found or found[0].outstanding == 0:
                break
            if time.monotonic() > deadline:
                await self._call("POST", f"/admin/instances/{iid}/resume")
                raise AdminFailed(f"{iid} still had {found[0].outstanding} requests after {timeout_s:g} s")
            await asyncio.sleep(0.2)
        await self._call("DELETE", f"/admin/instances/{iid}")

    async def add(self, backend: dict) -> None:
        await self._call("POST", "/admin/instances", backend)

    async def retune(self, max_context: dict[str, int]) -> None:
        """New bucket boundaries (every bucket, in the gateway's order): router thresholds."""
        await self._call("POST", "/admin/buckets", {"buckets": [{"name": n, "max_context": c} for n, c in max_context.items()]})  # fmt: skip
