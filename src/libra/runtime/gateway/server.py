"""The gateway's HTTP server: the OpenAI API in front, the backend pool behind, the router between.

Every `POST /v1/chat/completions`, `/v1/completions` or SGLang's `/generate` is one turn of a
session:

1. the session is found (a header: the configured one, `X-Session-ID`, slime's
   `X-SMG-Routing-Key`; else a body field: the configured one, SkyRL's `trajectory_id`, `user`;
   else the request is a one-turn session of its own, which stays on the instance of the turn its
   prompt extends, if any: `affinity`), the conversation is scanned for new tool returns, and a
   prompt sent as token ids is counted exactly;
2. the router is asked, with the same `RouteRequest` and `InstanceView`s the simulator builds;
3. the decision is carried out: the body is sent as is to the chosen instance, and the response is
   returned as is (streams pass through chunk by chunk). A change of instance is a migration: the
   next turn simply prefills on the new instance, since an OpenAI-compatible server offers no way
   to move a KV cache;
4. if the instance fails before any byte came back, the request is sent once more, to another
   instance of the decided bucket or the nearest bucket with a healthy one (the placement rule
   shared by every router), and the instance is taken out.

The hot path does no policy work of its own and no JSON encoding: the request body is decoded once
(to read the messages), and the response body is searched for `usage` (or /generate's token
counts), not decoded. Control calls are not routed but broadcast to every engine (`control`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import socket
import time

import aiohttp
from aiohttp import web

from libra.core.errors import ConfigError, LibraError
from libra.rollout.base import (
    MigrationMethod,
    NoInstanceError,
    RouteDecision,
    RouteRequest,
    bucket_for_length,
)
from libra.rollout.placement import choose_instance, healthy_exists
from libra.runtime.admin_guard import admin_middleware
from libra.runtime.gateway import admin, control, upstream, workers
from libra.runtime.gateway.affinity import PrefixIndex, continuations, prompt_units
from libra.runtime.gateway.config import MAX_HEADER_TEXT, GatewayConfig, header_safe
from libra.runtime.gateway.conversation import prompt_key, prompt_size
from libra.runtime.gateway.errors import ApiError, http_message, json_error
from libra.runtime.gateway.metrics import GatewayMetrics
from libra.runtime.gateway.pool import AdminState, Health, HealthChecker, Instance, Pool, StateError
from libra.runtime.gateway.sessions import Session, SessionError, SessionTracker, TurnRecord, tokens_of_chars
from libra.runtime.gateway.tree_store import TreeStore
from libra.runtime.http_limits import batch_size
from libra.runtime.openai_errors import read_json_object
from libra.runtime.serving import limited_runner, serve_until_signalled

log = logging.getLogger("libra.gateway")
perf = time.perf_counter
STEP = re.compile(r"[0-9]{1,9}")
FAILOVER_POLL_S = 0.05
UPSTREAM_S = web.RequestKey("upstream_s", float)  # time spent waiting on the backend
PREFIX = web.RequestKey("prefix", object)  # a keyless turn's prompt, to record with its response
# Where a session's name is found, after the configured header or field: the header Libra
# documents, then SGLang's router's (slime sets it per sample); the body field SkyRL sets, then
# OpenAI's `user`.
SESSION_HEADERS = ("X-Session-ID", "X-SMG-Routing-Key")
SESSION_FIELDS = ("trajectory_id", "user")
# Proxied as they are to any healthy backend: they depend on the model, not on a session.
PROXIED = {"/tokenize": "POST", "/detokenize": "POST"}


class Gateway:
    def __init__(self, cfg: GatewayConfig, router):
        self.cfg, self.router = cfg, router
        self.buckets = cfg.bucket_list()
        self.pool = Pool(self.buckets)
        for be in cfg.backends:
            self.pool.add(be)
        self.tracker = SessionTracker(cfg.sessions, cfg.tool_state)
        self.metrics = GatewayMetrics(self, [b.name for b in self.buckets])
        self.tree = TreeStore(router, cfg.tree_path, cfg.tree_save_interval_s) if cfg.tree_path else None
        if self.tree is not None:
            self.tree.load()
            self.tree.on_save = self.metrics.tree_saves.inc
        self.step = 0
        self.started = int(time.time())
        self.known_models: frozenset[str] = frozenset(cfg.models)
        self.http: aiohttp.ClientSession | None = None
        self.control = None  # the control plane's broadcaster (control.register sets it)
        self.health: HealthChecker | None = None
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s)  # fmt: skip
        self._tasks: list[asyncio.Task] = []
        sc = cfg.sessions
        self.session_headers = ((sc.key_header,) if sc.key_header else ()) + SESSION_HEADERS
        self.session_fields = ((sc.key_field,) if sc.key_field else ()) + SESSION_FIELDS
        aff = cfg.affinity
        self.affinity = PrefixIndex(aff.block, aff.capacity) if aff.enabled else None
        self.identity = secrets.token_hex(8)  # tells a registration of the gateway's own URL (workers)

    def app(self) -> web.Application:
        guard = admin_middleware(lambda: self.cfg.admin_token, _unauthorized)
        app = web.Application(
            client_max_size=int(self.cfg.max_body_mb * 2**20), middlewares=[self._middleware, guard]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/inference/v1/generate", self.tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model_card)
        for path, method in PROXIED.items():
            app.router.add_route(method, path, self.proxy_any)
        app.router.add_get("/health", self.health_endpoint)
        app.router.add_get("/metrics", self.prometheus)
        admin.register(app, self)
        control.register(app, self)
        workers.register(app, self)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    # ---- lifecycle ------------------------------------------------------------------------------

    async def _startup(self, app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0, keepalive_timeout=60)
        # No cookie jar: a proxy must not carry one client's backend cookies to another (and
        # skipping cookie handling is measurably cheaper per request).
        self.http = aiohttp.ClientSession(connector=conn, cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",))  # fmt: skip
        self.health = HealthChecker(self.pool, self.cfg.health, self.http, self._health_changed)
        await self.health.check_all()  # serve knowing which backends are up
        self._refuse_misfits()
        self.refresh_models()
        self._tasks = [asyncio.create_task(_forever(f)) for f in (self.health.run, self._sweep)]
        if self.tree is not None:
            self._tasks.append(asyncio.create_task(_forever(self.tree.run)))

    async def _cleanup(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.tree is not None and self.tree.dirty:
            try:
                self.tree.save_now()
            except OSError as e:
                log.error("could not save tree at shutdown: %s", e)
        await self.http.close()

    def _refuse_misfits(self) -> None:
        """A backend whose model cannot hold its bucket's max_context stops the start: the router
        would send it sessions it must refuse (an engine of 8192 labelled 40960)."""
        for i, be in enumerate(self.cfg.backends):
            inst = self.pool.instances[be.id]
            if inst.misfit:
                raise ConfigError(f"backends[{i}].max_context", be.max_context, f"at most what {be.url} holds: {inst.misfit}")  # fmt: skip

    def _health_changed(self, inst: Instance, up: bool) -> None:
        self.refresh_models()

    def refresh_models(self) -> None:
        if not self.cfg.models:
            self.known_models = frozenset(self.pool.models())

    async def _sweep(self) -> None:
        interval = min(5.0, max(0.05, self.cfg.sessions.idle_timeout_s / 10))
        while True:
            await asyncio.sleep(interval)
            for reason, traj in self.tracker.expire():
                if self.cfg.sessions.feed_idle:
                    self.feed(traj)
                self.metrics.session_finished(reason)

    def feed(self, traj) -> None:
        """A finished trajectory goes to the router (its tree learns from it). A router bug here is
        logged and counted; the session is finished either way."""
        if not traj.turn_contexts:
            return
        try:
            self.router.on_finish(traj)
        except Exception:
            log.exception("router %s failed to learn from session %r", getattr(self.router, "name", "?"), traj.traj_id)  # fmt: skip
            self.metrics.error("router", "on_finish")
            return
        if self.tree is not None:
            self.tree.changed()

    # ---- the OpenAI endpoints -------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data, body = await self._read(request)
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' is required: a non-empty list of chat messages", "messages", "invalid_value")  # fmt: skip
        self._check_model(data)
        asked = data.get("max_completion_tokens", data.get("max_tokens"))
        self._check_queue(1, tokens_of_chars(len(body)), asked, data.get("n"), "messages")
        return await self._proxy(request, "chat", data, body, messages, 0)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        data, body = await self._read(request)
        prompt = data.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "'prompt' is required: a string, token ids, or a non-empty list of either", "prompt", "invalid_value")  # fmt: skip
        self._check_model(data)
        self._check_batch(prompt, data.get("max_tokens"), data.get("n"), "prompt")
        chars, tokens = prompt_size(prompt)
        return await self._proxy(request, "completions", data, body, None, chars, tokens, prompt)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native /generate: `input_ids` (counted exactly) or `text`."""
        data, body = await self._read(request)
        field = "input_ids" if data.get("input_ids") is not None else "text"
        prompt = data.get(field)
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "'text' or 'input_ids' is required: a string, token ids, or a non-empty list of either", "input_ids", "invalid_value")  # fmt: skip
        sp = data.get("sampling_params")
        self._check_batch(prompt, sp.get("max_new_tokens") if isinstance(sp, dict) else None, 1, field)
        chars, tokens = prompt_size(prompt)
        return await self._proxy(request, "generate", data, body, None, chars, tokens, prompt)

    async def tokens(self, request: web.Request) -> web.StreamResponse:
        """vLLM's token-in/token-out /inference/v1/generate (SkyRL): `token_ids`, counted exactly."""
        data, body = await self._read(request)
        prompt = data.get("token_ids")
        if not (isinstance(prompt, list) and prompt):
            raise ApiError(400, "'token_ids' is required: a non-empty list of token ids", "token_ids", "invalid_value")  # fmt: skip
        chars, tokens = prompt_size(prompt)
        return await self._proxy(request, "tokens", data, body, None, chars, tokens, prompt)

    async def models(self, request: web.Request) -> web.Response:
        cards = self.pool.cards()
        data = [self._card(m, cards.get(m)) for m in sorted(self.known_models)]
        return web.json_response({"object": "list", "data": data})

    async def model_card(self, request: web.Request) -> web.Response:
        model = request.match_info["model_id"]
        if model not in self.known_models:
            raise ApiError(404, f"model {model[:80]!r} does not exist; this gateway serves: {', '.join(sorted(self.known_models))}", "model", "model_not_found")  # fmt: skip
        return web.json_response(self._card(model, self.pool.cards().get(model)))

    def _card(self, model: str, card: dict | None) -> dict:
        """A backend's card (keeping `root`, `max_model_len`, ...), or a bare one for a name the
        config lists that no backend reported."""
        base = {"id": model, "object": "model", "created": self.started, "owned_by": "libra-gateway"}
        return {**base, **(card or {})}

    async def proxy_any(self, request: web.Request) -> web.Response:
        """/tokenize and /detokenize: any healthy backend answers (the least loaded)."""
        _, body = await self._read(request)
        views = [v for v in self.pool.views if v.healthy]
        if not views:
            raise ApiError(503, "no healthy backend instance", code="no_healthy_instance")
        inst = self.pool.instances[min(views, key=lambda v: v.outstanding).id]
        try:
            async with self.http.post(inst.cfg.url + request.path, data=body, headers=self._headers(request, inst), timeout=self.timeout) as r:  # fmt: skip
                out = await r.read()
                ctype = r.headers.get("Content-Type", "application/json")
                return web.Response(body=out, status=r.status, headers={"Content-Type": ctype})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise ApiError(
                502, f"backend {inst.id} failed ({type(e).__name__})", code="upstream_failed"
            ) from None

    async def health_endpoint(self, request: web.Request) -> web.Response:
        routable = sum(1 for v in self.pool.views if v.healthy)
        body = {
            "status": "ok" if routable else "no routable backend instance",
            "router": getattr(self.router, "name", type(self.router).__name__),
            "buckets": [{"name": b.name, "tp": b.tp, "max_context": b.max_context} for b in self.buckets],
            "instances": len(self.pool.views),
            "routable": routable,
            "sessions": len(self.tracker),
            "step": self.step,
        }
        return web.json_response(body, status=200 if routable else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    async def _read(self, request: web.Request) -> tuple[dict, bytes]:
        return await read_json_object(request)

    def _check_batch(self, prompt: object, asked: object, n: object, field: str) -> None:
        """A batch's prompts within `max_prompts_per_request`, then its tokens (below)."""
        count, cap = batch_size(prompt), self.cfg.max_prompts_per_request
        if count > cap:
            msg = f"{field!r} holds {count} prompts; this gateway takes at most {cap} per request (max_prompts_per_request)"  # fmt: skip
            raise ApiError(400, msg, field, "too_many_prompts")
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        items = prompt if batch else [prompt]
        tokens = sum(len(x) if isinstance(x, list) else tokens_of_chars(len(x)) if isinstance(x, str) else 0 for x in items)  # fmt: skip
        self._check_queue(len(items), tokens, asked, n, field)

    def _check_queue(self, prompts: int, prompt_tokens: int, asked: object, n: object, field: str) -> None:
        """What the request would queue on an engine, at most `max_request_tokens`: over its
        sequences (prompts x n), prompt tokens (token ids exactly, text estimated from its length)
        plus max_tokens (absent: 0 here, the backend applies its own default)."""
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        asked = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 0
        total, cap = (prompt_tokens + prompts * asked) * n, self.cfg.max_request_tokens
        if total > cap:
            msg = f"this request would queue about {total} tokens ({prompts} prompts x n={n}, prompt plus max_tokens each); this gateway takes at most {cap} (max_request_tokens)"  # fmt: skip
            raise ApiError(400, msg, field, "request_too_large")

    def _check_model(self, data: dict) -> None:
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: the name of a served model", "model", "invalid_value")
        if self.known_models and model not in self.known_models:
            msg = (
                f"model {model!r} does not exist; this gateway serves: {', '.join(sorted(self.known_models))}"
            )
            raise ApiError(404, msg, "model", "model_not_found")

    # ---- one turn -------------------------------------------------------------------------------

    def _session(self, request: web.Request, data: dict) -> Session:
        sid, field = self._session_key(request, data)
        prompt = request.headers.get("X-Prompt-ID") or None
        step = self.step
        raw = request.headers.get("X-Libra-Step")
        if raw is not None:
            if not STEP.fullmatch(raw):
                raise ApiError(400, f"X-Libra-Step must be a non-negative integer below 10^9, got {raw[:40]!r}", "X-Libra-Step", "invalid_value")  # fmt: skip
            step = int(raw)
        return self.tracker.open(_check_id(sid, field), _check_id(prompt, "X-Prompt-ID"), step)

    def _session_key(self, request: web.Request, data: dict) -> tuple[str | None, str]:
        """The session's name and where it was found: a header (the configured one, X-Session-ID,
        slime's X-SMG-Routing-Key), else a body field (the configured one, SkyRL's trajectory_id,
        OpenAI's user). SkyRL's batched completions give one trajectory_id per prompt: the first
        names the turn. None: a one-turn session."""
        headers = request.headers
        for name in self.session_headers:
            value = headers.get(name)
            if value:
                return value, name
        for name in self.session_fields:
            value = data.get(name)
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            if isinstance(value, str) and value:
                return value, name
        return None, "X-Session-ID"

    async def _proxy(self, request: web.Request, kind: str, data: dict, body: bytes, messages: list | None, chars: int, tokens: int | None = None, prompt: object = None) -> web.StreamResponse:  # fmt: skip
        s = self._session(request, data)
        key = prompt_key(prompt) if messages is None and s.prompt_id is None else ""
        follows = self._follow(request, s, kind, data, messages)
        req = self.tracker.begin_turn(s, messages, chars, tokens, key)
        prev_bucket, prev_inst = s.bucket, s.instance
        dec = self._stay(req) if follows and healthy_exists(self.pool.views) else await self._route(req)
        rec = self.tracker.routed(s, req, dec)
        self.metrics.decision(dec.bucket)
        if rec.migrated:
            self._moved(s, rec, prev_bucket, prev_inst)
        inst = self.pool.instances[dec.instance]
        for attempt in (0, 1):
            # Released on every way out: answered, failed, timed out, or cancelled because the
            # client left (aiohttp cancels the handler), so load and drain never see phantoms.
            inst.view.outstanding += 1
            try:
                return await self._forward(request, kind, body, data.get("stream") is True, s, inst)
            except upstream.NoByteError as e:
                self._failed(inst, e)
                if attempt:
                    raise ApiError(502, f"backend {inst.id} failed before answering ({e.detail}), and so did the retry", code="upstream_failed") from None  # fmt: skip
            finally:
                inst.view.outstanding -= 1
            inst = await self._failover(s, rec, req, inst)
        raise AssertionError("unreachable")

    def _follow(self, request: web.Request, s: Session, kind: str, data: dict, messages: list | None) -> bool:
        """A keyless turn whose prompt extends an earlier turn's prompt and response starts on that
        turn's instance (the placement rule keeps it there if it can). True when one was found."""
        if s.id or self.affinity is None:
            return False
        units = prompt_units(kind, data, messages)
        if units is None:
            return False
        request[PREFIX] = units
        inst = self.pool.instances.get(self.affinity.lookup(units) or "")
        if inst is None or not inst.view.healthy:
            return False
        s.instance, s.bucket = inst.id, inst.view.bucket
        return True

    def _remember(self, request: web.Request, kind: str, out: bytes, inst: Instance) -> None:
        """Record a keyless turn's prompt + response (each choice) as served by `inst`."""
        units = request.get(PREFIX)
        if units is None:
            return
        try:
            answer = json.loads(out)
        except (ValueError, RecursionError):
            return
        for seq in continuations(kind, units, answer):
            self.affinity.record(seq, inst.id)

    def _moved(self, s: Session, rec: TurnRecord, prev_bucket: int | None, prev_inst: str | None) -> None:
        """A session changed instance. When the one it left is gone (down, removed) or failed
        under its last turn, the move is a failover: the client is retrying that turn."""
        old = self.pool.instances.get(prev_inst) if prev_inst else None
        gone = old is None or old.state == AdminState.REMOVED or old.health == Health.DOWN
        if gone or s.failed_on == prev_inst:
            rec.failover_to = rec.instance
            self.metrics.migration(prev_bucket, rec.bucket, "failover")
        else:
            self.metrics.migration(prev_bucket, rec.bucket, "policy")
        s.failed_on = None

    async def _forward(self, request: web.Request, kind: str, body: bytes, stream: bool, s: Session, inst: Instance) -> web.StreamResponse:  # fmt: skip
        t_up = perf()
        try:
            resp = await upstream.post(
                self.http, inst.urls[kind], body, self._headers(request, inst), self.timeout
            )
        except asyncio.TimeoutError:
            self.metrics.error(inst.id, "timeout")
            raise ApiError(504, f"backend {inst.id} did not answer within {self.cfg.request_timeout_s:g} s (request_timeout_s)", code="upstream_timeout") from None  # fmt: skip
        try:
            if stream and resp.status == 200:
                return await self._pipe(request, resp, s, inst, t_up, kind)
            return await self._whole(request, resp, s, inst, t_up, kind)
        finally:
            resp.release()

    async def _route(self, req: RouteRequest) -> RouteDecision:
        if not healthy_exists(self.pool.views):
            await self._wait_routable()
        try:
            return self.router.route(req, self.pool.views)
        except NoInstanceError:  # cannot happen after the check above; kept as a clear 503
            raise ApiError(503, "no healthy backend instance", code="no_healthy_instance") from None
        except Exception:  # a router bug must not cost the client its turn
            log.exception("router %s failed on session %r turn %d; keeping the session where it is", getattr(self.router, "name", "?"), req.traj_id, req.turn)  # fmt: skip
            self.metrics.error("router", "exception")
            return self._stay(req)

    def _stay(self, req: RouteRequest) -> RouteDecision:
        """The no-move decision, placed by the shared rule: what a router that learned nothing does."""
        floor = bucket_for_length(self.buckets, req.context_tokens)
        target = max(req.current_bucket or 0, floor)
        view = choose_instance(self.pool.views, target, floor, len(self.buckets), req.current_instance)
        moved = req.current_instance is not None and view.id != req.current_instance
        return RouteDecision(
            view.bucket, view.id, moved, MigrationMethod.REPREFILL if moved else MigrationMethod.NONE
        )

    async def _wait_routable(self) -> None:
        """Keep the request while no instance is routable (a router never drops one), up to a limit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.no_instance_wait_s
        while not healthy_exists(self.pool.views):
            left = deadline - loop.time()
            if left <= 0:
                raise ApiError(503, f"no healthy backend instance for {self.cfg.no_instance_wait_s:g} s (no_instance_wait_s)", code="no_healthy_instance")  # fmt: skip
            try:
                await asyncio.wait_for(self.pool.routable.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _headers(self, request: web.Request, inst: Instance) -> dict:
        """The instance's headers, plus the client's Authorization (unless the backend has its
        own api_key) and X-Request-Id (vLLM takes it as the request's id)."""
        h = request.headers
        auth, rid = h.get("Authorization"), h.get("X-Request-Id")
        if rid is None and (auth is None or inst.cfg.api_key):
            return inst.headers
        out = dict(inst.headers)
        if auth is not None and not inst.cfg.api_key:
            out["Authorization"] = auth
        if rid is not None:
            out["X-Request-Id"] = rid
        return out

    def _failed(self, inst: Instance, e: upstream.NoByteError) -> None:
        self.metrics.error(inst.id, e.kind)
        if e.refused:
            if self.pool.mark_down(inst, e.detail):
                log.warning("instance %s taken out: %s", inst.id, e.detail)
                self.refresh_models()
        else:  # a reset can be a stale pooled connection: let a health check decide
            self.health.probe_soon(inst)

    async def _failover(self, s: Session, rec: TurnRecord, req: RouteRequest, failed: Instance) -> Instance:
        """Carry the decided bucket out on another instance: the shared placement rule, without
        the failed one (it may not be marked down yet), waiting a while if none is left."""
        floor = bucket_for_length(self.buckets, req.context_tokens)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.no_instance_wait_s
        while True:
            views = [v for v in self.pool.views if v.id != failed.id]
            try:
                view = choose_instance(views, rec.bucket, floor, len(self.buckets), None)
                break
            except NoInstanceError:
                if loop.time() >= deadline:
                    raise ApiError(503, f"backend {failed.id} failed and no other instance is healthy", code="no_healthy_instance") from None  # fmt: skip
                await asyncio.sleep(FAILOVER_POLL_S)
        inst = self.pool.instances[view.id]
        self.tracker.moved(s, rec, inst.id, view.bucket)
        self.metrics.retry(rec.bucket)
        self.metrics.migration(rec.bucket, view.bucket, "failover")
        return inst

    def _libra_headers(self, s: Session, inst: Instance) -> dict:
        h = {"X-Libra-Instance": inst.id, "X-Libra-Bucket": inst.bucket_name}
        if s.id:
            h["X-Session-ID"] = s.id
        return h

    async def _whole(self, request: web.Request, resp: aiohttp.ClientResponse, s: Session, inst: Instance, t_up: float, kind: str) -> web.Response:  # fmt: skip
        try:
            out = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.metrics.error(inst.id, "mid_response")
            self.health.probe_soon(inst)
            s.failed_on = inst.id
            raise ApiError(502, f"backend {inst.id} failed mid-response ({type(e).__name__})", code="upstream_failed") from None  # fmt: skip
        request[UPSTREAM_S] = up = perf() - t_up
        self.metrics.upstream_time(inst.view.bucket, up)
        if resp.status == 200:
            usage = upstream.generate_usage(out) if kind == "generate" else upstream.usage_in_body(out)
            if kind == "tokens":
                usage = upstream.tokens_usage(out, s.anchor_tokens)
            if usage is not None:
                self.tracker.metered(s, usage)
            self._remember(request, kind, out, inst)
        headers = self._libra_headers(s, inst)
        headers["Content-Type"] = resp.headers.get("Content-Type", "application/json")
        return web.Response(body=out, status=resp.status, headers=headers)

    async def _pipe(self, request: web.Request, resp: aiohttp.ClientResponse, s: Session, inst: Instance, t_up: float, kind: str) -> web.StreamResponse:  # fmt: skip
        out = web.StreamResponse(headers={**upstream.SSE_HEADERS, **self._libra_headers(s, inst)})
        await out.prepare(request)
        watch = upstream.GenerateUsage() if kind == "generate" else upstream.SSEUsage()
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.metrics.error(inst.id, "mid_stream")
                self.health.probe_soon(inst)
                s.failed_on = inst.id
                await _try_write(
                    out, upstream.sse_error(f"backend {inst.id} failed mid-stream ({type(e).__name__})")
                )
                break
            if not chunk:
                break
            watch.feed(chunk)
            if not await _try_write(out, chunk):
                return out  # the client left; releasing the response closes the backend connection
        request[UPSTREAM_S] = up = perf() - t_up
        self.metrics.upstream_time(inst.view.bucket, up)
        if watch.usage is not None:
            self.tracker.metered(s, watch.usage)
        await _try_write(out, None)
        return out

    # ---- errors ---------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        t0 = perf()
        try:
            resp = await handler(request)
        except ApiError as e:
            resp = json_error(e.status, e.message, e.param, e.code)
        except ConfigError as e:
            resp = json_error(400, str(e), e.field, "invalid_value")
        except StateError as e:
            resp = json_error(409, str(e), None, "conflict")
        except SessionError as e:
            resp = json_error(404, str(e), None, "session_not_found")
        except LibraError as e:
            resp = json_error(400, str(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = e.reason.lower().replace(" ", "_")
            resp = json_error(e.status, http_message(e, request, self.cfg.max_body_mb), code=code)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            resp = json_error(500, "internal server error; see the gateway log", code="internal_error")
        res = request.match_info.route.resource
        endpoint = res.canonical if res is not None else "unmatched"
        elapsed = perf() - t0
        self.metrics.request(endpoint, resp.status, elapsed)
        up = request.get(UPSTREAM_S)
        if up is not None:
            self.metrics.overhead_of(endpoint, elapsed - up)
        return resp


def _unauthorized(request: web.Request) -> web.Response:
    msg = "this call needs 'Authorization: Bearer <admin token>' (the gateway's admin_token)"
    return json_error(401, msg, "Authorization", "unauthorized")


def _check_id(value: str | None, field: str) -> str | None:
    """A session or prompt id goes back out in headers and keys the router's trees: printable
    (no control characters, which a header cannot carry) and at most MAX_HEADER_TEXT long."""
    if value is not None and not header_safe(value):
        msg = f"{field} must be at most {MAX_HEADER_TEXT} printable characters, got {len(value)} characters: {value[:40]!r}"  # fmt: skip
        raise ApiError(400, msg, field, "invalid_value")
    return value


async def _try_write(out: web.StreamResponse, data: bytes | None) -> bool:
    """Write (or end, with None) a stream whose client may have gone; False if it has."""
    try:
        if data is None:
            await out.write_eof()
        else:
            await out.write(data)
    except ConnectionResetError:
        return False
    return True


async def _forever(loop_fn) -> None:
    """Run a background loop; a bug in one iteration is logged and the loop restarts."""
    while True:
        try:
            await loop_fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s failed; restarting it", getattr(loop_fn, "__name__", loop_fn))
            await asyncio.sleep(1.0)


# ---- running it -------------------------------------------------------------------------------------


def serve(gw: Gateway, sock: socket.socket, access_log: bool = False) -> None:
    asyncio.run(_serve(gw, sock, access_log))


async def _serve(gw: Gateway, sock: socket.socket, access_log: bool) -> None:
    kwargs = {} if access_log else {"access_log": None}
    runner = limited_runner(gw.app(), gw.cfg.http_limits(), handler_cancellation=True, **kwargs)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=4096).start()
    host, port = sock.getsockname()[:2]
    buckets = ", ".join(f"{b.name} (tp{b.tp}, {b.max_context})" for b in gw.buckets)
    print(f"libra gateway (router {gw.cfg.router}; buckets {buckets}; {len(gw.pool.views)} backends) listening on http://{host}:{port}", flush=True)  # fmt: skip
    await serve_until_signalled(runner)
