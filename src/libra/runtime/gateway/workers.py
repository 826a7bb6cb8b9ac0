"""What frameworks call on a router or a single server that is not generation or control: the
worker API of sglang-router (SGLang's model gateway), SGLang's status endpoints, and the
session-end call of SkyRL's router, each mapped onto the gateway's pool and sessions.

slime (its engines registering, its `abort()` after every rollout: slime/backends/sglang_utils/
sglang_engine.py and slime/rollout/sglang_rollout.py) and SkyRL (`finish_session`:
skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py) call:

- `GET /workers` -> `{"workers": [{"id", "url", "worker_type", "is_healthy", "load", ...}],
  "total", "stats"}`: every instance of the pool (its id, its URL, its bucket);
- `POST /workers {"url", "worker_type"?, "api_key"?, "bucket"?, "name"?, "control"?}`: add an
  engine. Its bucket is `bucket` when given, else the bucket whose TP the engine reports (its
  `/server_info`: the built-in engine's `tp_label`, SGLang's `tp_size`; a server without one, as
  vLLM, counts as TP 1); when none or several fit, a 400 naming `bucket`. An engine that does not answer is a 400 naming `url`; a URL already in the pool a
  409 naming `url`. A registration of the gateway's own URL (slime registers the engine it was
  given, which may be this gateway) changes nothing and says so;
- `DELETE /workers/{id}` (the id from `GET /workers`, or the URL): remove it (409 while it has
  requests in flight, unless `?force=true`);
- `GET /v1/loads`: SGLang's load report, one entry per instance, from the gateway's own count of
  what it has in flight there;
- `GET /health_generate`: each engine's own `/health_generate`; 200 while at least one passes
  (the gateway serves while any engine does);
- `GET /server_info` (and `/get_server_info`): SGLang's server info for the pool seen as one
  server: the first engine's, with `tp_size` and `num_gpus` the ranks of all engines (what a
  trainer's weight-update group must hold for them: slime sizes its group from these), and every
  engine's own under `engines`;
- `POST /finish_session?session_id=ID` (or `{"session_id"}`): the trajectory ended; as
  `POST /sessions/{id}/finish`. An unknown id is not an error (SkyRL calls it best effort).

Every call here that changes something (`POST`/`DELETE /workers`, `/finish_session`) needs the
admin token when the gateway has one, as `/admin` does.
"""

from __future__ import annotations

import asyncio
import re
from urllib.parse import unquote

import aiohttp
from aiohttp import web

from libra.core.config import build
from libra.runtime.gateway.config import BackendConfig
from libra.runtime.gateway.control import require_admin
from libra.runtime.gateway.errors import ApiError
from libra.runtime.gateway.pool import Instance
from libra.runtime.gateway.sessions import SessionError
from libra.runtime.openai_errors import read_json_object

PROBE_TIMEOUT_S = 10.0
HEALTH_GENERATE_TIMEOUT_S = 30.0
TP_LABEL = re.compile(r"tp(\d{1,3})")


def register(app: web.Application, gw) -> None:
    w = Workers(gw)
    app.router.add_get("/workers", w.list)
    app.router.add_post("/workers", w.add)
    app.router.add_delete("/workers/{wid:.+}", w.remove)
    app.router.add_get("/v1/loads", w.loads)
    app.router.add_get("/health_generate", w.health_generate)
    app.router.add_get("/server_info", w.server_info)
    app.router.add_get("/get_server_info", w.server_info)
    app.router.add_post("/finish_session", w.finish_session)


def worker(inst: Instance) -> dict:
    d = inst.describe()
    return {"id": inst.id, "url": inst.cfg.url, "worker_type": "regular", "is_healthy": inst.view.healthy,
            "load": inst.view.outstanding, "model_id": inst.models[0] if inst.models else None,
            "bucket": d["bucket"], "tp": d["tp"], "state": d["state"], "health": d["health"]}  # fmt: skip


