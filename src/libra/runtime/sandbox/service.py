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
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from aiohttp import web
from pydantic import BaseModel, ValidationError

from libra.actions import Action, ActionState, Orchestrator, ResourceVector, Start
from libra.actions.cpu import CpuManager, CpuNode
from libra.actions.profiles import load_profile
from libra.actions.quota import QuotaManager
from libra.core.errors import ConfigError, LibraError
from libra.runtime.jsonbody import BodyError, parse_body
from libra.runtime.sandbox import schemas
from libra.runtime.sandbox.config import ServiceConfig
from libra.runtime.sandbox.dispatch import Dispatcher, Outcome
from libra.runtime.sandbox.metrics import ServiceMetrics
from libra.runtime.sandbox.sandbox import ExecResult, Isolation, Limits, RunStatus, execute, python_executable
from libra.runtime.sandbox.tools import call_http_tool, parse_summary, python_tests_argv
from libra.runtime.sandbox.uidrange import UidRange
from libra.runtime.sandbox.warm import WarmPool
from libra.runtime.sandbox.workspace import UidPool, Workspaces, decode_files

log = logging.getLogger("libra.actions")

# First estimates of one-core durations, until the service has measured some of its own.
DEFAULT_T1 = {"run_code": 0.05, "command": 1.0, "python_tests": 5.0, "http": 0.5}
FETCH_MAX_BYTES = 8 * 2**20


class HttpError(Exception):
    """A 4xx/5xx with a JSON body."""

    def __init__(self, status: int, error: str, **detail: object):
        super().__init__(error)
        self.status, self.body = status, {"error": error, **detail}


