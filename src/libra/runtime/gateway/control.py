"""The control plane through the gateway: routes are per request, control is broadcast.

A trainer that pauses its engines, loads new weights and resumes them talks to one address, the
gateway, which forwards each control call to every engine of its pool (or one, `?engine=ID`) at
once and answers with each engine's own answer:

    {<what one SGLang or vLLM server answers>, "ok": true,
     "results": {"ENGINE_ID": <the engine's JSON>, ...}, "status": {"ENGINE_ID": 200}}

The top-level fields are the answer a client written for one server reads: the first engine's
answer, with what must describe them all merged (`success` of all of them; `weight_version` when
they agree, else null; `world_size` summed; `is_paused`/`is_sleeping` only if all are). For
`/collective_rpc`, `results` is vLLM's list (every engine's results in order) and the per-engine
answers are under `engines`. `ok` is true when every engine answered 2xx without
`"success": false`; the HTTP status is 200 then, else the first failing engine's 4xx, or 502.

Calls are sent concurrently: a group rendezvous (`/init_weights_update_group`) or a broadcast of
weights (`/update_weights_from_distributed`) only completes when every engine takes part at the
same time. For the rendezvous the engines take consecutive ranks from `rank_offset`, in
instance-id order, each as many as its world size (its `/server_info` tp_size x pp_size, or vLLM's
`/get_world_size`; one for the built-in engine), so the trainer gives `rank_offset: 1` and
`world_size: 1 +` the gateway's `/get_world_size`, as it would to one server.

Each backend speaks a control dialect (`control: sglang` or `vllm` in its config). The built-in
engine and SGLang take SGLang's calls as they are; for vLLM the same operations are mapped to its
own endpoints (which vLLM serves only with `VLLM_SERVER_DEV_MODE=1`), and an operation vLLM lacks
answers 501 for that engine. The gateway accepts both SGLang's and vLLM's names.

When the gateway has an `admin_token`, these calls (and `/admin/*`) need `Authorization: Bearer
<token>`. Each engine gets its backend's `admin_token` when configured, else the caller's header.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from libra.core.errors import ConfigError
from libra.runtime.gateway.errors import ApiError
from libra.runtime.openai_errors import read_json_object

VLLM_PAUSE = {"abort": "abort", "in_place": "keep", "retract": "keep", "wait": "wait"}
SLEEP_TAGS = {"1": None, "2": ["kv_cache", "weights"]}  # vLLM's sleep level as SGLang's release tags
WORLD_SIZE_TIMEOUT_S = 10.0
# vLLM's update_info keys besides dtype_names (NCCLWeightTransferUpdateInfo takes no others).
VLLM_UPDATE_INFO = ("names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers", "is_checkpoint_format")  # fmt: skip
PAUSE_FROM_VLLM = {"abort": "abort", "keep": "in_place", "wait": "wait"}


@dataclass(frozen=True, slots=True)
class Op:
    """One control operation: its SGLang path and how a vLLM backend is asked for it."""

    name: str
    method: str = "POST"
    vllm: str | None = None  # vLLM's path, or None when vLLM has no such endpoint


OPS = {
    op.name: op
    for op in (
        Op("pause_generation", vllm="/pause"),
        Op("continue_generation", vllm="/resume"),
        Op("flush_cache", vllm="/reset_prefix_cache"),
        Op("abort_request"),
        Op("update_weights_from_disk"),
        Op("init_weights_update_group", vllm="/init_weight_transfer_engine"),
        Op("update_weights_from_distributed", vllm="/update_weights"),
        Op("destroy_weights_update_group"),
        Op("update_weight_version"),
        Op("get_weight_version", method="GET"),
        Op("is_paused", method="GET", vllm="/is_paused"),
        Op("release_memory_occupation", vllm="/sleep?level=1"),
        Op("resume_memory_occupation", vllm="/wake_up"),
        Op("is_sleeping", method="GET", vllm="/is_sleeping"),
        Op("collective_rpc", vllm="/collective_rpc"),
    )
}
# Answer fields that describe every engine at once, merged rather than taken from the first.
ALL_OF = ("is_paused", "is_sleeping")
# vLLM's names, accepted by the gateway too: each is one of the operations above.
VLLM_NAMES = {
    "pause": "pause_generation",
    "resume": "continue_generation",
    "reset_prefix_cache": "flush_cache",
    "init_weight_transfer_engine": "init_weights_update_group",
    "update_weights": "update_weights_from_distributed",
    "sleep": "release_memory_occupation",
    "wake_up": "resume_memory_occupation",
}


def register(app: web.Application, gw) -> None:
    c = gw.control = Broadcast(gw)
    for name, op in OPS.items():
        app.router.add_route(op.method, "/" + name, c.handler(op, from_vllm=False))
    for alias, name in VLLM_NAMES.items():
        app.router.add_route(OPS[name].method, "/" + alias, c.handler(OPS[name], from_vllm=True))
    app.router.add_get("/flush_cache", c.handler(OPS["flush_cache"], from_vllm=False))  # as slime sends it
    app.router.add_get("/get_world_size", c.world_size)


def authorized(gw, request: web.Request) -> bool:
    token = gw.cfg.admin_token
    if token is None:
        return True
    return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode())


def require_admin(gw, request: web.Request) -> None:
    if not authorized(gw, request):
        raise ApiError(401, "this call needs 'Authorization: Bearer <admin token>' (the gateway's admin_token)", "Authorization", "unauthorized")  # fmt: skip


class Broadcast:
    def __init__(self, gw):
        self.gw = gw

    def handler(self, op: Op, from_vllm: bool):
        async def handle(request: web.Request) -> web.Response:
            require_admin(self.gw, request)
            body = await self._canonical(request, op, from_vllm)
            targets = self._targets(request)
            bodies = await self._bodies(request, op, body, targets)
            calls = [self._send(request, inst, op, b) for inst, b in zip(targets, bodies, strict=True)]
            answers = await asyncio.gather(*calls)
            return _answer(op, {inst.id: a for inst, a in zip(targets, answers, strict=True)})

        return handle

    async def world_size(self, request: web.Request) -> web.Response:
        """vLLM's /get_world_size for the whole pool: the ranks its engines take in a group."""
        require_admin(self.gw, request)
        targets = self._targets(request)
        sizes = await self.world_sizes(request, targets)
        return web.json_response({"world_size": sum(sizes), "engines": {i.id: n for i, n in zip(targets, sizes, strict=True)}})  # fmt: skip

    async def world_sizes(self, request: web.Request, targets: list) -> list[int]:
        return list(await asyncio.gather(*(self._world_size(request, inst) for inst in targets)))

    async def _world_size(self, request: web.Request, inst) -> int:
        """The ranks one engine takes: vLLM's /get_world_size, SGLang's tp_size x pp_size; 1 when
        it does not say (it joins as one rank, as the built-in engine does)."""
        path = "/get_world_size" if inst.cfg.control == "vllm" else "/server_info"
        status, info = await self._http("GET", inst.cfg.url + path, None, self._auth(request, inst), WORLD_SIZE_TIMEOUT_S)  # fmt: skip
        if status != 200 or not isinstance(info, dict):
            return 1
        n = info.get("world_size") if inst.cfg.control == "vllm" else _count(info.get("tp_size")) * _count(info.get("pp_size"))  # fmt: skip
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1

    async def _canonical(self, request: web.Request, op: Op, from_vllm: bool) -> dict:
        """The call as SGLang would take it, whichever names the caller used."""
        if op.method == "GET":
            return {}
        body = (await read_json_object(request, {}))[0]
        if not from_vllm:
            return body
        if op.name == "pause_generation":
            q = request.query
            mode = q.get(
                "mode", "wait" if q.get("wait_for_inflight_requests", "").lower() == "true" else "abort"
            )
            if mode not in PAUSE_FROM_VLLM:
                raise ConfigError("mode", mode[:40], sorted(PAUSE_FROM_VLLM))
            return {"mode": PAUSE_FROM_VLLM[mode]}
        if op.name == "init_weights_update_group":
            return _object(body, "init_info")
        if op.name == "update_weights_from_distributed":
            info = _object(body, "update_info")
            return {**info, "dtypes": info.get("dtype_names")}
        if op.name == "release_memory_occupation":
            level = request.query.get("level", "1")
            if level not in SLEEP_TAGS:
                raise ConfigError("level", level[:40], "1 (the KV cache) or 2 (the KV cache and the weights)")
            return {"tags": SLEEP_TAGS[level]}
        if op.name == "resume_memory_occupation":
            return {"tags": request.query.getall("tags", None)}
        return body

    def _targets(self, request: web.Request) -> list:
        one = request.query.get("engine")
        if one is None:
            every = sorted(self.gw.pool.live(), key=lambda i: i.id)
            if not every:
                raise ApiError(503, "the gateway has no engines", None, "no_engines")
            return every
        try:
            return [self.gw.pool.get(one)]
        except KeyError:
            known = sorted(i.id for i in self.gw.pool.live())
            raise ApiError(
                404, f"no engine {one[:80]!r}; engines: {known}", "engine", "instance_not_found"
            ) from None

    async def _bodies(self, request: web.Request, op: Op, body: dict, targets: list) -> list[dict]:
        """The same body for every engine, except each joins a group at its own ranks."""
        if op.name != "init_weights_update_group":
            return [body] * len(targets)
        offset, world = body.get("rank_offset", 1), body.get("world_size")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
            raise ConfigError("rank_offset", offset, "an integer >= 1 (rank 0 is the trainer)")
        sizes = await self.world_sizes(request, targets)
        need = offset + sum(sizes)
        if not isinstance(world, int) or isinstance(world, bool) or world != need:
            raise ConfigError("world_size", world, f"rank_offset + the engines' ranks = {offset} + {sum(sizes)} = {need} (GET /get_world_size)")  # fmt: skip
        starts = [offset + sum(sizes[:i]) for i in range(len(targets))]
        return [{**body, "rank_offset": start} for start in starts]

    async def _send(self, request: web.Request, inst, op: Op, body: dict) -> tuple[int, object]:
        if inst.cfg.control == "vllm":
            if op.vllm is None:
                return 501, {"success": False, "message": f"vLLM has no HTTP endpoint for {op.name}"}
            path, body = _to_vllm(op, body)
        else:
            path = "/" + op.name
        data = json.dumps(body).encode() if op.method == "POST" else None
        return await self._http(op.method, inst.cfg.url + path, data, self._auth(request, inst))

    def _auth(self, request: web.Request, inst) -> dict:
        headers = {"Content-Type": "application/json"}
        token = inst.cfg.admin_token
        auth = f"Bearer {token}" if token else request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _http(self, method: str, url: str, data: bytes | None, headers: dict, timeout_s: float | None = None) -> tuple[int, object]:  # fmt: skip
        timeout = self.gw.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.gw.http.request(method, url, data=data, headers=headers, timeout=timeout) as r:
                raw = await r.read()
                return r.status, _json_or_text(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return 502, {"success": False, "message": f"could not reach the engine: {type(e).__name__}: {str(e)[:200]}"}  # fmt: skip


def _to_vllm(op: Op, body: dict) -> tuple[str, dict]:
    """SGLang's call as vLLM's: the path (with its query) and the body."""
    if op.name == "pause_generation":
        return f"/pause?mode={VLLM_PAUSE.get(body.get('mode', 'abort'), 'abort')}", {}
    if op.name == "init_weights_update_group":
        keys = ("master_address", "master_port", "rank_offset", "world_size")
        return op.vllm, {"init_info": {k: body.get(k) for k in keys}}
    if op.name == "update_weights_from_distributed":
        info = {k: body[k] for k in VLLM_UPDATE_INFO if k in body}
        return op.vllm, {"update_info": {**info, "dtype_names": body.get("dtypes")}}
    if op.name == "release_memory_occupation":
        return f"/sleep?level={2 if 'weights' in (body.get('tags') or ()) else 1}", {}
    if op.name == "resume_memory_occupation" and body.get("tags"):
        return op.vllm + "?" + "&".join(f"tags={t}" for t in body["tags"] if isinstance(t, str)), {}
    if op.name == "collective_rpc":
        return op.vllm, body
    return op.vllm, {}


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _object(body: dict, key: str) -> dict:
    value = body.get(key)
    if not isinstance(value, dict):
        raise ConfigError(key, type(value).__name__, f"an object (vLLM's {key})")
    return value


def _json_or_text(raw: bytes) -> object:
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"text": raw[:500].decode("utf-8", "replace")}