class Workers:
    def __init__(self, gw) -> None:
        self.gw = gw

    async def _get(self, url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, object]:
        try:
            async with self.gw.http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            return 0, f"{type(e).__name__}: {str(e)[:200]}"

    # ---- the worker API -----------------------------------------------------------------------

    async def list(self, request: web.Request) -> web.Response:
        live = [worker(i) for i in sorted(self.gw.pool.live(), key=lambda i: i.id)]
        healthy = sum(w["is_healthy"] for w in live)
        return web.json_response({"workers": live, "total": len(live), "stats": {"healthy_count": healthy, "unhealthy_count": len(live) - healthy}})  # fmt: skip

    async def add(self, request: web.Request) -> web.Response:
        require_admin(self.gw, request)
        body = (await read_json_object(request))[0]
        kind = body.get("worker_type", "regular")
        if kind != "regular":
            raise ApiError(400, f"worker_type must be 'regular' (the gateway has no prefill/decode split), got {str(kind)[:40]!r}", "worker_type", "invalid_value")  # fmt: skip
        cfg = build(BackendConfig, {"url": body.get("url"), "bucket": "?"})  # checks the URL alone
        if any(i.cfg.url == cfg.url for i in self.gw.pool.live()):
            raise ApiError(409, f"worker {cfg.url} is registered already (DELETE /workers/ID first)", "url", "worker_exists")  # fmt: skip
        status, info = await self._get(cfg.url + "/server_info")
        if status != 200 or not isinstance(info, dict):
            status, info = await self._get(cfg.url + "/get_server_info")
        if isinstance(info, dict) and info.get("libra_gateway") == self.gw.identity:
            return web.json_response({"status": "ok", "worker_id": None, "url": cfg.url, "message": "this is the gateway itself: its engines are its workers already"})  # fmt: skip
        if status == 0:  # nothing answers there at all
            raise ApiError(400, f"no worker answers at {cfg.url} ({info})", "url", "invalid_value")
        info = info if status == 200 and isinstance(info, dict) else {}  # vLLM serves no /server_info
        bucket = body.get("bucket") or self._bucket_for(info)
        more = {k: body[k] for k in ("api_key", "name", "control") if body.get(k) is not None}
        inst = await self._admit(build(BackendConfig, {"url": cfg.url, "bucket": bucket, **more}))
        return web.json_response({"status": "ok", "worker_id": inst.id, "url": inst.cfg.url, "bucket": inst.bucket_name})  # fmt: skip

    def _bucket_for(self, info: dict) -> str:
        """The one bucket whose TP the engine reports: Libra's `tp_label` ("tp2"), else `tp_size`."""
        m = TP_LABEL.fullmatch(str(info.get("tp_label", "")))
        tp = int(m.group(1)) if m else info.get("tp_size", 1)
        fits = [b.name for b in self.gw.buckets if b.tp == tp]
        if len(fits) != 1:
            names = [f"{b.name} (tp{b.tp})" for b in self.gw.buckets]
            raise ApiError(400, f"the worker reports tp {tp}, which {'no' if not fits else 'more than one'} bucket has ({', '.join(names)}); say which in 'bucket'", "bucket", "invalid_value")  # fmt: skip
        return fits[0]

    async def _admit(self, cfg: BackendConfig) -> Instance:
        gw = self.gw
        inst = gw.pool.add(cfg)
        await gw.health.check(inst, threshold=1)
        why = inst.misfit or ("" if inst.view.healthy else inst.last_error or "it failed its health check")
        if why:  # it could never take a turn: refuse it rather than keep a dead entry
            gw.pool.remove(inst)
            raise ApiError(400, f"worker {cfg.url} cannot serve: {why}", "max_context" if inst.misfit else "url", "invalid_value")  # fmt: skip
        gw.pool.refresh()
        gw.refresh_models()
        return inst

    async def remove(self, request: web.Request) -> web.Response:
        require_admin(self.gw, request)
        wid = unquote(request.match_info["wid"])
        live = self.gw.pool.live()
        inst = next((i for i in live if wid in (i.id, i.cfg.url)), None)
        if inst is None:
            raise ApiError(404, f"no worker {wid[:80]!r}; workers: {sorted(i.id for i in live)}", "worker_id", "worker_not_found")  # fmt: skip
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        if inst.view.outstanding and not force:
            raise ApiError(409, f"worker {inst.id!r} has {inst.view.outstanding} requests in flight; retry when they are done, or pass force=true", "force", "instance_busy")  # fmt: skip
        self.gw.pool.remove(inst)
        self.gw.refresh_models()
        return web.json_response({"status": "ok", "worker_id": inst.id, "url": inst.cfg.url})

    # ---- status -------------------------------------------------------------------------------

    async def loads(self, request: web.Request) -> web.Response:
        rows = []
        for rank, inst in enumerate(sorted(self.gw.pool.live(), key=lambda i: i.id)):
            n = inst.view.outstanding
            rows.append({"dp_rank": rank, "instance": inst.id, "bucket": inst.bucket_name, "num_running_reqs": n, "num_waiting_reqs": 0, "num_total_reqs": n})  # fmt: skip
        total = sum(r["num_total_reqs"] for r in rows)
        return web.json_response({"dp_rank_count": len(rows), "loads": rows, "aggregate": {"num_total_reqs": total}})  # fmt: skip

    async def health_generate(self, request: web.Request) -> web.Response:
        live = sorted(self.gw.pool.live(), key=lambda i: i.id)
        answers = await asyncio.gather(*(self._get(i.cfg.url + "/health_generate", HEALTH_GENERATE_TIMEOUT_S) for i in live))  # fmt: skip
        status = {i.id: st for i, (st, _) in zip(live, answers, strict=True)}
        ok = any(st == 200 for st in status.values())
        return web.json_response({"status": "ok" if ok else "no engine generates", "engines": status}, status=200 if ok else 503)  # fmt: skip

    async def server_info(self, request: web.Request) -> web.Response:
        live = sorted(self.gw.pool.live(), key=lambda i: i.id)
        infos = await asyncio.gather(*(self._get(i.cfg.url + "/server_info") for i in live))
        engines = {i.id: info for i, (st, info) in zip(live, infos, strict=True) if st == 200 and isinstance(info, dict)}  # fmt: skip
        ranks = sum(await self.gw.control.world_sizes(request, live))
        first = dict(next(iter(engines.values()), {}))
        for key in ("libra_gateway", "tp_label"):  # of one engine, not of the pool
            first.pop(key, None)
        out = {**first, "tp_size": ranks, "pp_size": 1, "dp_size": 1, "num_gpus": ranks, "world_size": ranks,
               "libra_gateway": self.gw.identity, "engines": engines}  # fmt: skip
        return web.json_response(out)

    # ---- sessions -----------------------------------------------------------------------------

    async def finish_session(self, request: web.Request) -> web.Response:
        require_admin(self.gw, request)
        sid = request.query.get("session_id")
        if sid is None and request.can_read_body:
            sid = (await read_json_object(request, {}))[0].get("session_id")
        if not isinstance(sid, str) or not sid:
            raise ApiError(400, "session_id is required: the query parameter (or a JSON field) naming the session", "session_id", "invalid_value")  # fmt: skip
        try:
            s, traj = self.gw.tracker.finish(sid)
        except SessionError:
            return web.json_response({"status": "ok", "session_id": sid, "finished": False})
        self.gw.feed(traj)
        self.gw.metrics.session_finished("client")
        return web.json_response({"status": "ok", "session_id": sid, "finished": True, "turns": len(s.turns)})
