"""The gateway's admin and session endpoints.

The elastic pool (and an operator) changes the backend pool through these, without a restart:

- `GET  /admin/instances`                 every instance: bucket, state, health, outstanding;
- `POST /admin/instances`                 add one (JSON: url, bucket, and optionally tp, max_context,
                                          cap, node, name, api_key); it is checked at once and
                                          routable when its health check passes;
- `POST /admin/instances/{id}/drain`      no new turns go there; its sessions move on their next
                                          turn; what it is serving finishes;
- `POST /admin/instances/{id}/resume`     a draining instance takes turns again;
- `DELETE /admin/instances/{id}`          remove it (refused while requests are outstanding,
                                          unless `?force=true`: those still finish);
- `POST /admin/buckets`                   new bucket boundaries (JSON: `{"buckets": [{"name",
                                          "max_context"}, ...]}`, every bucket, in order): the
                                          router's length thresholds move, the engines stay (a
                                          planner's boundary refit, `libra train`'s re-plan).

Sessions and learning:

- `GET  /sessions/{id}`                   what the gateway knows of a session (turns, path, route);
- `POST /sessions/{id}/finish`            end it; optional JSON `{"final_tokens": N}`. The finished
                                          trajectory feeds the router's tree;
- `POST /steps/end`                       the RL step ended: `router.on_step_end` (the tree is
                                          rebuilt every K steps from recent trajectories);
- `GET  /admin/tree`, `POST /admin/tree/save`   the persisted causal tree.

With an `admin_token` in the gateway's config, every endpoint here that changes state (and every
/admin one) needs `Authorization: Bearer <token>`, as the control plane (`control`) does: finishing
a session feeds the router's tree and ending a step rebuilds routers. The server's middleware
(`libra.runtime.admin_guard`) checks it for every route; `/admin/*` is also guarded here. Without
a token, the gateway binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from aiohttp import web

from libra.core.config import build
from libra.core.trace import MAX_TOKENS
from libra.rollout.base import Bucket
from libra.rollout.tree import state_key
from libra.runtime.gateway.config import BackendConfig
from libra.runtime.gateway.control import require_admin
from libra.runtime.gateway.errors import ApiError
from libra.runtime.gateway.sessions import token_count
from libra.runtime.openai_errors import read_json_object


def register(app: web.Application, gw) -> None:
    h = _Handlers(gw)
    guard = _guarded(gw)
    app.router.add_get("/admin/instances", guard(h.list_instances))
    app.router.add_post("/admin/instances", guard(h.add_instance))
    app.router.add_post("/admin/instances/{iid}/drain", guard(h.drain))
    app.router.add_post("/admin/instances/{iid}/resume", guard(h.resume))
    app.router.add_delete("/admin/instances/{iid}", guard(h.remove))
    app.router.add_post("/admin/buckets", guard(h.retune))
    app.router.add_get("/sessions/{sid}", h.session)
    app.router.add_post("/sessions/{sid}/finish", h.finish)
    app.router.add_post("/steps/end", h.end_step)
    app.router.add_get("/admin/tree", guard(h.tree))
    app.router.add_post("/admin/tree/save", guard(h.save_tree))


def retuned(buckets: list[Bucket], body: object) -> list[Bucket]:
    """The gateway's buckets with the boundaries `body` gives: every bucket, by name, in order,
    with max_context strictly increasing; anything else is a 400 naming the field."""
    names = [b.name for b in buckets]
    if not isinstance(body, list) or len(body) != len(buckets):
        raise ApiError(400, f"buckets must list all {len(buckets)} buckets {names} as {{name, max_context}}", "buckets", "invalid_value")  # fmt: skip
    out = []
    for i, (b, item) in enumerate(zip(buckets, body, strict=True)):
        name = item.get("name") if isinstance(item, dict) else None
        ctx = item.get("max_context") if isinstance(item, dict) else None
        if name != b.name:
            raise ApiError(400, f"buckets[{i}].name must be {b.name!r} (buckets in order: {names})", f"buckets[{i}].name", "invalid_value")  # fmt: skip
        if isinstance(ctx, bool) or not isinstance(ctx, int) or not 0 < ctx <= MAX_TOKENS:
            raise ApiError(400, f"buckets[{i}].max_context must be an integer from 1 to {MAX_TOKENS}", f"buckets[{i}].max_context", "invalid_value")  # fmt: skip
        if out and ctx <= out[-1].max_context:
            raise ApiError(400, f"buckets[{i}].max_context must exceed the previous bucket's ({out[-1].max_context})", f"buckets[{i}].max_context", "invalid_value")  # fmt: skip
        out.append(Bucket(b.name, b.tp, ctx))
    return out


def _guarded(gw):
    """/admin/* changes the pool: with an admin token set, it needs it (as control calls do)."""

    def guard(fn):
        async def handler(request: web.Request) -> web.StreamResponse:
            require_admin(gw, request)
            return await fn(request)

        return handler

    return guard


async def _json_body(request: web.Request, required: bool) -> dict:
    return (await read_json_object(request, None if required else {}))[0]


class _Handlers:
    def __init__(self, gw) -> None:
        self.gw = gw

    def _instance(self, request: web.Request):
        iid = request.match_info["iid"]
        try:
            return self.gw.pool.get(iid)
        except KeyError:
            known = sorted(i.id for i in self.gw.pool.live())
            raise ApiError(
                404, f"no instance {iid!r}; instances: {known}", "id", "instance_not_found"
            ) from None

    # ---- instances ----------------------------------------------------------------------------

    async def list_instances(self, request: web.Request) -> web.Response:
        gw = self.gw
        buckets = [{"index": i, "name": b.name, "tp": b.tp, "max_context": b.max_context} for i, b in enumerate(gw.buckets)]  # fmt: skip
        return web.json_response({"buckets": buckets, "instances": [i.describe() for i in gw.pool.live()]})

    async def add_instance(self, request: web.Request) -> web.Response:
        cfg = build(BackendConfig, await _json_body(request, required=True))
        inst = self.gw.pool.add(cfg)
        await self.gw.health.check(inst, threshold=1)
        if inst.misfit:  # it could never take a turn: refuse it rather than keep a dead entry
            self.gw.pool.remove(inst)
            raise ApiError(400, f"max_context: {inst.misfit}", "max_context", "invalid_value")
        self.gw.pool.refresh()
        self.gw.refresh_models()
        return web.json_response(inst.describe(), status=201)

    async def drain(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        inst.drain()
        self.gw.pool.refresh()
        return web.json_response(inst.describe())

    async def resume(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        inst.resume()
        self.gw.pool.refresh()
        return web.json_response(inst.describe())

    async def remove(self, request: web.Request) -> web.Response:
        inst = self._instance(request)
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        if inst.view.outstanding and not force:
            msg = f"instance {inst.id!r} has {inst.view.outstanding} outstanding requests; drain it and wait, or pass force=true"  # fmt: skip
            raise ApiError(409, msg, "force", "instance_busy")
        self.gw.pool.remove(inst)
        self.gw.refresh_models()
        return web.json_response(inst.describe())

    async def retune(self, request: web.Request) -> web.Response:
        gw = self.gw
        new = retuned(gw.buckets, (await _json_body(request, required=True)).get("buckets"))
        for inst in gw.pool.live():
            b = new[inst.view.bucket]
            short = inst.holds_at_most()
            if short is not None and b.max_context > short:
                msg = f"bucket {b.name!r} max_context {b.max_context} exceeds instance {inst.id!r}'s max_model_len {short}"  # fmt: skip
                raise ApiError(409, msg, "max_context", "instance_too_short")
        gw.router.retune(new)
        gw.buckets[:] = new  # the pool shares this list
        for inst in gw.pool.live():
            inst.cfg = inst.cfg.model_copy(update={"max_context": new[inst.view.bucket].max_context})
        buckets = [{"index": i, "name": b.name, "tp": b.tp, "max_context": b.max_context} for i, b in enumerate(new)]  # fmt: skip
        return web.json_response({"buckets": buckets})

    # ---- sessions and steps -------------------------------------------------------------------

    async def session(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        s = self.gw.tracker.get(sid)
        if s is None:
            raise ApiError(404, f"no active session {sid!r}", "id", "session_not_found")
        return web.json_response(s.describe())

    async def finish(self, request: web.Request) -> web.Response:
        data = await _json_body(request, required=False)
        final = data.get("final_tokens")
        if final is not None and token_count(final) is None:
            raise ApiError(400, f"final_tokens must be an integer from 0 to {MAX_TOKENS}, got {final!r}", "final_tokens", "invalid_value")  # fmt: skip
        s, traj = self.gw.tracker.finish(request.match_info["sid"], final)
        self.gw.feed(traj)
        self.gw.metrics.session_finished("client")
        trajectory = {
            "prompt_id": traj.prompt_id,
            "step": traj.step,
            "path": [state_key(x) for x in traj.path],
            "turn_contexts": list(traj.turn_contexts),
            "final_tokens": traj.final_tokens,
        }
        return web.json_response({"session": s.describe(), "trajectory": trajectory})

    async def end_step(self, request: web.Request) -> web.Response:
        gw = self.gw
        gw.router.on_step_end(gw.step)
        gw.step += 1
        if gw.tree is not None:
            gw.tree.changed()
        return web.json_response({"step": gw.step})

    # ---- the tree -----------------------------------------------------------------------------

    async def tree(self, request: web.Request) -> web.Response:
        if self.gw.tree is None:
            raise ApiError(404, "no tree persistence configured (--tree-path)", None, "no_tree")
        return web.json_response(self.gw.tree.describe())

    async def save_tree(self, request: web.Request) -> web.Response:
        if self.gw.tree is None:
            raise ApiError(404, "no tree persistence configured (--tree-path)", None, "no_tree")
        await self.gw.tree.save()
        return web.json_response(self.gw.tree.describe())
