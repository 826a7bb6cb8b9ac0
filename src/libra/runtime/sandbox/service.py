"""The actions service: SandboxFusion's /run_code, sessions, tools, health and metrics over HTTP.

Every request that runs something is an action of the same orchestrator the simulator uses: it
queues FCFS, gets exclusive cores only while it runs (allocate on execution; a `parallel` hint
lets the scheduler grant more), and quota-limited tool calls wait for their quota. Bad requests
get a 4xx with a JSON body naming the field, the value and what is allowed; the service never
answers with a traceback and keeps serving whatever a sandboxed program does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ValidationError

from libra.actions import Action, ActionState, Orchestrator, ResourceVector, Start
from libra.actions.cpu import CpuManager, CpuNode
from libra.actions.profiles import load_profile
from libra.actions.quota import QuotaManager
from libra.core.errors import ConfigError, LibraError
from libra.runtime.jsonbody import BodyError, parse_body
from libra.runtime.sandbox import languages, runcode, schemas
from libra.runtime.sandbox.boxes import Box, Boxes
from libra.runtime.sandbox.budget import ResponseBudget
from libra.runtime.sandbox.caches import SharedCache, build_go_cache
from libra.runtime.sandbox.config import ServiceConfig
from libra.runtime.sandbox.dispatch import Dispatcher, Outcome
from libra.runtime.sandbox.metrics import ServiceMetrics
from libra.runtime.sandbox.sandbox import (
    ExecResult,
    Isolation,
    Limits,
    RunStatus,
    execute,
    python_executable,
    sandbox_path,
)
from libra.runtime.sandbox.storage import Storages, Target, areas_of, decode_files, locate, require_relative
from libra.runtime.sandbox.tools import call_http_tool, parse_summary, python_tests_argv
from libra.runtime.sandbox.uidrange import UidPool, UidRange
from libra.runtime.sandbox.warm import WarmPool
from libra.runtime.serving import BodyTimeout, read_body

log = logging.getLogger("libra.actions")

# First estimates of one-core durations, until the service has measured some of its own.
DEFAULT_T1 = {"run_code": 0.05, "compile": 1.0, "command": 1.0, "python_tests": 5.0, "http": 0.5}


class HttpError(Exception):
    """A 4xx/5xx with a JSON body."""

    def __init__(self, status: int, error: str, **detail: object):
        super().__init__(error)
        self.status, self.body = status, {"error": error, **detail}


@dataclass(slots=True)
class Session:
    id: str
    box: Box
    memory_mb: int
    created: float
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def local_cores(cfg: ServiceConfig) -> CpuNode:
    """The cores to schedule, grouped by NUMA domain as /sys describes them."""
    usable = os.sched_getaffinity(0)
    cores = sorted(set(cfg.cores) if cfg.cores is not None else usable)
    if not cores or not set(cores) <= usable:
        raise ConfigError("cores", cfg.cores, f"a non-empty subset of this process's CPUs {sorted(usable)}")
    if cfg.numa is not None:
        listed = [c for d in cfg.numa for c in d]
        if len(listed) != len(set(listed)):
            raise ConfigError("numa", cfg.numa, "domains that do not share a core")
        domains = [[c for c in d if c in cores] for d in cfg.numa]
    else:
        domains = [[c for c in d if c in cores] for d in _sys_numa()] or [cores]
    domains = [d for d in domains if d]
    covered = {c for d in domains for c in d}
    if covered != set(cores):
        domains.append([c for c in cores if c not in covered])
    memory = cfg.memory_gib or 0.75 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if memory * 1024 < cfg.session_memory_mb:
        raise ConfigError(
            "memory_gib", memory, f"room for one session (session_memory_mb = {cfg.session_memory_mb})"
        )
    return CpuNode(domains, memory)


def _sys_numa() -> list[list[int]]:
    out = []
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError, ValueError):
            out.append(_cpulist((d / "cpulist").read_text().strip()))
    return out


def _cpulist(text: str) -> list[int]:
    cores = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


class ActionsService:
    def __init__(self, cfg: ServiceConfig, isolation: Isolation, uids: UidRange | None = None):
        self.cfg, self.iso = cfg, isolation
        node = local_cores(cfg)
        self.cores = sorted(c for d in node.numa for c in d)
        self.orch = Orchestrator(cpu=CpuManager([node]), quota=QuotaManager(cfg.quotas))
        self.metrics = ServiceMetrics(len(self.cores))
        self.dispatch = Dispatcher(self.orch, self._gauges)
        self.sessions: dict[str, Session] = {}
        self.python = python_executable(cfg.sandbox)
        self.toolchains = languages.detect(sandbox_path(cfg.sandbox), self.python)
        self.caches: dict[str, SharedCache] = {}  # filled in the background at start (caches.py)
        self._go_cache: asyncio.Task | None = None
        self.profile = load_profile("parallel", cfg.parallel_profile, "parallel_profile")
        self.http = None
        for name, tool in cfg.http_tools.items():
            if tool.quota not in cfg.quotas:
                raise ConfigError(
                    f"http_tools.{name}.quota", tool.quota, sorted(cfg.quotas) or ["a quota under `quotas`"]
                )
        self.boxes = self._boxes(uids)
        sb = cfg.sandbox
        warm_lim = Limits(sb.default_timeout_s, sb.max_memory_mb, int(sb.max_timeout_s) + 2, sb.nproc, sb.fsize_mb,
                          sb.nofile, sb.output_limit_bytes)  # fmt: skip
        self.warm = WarmPool(isolation, self.boxes, self.python, warm_lim, cfg.warm_pool)

    def _boxes(self, uids: UidRange | None) -> Boxes:
        """Sandboxed, the uids are a range this process holds the locks of (uidrange.py), so the
        leftovers it kills after a run can only be its own, and its storage directory is named by
        that range (what an earlier owner that died left there is removed). Unsandboxed, uids are
        never used and storage is a fresh temp dir."""
        sb, iso = self.cfg.sandbox, self.iso
        if uids is not None:
            root = Path(sb.workdir_root or tempfile.gettempdir()) / f"libra-actions-{uids.base}"
            pool = UidPool(uids.base, sb.uid_count)
        else:
            root = Path(tempfile.mkdtemp(prefix="libra-actions-", dir=sb.workdir_root))
            pool = UidPool(sb.uid_base or 0, sb.uid_count)
        storages = Storages(root, sb.disk_mb, tmpfs=iso.tmpfs, chown=iso.sandboxed)
        return Boxes(pool, storages, iso.cgroups, self.cores, iso.sandboxed)

    # ---- the app -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.add_routes([
            web.post("/run_code", self.run_code),
            web.get("/v1/ping", self.ping),
            web.post("/sessions", self.create_session),
            web.get("/sessions/{sid}", self.get_session),
            web.post("/sessions/{sid}/actions", self.session_action),
            web.delete("/sessions/{sid}", self.delete_session),
            web.post("/tools/{name}", self.call_tool),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_page),
        ])  # fmt: skip
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        import aiohttp

        self.http = aiohttp.ClientSession()
        self.warm.refill()
        if self.iso.tmpfs and {"go", "go_test"} & set(self.toolchains.available):
            self._go_cache = asyncio.get_running_loop().create_task(self._build_go_cache())

    async def _build_go_cache(self) -> None:
        try:
            self.caches["go"] = await build_go_cache(sandbox_path(self.cfg.sandbox))
        except Exception:  # Go still works, with a cold cache per run
            log.exception("the shared Go build cache could not be built")

    async def _cleanup(self, app: web.Application) -> None:
        if self._go_cache is not None:
            self._go_cache.cancel()
            with contextlib.suppress(BaseException):
                await self._go_cache
        await self.dispatch.close()
        await self.warm.close()
        if self.http is not None:
            await self.http.close()
        for s in list(self.sessions.values()):
            self._drop_session(s)
        await self.boxes.drain()
        await asyncio.to_thread(self.boxes.storages.cleanup)
        if self.iso.cgroups is not None:
            await asyncio.to_thread(self.iso.cgroups.close)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as e:
            return web.json_response(e.body, status=e.status)
        except LibraError as e:
            self.metrics.rejected.labels("invalid").inc()
            body = {"error": str(e)}
            if isinstance(e, ConfigError):
                body.update(field=e.field, value=_jsonable(e.value), allowed=e.allowed)
            return web.json_response(body, status=422)
        except web.HTTPException as e:  # unknown route, wrong method ...
            return web.json_response({"error": e.reason}, status=e.status)
        except Exception:
            log.exception("unexpected error serving %s", request.path)
            return web.json_response({"error": "internal error; the service keeps running"}, status=500)

    # ---- request parsing ---------------------------------------------------------------------

    async def _parse(self, request: web.Request, model: type[BaseModel]) -> BaseModel:
        raw = await self._read_body(request)
        try:
            data = parse_body(raw) if raw.strip() else {}
        except BodyError as e:
            if e.field is None:
                self.metrics.rejected.labels("malformed").inc()
                raise HttpError(400, "malformed JSON", detail=str(e)[:200]) from None
            self.metrics.rejected.labels("invalid").inc()
            raise HttpError(
                422, "invalid request", detail=[{"field": e.field, "allowed": e.allowed}]
            ) from None
        if not isinstance(data, dict):
            raise HttpError(400, "the request body must be a JSON object", got=type(data).__name__)
        try:
            return model.model_validate(data)
        except ValidationError as err:
            self.metrics.rejected.labels("invalid").inc()
            raise HttpError(422, "invalid request", detail=_validation_detail(err)) from None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            await _discard(request, 4 * limit)
            self.metrics.rejected.labels("too_large").inc()
            raise HttpError(
                400, "request body too large", limit_bytes=limit, got_bytes=request.content_length
            )
        try:
            return await read_body(request)
        except BodyTimeout as e:
            self.metrics.rejected.labels("body_timeout").inc()
            raise HttpError(408, str(e), field="body_timeout_s", limit_s=e.seconds) from None
        except web.HTTPRequestEntityTooLarge:
            await _discard(request, 4 * limit)
            self.metrics.rejected.labels("too_large").inc()
            raise HttpError(400, "request body too large", limit_bytes=limit) from None

    def _check_size(self, field: str, text: str | None) -> None:
        if text is not None and len(text.encode()) > self.cfg.max_code_bytes:
            raise HttpError(422, "invalid request", detail=[{"field": field, "value": f"{len(text)} characters",
                            "allowed": f"at most {self.cfg.max_code_bytes} bytes"}])  # fmt: skip

    def _limits(self, timeout: float | None, timeout_field: str, memory_mb: int | None,
                output_bytes: int | None = None) -> Limits:  # fmt: skip
        """An execution's limits: the request's where it gives them, within the service's ceilings.
        No memory limit of its own means the ceiling (SandboxFusion's -1: no limit)."""
        sb = self.cfg.sandbox
        timeout = timeout or sb.default_timeout_s
        if timeout > sb.max_timeout_s:
            raise ConfigError(timeout_field, timeout, f"<= {sb.max_timeout_s:g} seconds")
        mem = memory_mb or sb.max_memory_mb
        if not 16 <= mem <= sb.max_memory_mb:
            raise ConfigError("memory_limit_MB", mem, f"-1 (no limit of its own) or 16 to {sb.max_memory_mb}")
        out = output_bytes or sb.output_limit_bytes
        if out > sb.output_limit_bytes:
            raise ConfigError("output_limit_bytes", out, f"at most {sb.output_limit_bytes} (the service's)")
        return Limits(timeout, mem, int(timeout) + 2, sb.nproc, sb.fsize_mb, sb.nofile, out)

    def _admit_queue(self) -> None:
        if self.orch.waiting >= self.cfg.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise HttpError(503, "the action queue is full; retry later", queue=self.orch.waiting)

    def _action(self, aid: str, kind: str, traj: str, cpu: object, memory_mb: int, parallel: bool) -> Action:
        t1 = self.orch.estimator.get(kind, DEFAULT_T1.get(kind.split(":")[0], 1.0), traj)
        demand = ResourceVector.from_mapping({"cpu": cpu, "memory": memory_mb / 1024}, key="cpu")
        return Action(aid, traj, kind, t1, demand, self.profile if parallel else None)

    def cpu_action(self, kind: str, traj: str, memory_mb: int) -> Action:
        """A one-core action of a /run_code step."""
        return self._action(uuid.uuid4().hex, kind, traj, 1, memory_mb, False)

    # ---- /run_code (SandboxFusion) -----------------------------------------------------------

    async def run_code(self, request: web.Request) -> web.Response:
        req = await self._parse(request, schemas.RunCodeRequest)
        self._check_size("code", req.code)
        if req.language not in languages.SANDBOXFUSION_LANGUAGES:
            self.metrics.rejected.labels("invalid").inc()
            raise HttpError(422, "invalid request", detail=[{"field": "language", "value": _jsonable(req.language, 40),
                            "allowed": list(self.toolchains.available)}])  # fmt: skip
        if req.language not in self.toolchains.available:
            self.metrics.finished("run_code", "sandbox_error", 0.0, 0.0)
            return web.json_response(schemas.sandbox_error(self.toolchains.missing_message(req.language)))
        lang = languages.LANGUAGES[req.language]
        job = runcode.make_job(req, lang, self._limits, self.iso.reserved_tops, self.cfg.sandbox.memory_mb)
        runcode.check_areas(job, self.iso.sandboxed)
        self._admit_queue()
        return await _json_response(await runcode.OneShot(self, job).answer())

    async def ping(self, request: web.Request) -> web.Response:
        return web.json_response("pong")  # SandboxFusion's /v1/ping: the JSON string "pong"

    # ---- sessions ----------------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        req = await self._parse(request, schemas.SessionCreate)
        files = decode_files(req.files, self.iso.reserved_tops)
        if not self.iso.sandboxed:
            require_relative(files, "files")
        if len(self.sessions) >= self.cfg.max_sessions:
            raise HttpError(503, "too many open sessions; delete some", limit=self.cfg.max_sessions)
        mem = req.memory_mb or self.cfg.session_memory_mb
        if not self.orch.cpu.can_ever_pin(mem / 1024):
            raise ConfigError("memory_mb", mem, "at most the service's sandbox memory")
        if mem > self.cfg.sandbox.max_memory_mb:
            raise ConfigError(
                "memory_mb", mem, f"at most {self.cfg.sandbox.max_memory_mb} (sandbox.max_memory_mb)"
            )
        try:
            box = await self.boxes.create(areas_of(files))
        except OSError as e:
            raise HttpError(503, "could not make a sandbox", detail=str(e)[:200]) from None
        if box is None:
            raise HttpError(503, "no free sandbox uid; delete some sessions")
        try:
            await asyncio.to_thread(self.boxes.storages.write, box.storage, files)
        except BaseException:  # a file the storage cannot hold: give the uid and the box back
            await self.boxes.remove(box)
            raise
        now = time.monotonic()
        s = Session(uuid.uuid4().hex, box, mem, now, now)
        self.sessions[s.id] = s
        self.metrics.sessions.set(len(self.sessions))
        return web.json_response({"session_id": s.id, "memory_mb": mem, "workdir": "/workspace"}, status=201)

    def _session(self, request: web.Request) -> Session:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            raise HttpError(404, "no such session", session_id=request.match_info["sid"][:100])
        return s

    async def get_session(self, request: web.Request) -> web.Response:
        s = self._session(request)
        node = self.orch.cpu.node_of(s.id)
        return web.json_response({"session_id": s.id, "memory_mb": s.memory_mb, "pinned_node": node,
                                  "idle_s": time.monotonic() - s.last_used})  # fmt: skip

    async def session_action(self, request: web.Request) -> web.Response:
        s = self._session(request)
        req = await self._parse(request, schemas.SessionAction)
        self._check_size("command", req.command)
        files = decode_files(req.files, self.iso.reserved_tops)
        fetch = [locate(n, f"fetch_files.{n[:200]}", self.iso.reserved_tops) for n in req.fetch_files]
        if not self.iso.sandboxed:
            require_relative(files, "files")
            require_relative(fetch, "fetch_files")
        lim = self._limits(req.timeout, "timeout", s.memory_mb)
        parallel = min(req.parallel or (4 if req.tool else 1), self.cfg.max_parallel, len(self.cores))
        kind = req.kind or (req.tool or "command")
        self._admit_queue()
        cpu = [1, parallel] if parallel > 1 else 1
        action = self._action(uuid.uuid4().hex, kind, s.id, cpu, s.memory_mb, parallel > 1)

        async def work(start: Start):
            return await self._run_in_session(start, s, req, files, fetch, lim)

        async with s.lock:  # a session's actions run one after another, like a trajectory's
            s.last_used = time.monotonic()
            out = await self.dispatch.run(action, work)
            s.last_used = time.monotonic()
        res, fetched, skipped = out.result
        self.metrics.finished("session", runcode.status_label(res), out.act_s, out.queue_s)
        return await _json_response(_session_body(res, fetched, skipped, out, req.tool))

    async def _run_in_session(self, start: Start, s: Session, req, files: dict[Target, bytes],
                              fetch: list[Target], lim: Limits):  # fmt: skip
        if s.id not in self.sessions:
            res = ExecResult(RunStatus.ERROR, None, "", "", 0.0, message="session deleted")
            return (res, {}, {}), ActionState.FAILED
        storages = self.boxes.storages
        await asyncio.to_thread(storages.write, s.box.storage, files)
        if req.tool == "python_tests":
            argv = python_tests_argv(self.python, req.path, start.units, req.args)
        else:
            argv = ["bash", "-c", req.command.replace("{parallel}", str(start.units))]
        res = await execute(self.iso, argv, s.box, start.cores, lim, (req.stdin or "").encode())
        budget = ResponseBudget(self.cfg.max_response_bytes)  # outputs, then files
        budget.charge(res)
        fetched, skipped = await asyncio.to_thread(
            storages.fetch, s.box.storage, fetch, runcode.FETCH_MAX_BYTES, budget
        )
        return (res, fetched, skipped), runcode.state_of(res)

    async def delete_session(self, request: web.Request) -> web.Response:
        s = self._session(request)
        async with s.lock:  # let a running action finish first
            self._drop_session(s)
        return web.json_response({"deleted": s.id})

    def _drop_session(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        self.orch.end_trajectory(s.id)
        self.boxes.remove_soon(s.box)
        self.metrics.sessions.set(len(self.sessions))

    # ---- quota-limited HTTP tools -------------------------------------------------------------

    async def call_tool(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        tool = self.cfg.http_tools.get(name)
        if tool is None:
            raise HttpError(404, "no such tool", tool=name, allowed=sorted(self.cfg.http_tools))
        req = await self._parse(request, schemas.ToolCall)
        tokens = req.tokens or tool.tokens_per_call
        self._admit_queue()
        demand = ResourceVector.from_mapping({f"quota:{tool.quota}": tokens})
        t1 = self.orch.estimator.get(f"http:{name}", DEFAULT_T1["http"])
        action = Action(uuid.uuid4().hex, f"tool:{name}", f"http:{name}", t1, demand)

        async def work(start: Start):
            return await call_http_tool(self.http, tool, req.payload)

        out = await self.dispatch.run(action, work)
        body = dict(out.result)
        self.metrics.finished(
            "tool", "success" if body["status"] == "Success" else "failed", out.act_s, out.queue_s
        )
        body.update(queue_s=out.queue_s, act_s=out.act_s)
        return web.json_response(body)

    # ---- health and metrics ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({
            "status": "ok", "isolation": "bwrap" if self.iso.sandboxed else "none",
            "cores": len(self.cores), "cores_busy": self.orch.cpu.busy_count(), "queue": self.orch.waiting,
            "running": self.orch.running, "sessions": len(self.sessions),
            "uids": [self.boxes.uids.range.start, self.boxes.uids.range.stop - 1],
            "languages": list(self.toolchains.available), "missing_languages": self.toolchains.missing,
            "limits": self.iso.notes,
        })  # fmt: skip

    async def metrics_page(self, request: web.Request) -> web.Response:
        self._gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    def _gauges(self) -> None:
        self.metrics.queue.set(self.orch.waiting)
        self.metrics.running.set(self.orch.running)
        self.metrics.cores_busy.set(self.orch.cpu.busy_count())


# ---- helpers -------------------------------------------------------------------------------------


async def _discard(request: web.Request, cap: int) -> None:
    """Read what is left of an oversized body, so the client sees our answer, not a reset."""
    seen = 0
    with contextlib.suppress(Exception):
        while seen < cap and (chunk := await request.content.readany()):
            seen += len(chunk)


def _validation_detail(err: ValidationError) -> list[dict]:
    out = []
    for e in err.errors()[:10]:
        loc = ".".join(str(p) for p in e.get("loc", ())) or "body"
        out.append(
            {"field": loc[:200], "value": _jsonable(e.get("input")), "allowed": e.get("msg", "")[:500]}
        )
    return out


def _jsonable(v: object, limit: int = 200) -> object:
    """A value to quote back in an error: short, whatever its type (never a whole request back)."""
    if isinstance(v, str):
        return v if len(v) <= limit else v[:limit] + "..."
    if isinstance(v, dict):
        return f"an object with keys {_jsonable(sorted(map(str, v))[:10], limit)}"
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return v if len(text) <= limit else text[:limit] + "..."


async def _json_response(body: dict) -> web.Response:
    """A JSON response; a large one (megabytes of program output) is encoded in a worker thread,
    so the event loop keeps serving meanwhile."""
    out = body.get("run_result") or {}
    size = len(out.get("stdout") or "") + len(out.get("stderr") or "")
    if size < 1 << 20:
        return web.json_response(body)
    text = await asyncio.to_thread(json.dumps, body)
    return web.Response(text=text, content_type="application/json")


def _session_body(res: ExecResult, fetched: dict[str, str], skipped: dict[str, str], out: Outcome,
                  tool: str | None) -> dict:  # fmt: skip
    body = runcode.response(None, res, fetched, skipped)
    body.update(
        cores=list(out.cores), parallel=out.units, queue_s=out.queue_s, exec_s=out.exec_s, act_s=out.act_s
    )
    if tool == "python_tests":
        body["tests"] = parse_summary(res.stdout)
    return body