@dataclass(slots=True)
class Session:
    id: str
    uid: int
    workdir: Path
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
        # Sandboxed, the uids are a range this process holds the locks of (uidrange.py), so the
        # leftovers it kills after a run can only be its own. Unsandboxed, they are never used.
        base = uids.base if uids is not None else (cfg.sandbox.uid_base or 0)
        self.uids = UidPool(base, cfg.sandbox.uid_count)
        self.ws = Workspaces(cfg.sandbox.workdir_root, chown=isolation.sandboxed)
        self.sessions: dict[str, Session] = {}
        self.python = python_executable(cfg.sandbox)
        self.profile = load_profile("parallel", cfg.parallel_profile, "parallel_profile")
        self.http = None
        sb = cfg.sandbox
        warm_lim = Limits(sb.default_timeout_s, sb.memory_mb, int(sb.max_timeout_s) + 2, sb.nproc, sb.fsize_mb,
                          sb.nofile, sb.output_limit_bytes)  # fmt: skip
        self.warm = WarmPool(isolation, self.ws, self.uids, self.python, warm_lim, cfg.warm_pool)
        for name, tool in cfg.http_tools.items():
            if tool.quota not in cfg.quotas:
                raise ConfigError(
                    f"http_tools.{name}.quota", tool.quota, sorted(cfg.quotas) or ["a quota under `quotas`"]
                )

    # ---- the app -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.add_routes([
            web.post("/run_code", self.run_code),
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

    async def _cleanup(self, app: web.Application) -> None:
        await self.dispatch.close()
        await self.warm.close()
        if self.http is not None:
            await self.http.close()
        for s in list(self.sessions.values()):
            self._drop_session(s)
        self.ws.cleanup()

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
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            await _discard(request, 4 * limit)
            self.metrics.rejected.labels("too_large").inc()
            raise HttpError(400, "request body too large", limit_bytes=limit) from None

    def _check_size(self, field: str, text: str | None) -> None:
        if text is not None and len(text.encode()) > self.cfg.max_code_bytes:
            raise HttpError(422, "invalid request", detail=[{"field": field, "value": f"{len(text)} characters",
                            "allowed": f"at most {self.cfg.max_code_bytes} bytes"}])  # fmt: skip

    def _limits(self, timeout: float | None, memory_mb: int | None) -> Limits:
        sb = self.cfg.sandbox
        timeout = timeout or sb.default_timeout_s
        if timeout > sb.max_timeout_s:
            raise ConfigError("run_timeout", timeout, f"<= {sb.max_timeout_s:g} seconds")
        mem = memory_mb or sb.memory_mb
        if mem > sb.max_memory_mb:
            raise ConfigError(
                "memory_limit_MB", mem, f"<= {sb.max_memory_mb} (-1 for the default {sb.memory_mb})"
            )
        return Limits(timeout, mem, int(timeout) + 2, sb.nproc, sb.fsize_mb, sb.nofile, sb.output_limit_bytes)

    def _admit_queue(self) -> None:
        if self.orch.waiting >= self.cfg.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise HttpError(503, "the action queue is full; retry later", queue=self.orch.waiting)

    def _action(self, aid: str, kind: str, traj: str, cpu: object, memory_mb: int, parallel: bool) -> Action:
        t1 = self.orch.estimator.get(kind, DEFAULT_T1.get(kind.split(":")[0], 1.0), traj)
        demand = ResourceVector.from_mapping({"cpu": cpu, "memory": memory_mb / 1024}, key="cpu")
        return Action(aid, traj, kind, t1, demand, self.profile if parallel else None)

    # ---- /run_code (SandboxFusion) -----------------------------------------------------------

    async def run_code(self, request: web.Request) -> web.Response:
        req = await self._parse(request, schemas.RunCodeRequest)
        self._check_size("code", req.code)
        files = decode_files(req.files)
        lim = self._limits(req.run_timeout, None if req.memory_limit_MB == -1 else req.memory_limit_MB)
        self._admit_queue()
        aid = uuid.uuid4().hex
        action = self._action(aid, f"run_code:{req.language}", f"run:{aid}", 1, lim.memory_mb, False)
        stdin = (req.stdin or "").encode()

        async def work(start: Start):
            return await self._run_once(start, req, files, lim, stdin)

        out = await self.dispatch.run(action, work, one_shot=True)
        res, fetched = out.result
        self.metrics.finished("run_code", _status_label(res), out.act_s, out.queue_s)
        return web.json_response(_run_code_body(res, fetched))

    async def _run_once(self, start: Start, req, files, lim: Limits, stdin: bytes):
        warm = (
            self.warm.take()
            if req.language == "python" and lim.memory_mb == self.cfg.sandbox.memory_mb
            else None
        )
        if warm is not None:
            code = {**files, PurePosixPath("_libra_main.py"): req.code.encode()}
            res, fetched = await self.warm.run(warm, code, "_libra_main.py", start.cores, lim.timeout_s, stdin,
                                               req.fetch_files, FETCH_MAX_BYTES)  # fmt: skip
            return (res, fetched), _state(res)
        uid = self.uids.acquire()
        if uid is None:
            return (
                ExecResult(RunStatus.ERROR, None, "", "", 0.0, message="no free sandbox uid"),
                {},
            ), ActionState.FAILED
        workdir = self.ws.create(uid)
        try:
            main = "_libra_main.py" if req.language == "python" else "_libra_main.sh"
            self.ws.write(workdir, {**files, PurePosixPath(main): req.code.encode()}, uid)
            argv = [self.python, main] if req.language == "python" else ["bash", main]
            res = await execute(self.iso, argv, workdir, uid, start.cores, lim, stdin)
            fetched = self.ws.fetch(workdir, req.fetch_files, FETCH_MAX_BYTES)
        finally:
            self.ws.remove(workdir)
            self.uids.release(uid)
        return (res, fetched), _state(res)

    # ---- sessions ----------------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        req = await self._parse(request, schemas.SessionCreate)
        files = decode_files(req.files)
        if len(self.sessions) >= self.cfg.max_sessions:
            raise HttpError(503, "too many open sessions; delete some", limit=self.cfg.max_sessions)
        mem = req.memory_mb or self.cfg.session_memory_mb
        if not self.orch.cpu.can_ever_pin(mem / 1024):
            raise ConfigError("memory_mb", mem, "at most the service's sandbox memory")
        uid = self.uids.acquire()
        if uid is None:
            raise HttpError(503, "no free sandbox uid; delete some sessions")
        workdir = self.ws.create(uid)
        try:
            self.ws.write(workdir, files, uid)
        except BaseException:  # a file the work dir cannot hold: give the uid and the dir back
            self.ws.remove(workdir)
            self.uids.release(uid)
            raise
        now = time.monotonic()
        s = Session(uuid.uuid4().hex, uid, workdir, mem, now, now)
        self.sessions[s.id] = s
        self.metrics.sessions.set(len(self.sessions))
        return web.json_response({"session_id": s.id, "memory_mb": mem, "workdir": "/workspace"}, status=201)

    def _session(self, request: web.Request) -> Session:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            raise HttpError(404, "no such session", session_id=request.match_info["sid"])
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
        files = decode_files(req.files)
        lim = self._limits(req.timeout, s.memory_mb)
        parallel = min(req.parallel or (4 if req.tool else 1), self.cfg.max_parallel, len(self.cores))
        kind = req.kind or (req.tool or "command")
        self._admit_queue()
        cpu = [1, parallel] if parallel > 1 else 1
        action = self._action(uuid.uuid4().hex, kind, s.id, cpu, s.memory_mb, parallel > 1)

        async def work(start: Start):
            return await self._run_in_session(start, s, req, files, lim)

        async with s.lock:  # a session's actions run one after another, like a trajectory's
            s.last_used = time.monotonic()
            out = await self.dispatch.run(action, work)
            s.last_used = time.monotonic()
        res, fetched = out.result
        self.metrics.finished("session", _status_label(res), out.act_s, out.queue_s)
        return web.json_response(_session_body(res, fetched, out, req.tool))

    async def _run_in_session(self, start: Start, s: Session, req, files, lim: Limits):
        if s.id not in self.sessions:
            return (
                ExecResult(RunStatus.ERROR, None, "", "", 0.0, message="session deleted"),
                {},
            ), ActionState.FAILED
        self.ws.write(s.workdir, files, s.uid)
        if req.tool == "python_tests":
            argv = python_tests_argv(self.python, req.path, start.units, req.args)
        else:
            argv = ["bash", "-c", req.command.replace("{parallel}", str(start.units))]
        res = await execute(self.iso, argv, s.workdir, s.uid, start.cores, lim, (req.stdin or "").encode())
        fetched = self.ws.fetch(s.workdir, req.fetch_files, FETCH_MAX_BYTES)
        return (res, fetched), _state(res)

    async def delete_session(self, request: web.Request) -> web.Response:
        s = self._session(request)
        async with s.lock:  # let a running action finish first
            self._drop_session(s)
        return web.json_response({"deleted": s.id})

    def _drop_session(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        self.orch.end_trajectory(s.id)
        self.ws.remove(s.workdir)
        self.uids.release(s.uid)
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
            "uids": [self.uids.range.start, self.uids.range.stop - 1],
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
        out.append({"field": loc, "value": _jsonable(e.get("input")), "allowed": e.get("msg", "")})
    return out


def _jsonable(v: object) -> object:
    if isinstance(v, str) and len(v) > 200:
        return v[:200] + "..."
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)[:200]