def _succeeded(status: int, answer: object) -> bool:
    return 200 <= status < 300 and not (isinstance(answer, dict) and answer.get("success") is False)


def _answer(op: Op, answers: dict[str, tuple[int, object]]) -> web.Response:
    ok = all(_succeeded(st, a) for st, a in answers.values())
    failed = [st for st, a in answers.values() if not _succeeded(st, a)]
    status = 200 if ok else (failed[0] if 400 <= failed[0] < 500 else 502)
    detail = {k: a for k, (_, a) in answers.items()}
    body = {**one_server(op, detail, ok), "ok": ok, "status": {k: st for k, (st, _) in answers.items()}}
    body["engines" if op.name == "collective_rpc" else "results"] = detail
    return web.json_response(body, status=status)


def one_server(op: Op, answers: dict[str, object], ok: bool) -> dict:
    """What one server would have answered: the first engine's answer, with the fields that
    describe all of them merged (see the module's docstring)."""
    dicts = [a for a in answers.values() if isinstance(a, dict)]
    out = dict(dicts[0]) if dicts else {}
    if "success" in out:
        out["success"] = ok
    if op.name == "get_weight_version":
        versions = {str(a.get("weight_version")) for a in dicts}
        out["weight_version"] = dicts[0].get("weight_version") if len(versions) == 1 and dicts else None
    for key in ALL_OF:
        if key in out:
            out[key] = all(a.get(key) is True for a in dicts)
    if op.name == "collective_rpc":
        out["results"] = [r for a in dicts for r in (a.get("results") or [])]
    return out