def _state(res: ExecResult) -> ActionState:
    if res.status == RunStatus.TIMEOUT:
        return ActionState.TIMED_OUT
    if res.status == RunStatus.FINISHED and res.return_code == 0:
        return ActionState.SUCCEEDED
    return ActionState.FAILED


def _status_label(res: ExecResult) -> str:
    if res.status == RunStatus.TIMEOUT:
        return "timeout"
    if res.status == RunStatus.ERROR:
        return "sandbox_error"
    return "success" if res.return_code == 0 else "failed"


def _message(res: ExecResult) -> str:
    parts = [res.message] if res.message else []
    if res.return_code is not None and res.return_code < 0:
        parts.append(f"killed by signal {-res.return_code}")
    if res.status == RunStatus.TIMEOUT:
        parts.append("time limit exceeded; the whole process tree was killed")
    if res.truncated:
        parts.append(f"output truncated ({res.truncated} bytes dropped)")
    if res.leftovers_killed:
        parts.append(f"{res.leftovers_killed} leftover processes killed")
    return "; ".join(parts)


def _run_result(res: ExecResult) -> dict | None:
    if res.status == RunStatus.ERROR:
        return None
    status = "TimeLimitExceeded" if res.status == RunStatus.TIMEOUT else "Finished"
    return schemas.run_result(status, round(res.wall_s, 6), res.return_code, res.stdout, res.stderr)


def _run_code_body(res: ExecResult, fetched: dict[str, str]) -> dict:
    status = {"success": "Success", "sandbox_error": "SandboxError"}.get(_status_label(res), "Failed")
    return schemas.run_code_response(status, _message(res), _run_result(res), fetched)


def _session_body(res: ExecResult, fetched: dict[str, str], out: Outcome, tool: str | None) -> dict:
    body = _run_code_body(res, fetched)
    body.update(
        cores=list(out.cores), parallel=out.units, queue_s=out.queue_s, exec_s=out.exec_s, act_s=out.act_s
    )
    if tool == "python_tests":
        body["tests"] = parse_summary(res.stdout)
    return body
