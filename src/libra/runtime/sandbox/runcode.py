"""SandboxFusion's /run_code: a compile action, then a run action, in one sandbox.

A request becomes a `Job` (validated names, limits and the language's steps). Its compile step
(C++, Rust, Go, Java, JUnit) and its run step are each an action of the service's orchestrator,
the same elastic scheduler every action goes through: each queues FCFS and holds an exclusive core
only while it runs, and both belong to one trajectory, so the sandbox's memory is reserved on one
node from the compile to the end of the run. The sandbox (a `Box`) is made by the first step that
gets its grant and removed after the last, in the background. Python takes a warm sandbox when one
is ready.

The answer is SandboxFusion's: `compile_result` (null for languages without one), then
`run_result` (null when the compile failed), and `status` by SandboxFusion's rule
(schemas.overall_status).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from dataclasses import dataclass, field

from libra.actions import ActionState, Start
from libra.runtime.sandbox import languages, schemas
from libra.runtime.sandbox.boxes import Box
from libra.runtime.sandbox.budget import ResponseBudget
from libra.runtime.sandbox.caches import SharedCache
from libra.runtime.sandbox.sandbox import ExecResult, Limits, RunStatus, execute
from libra.runtime.sandbox.storage import Target, areas_of, decode_files, locate, require_relative

FETCH_MAX_BYTES = 8 * 2**20
# The marker a harness's output wrapper writes where it cut (languages.GO_TEST_CAP).
HARNESS_CUT = re.compile(r"\n\[\.\.\. truncated (\d+) bytes of output \.\.\.\]\n")
WARM_MIN_MB = 64  # a warm zygote holds ~15 MB already: below this, a fresh sandbox


@dataclass(slots=True)
class Job:
    """One validated /run_code request."""

    lang: languages.Language
    src: str
    files: dict[Target, bytes]  # the request's files and the code
    fetch: list[Target]
    stdin: bytes
    compile_lim: Limits
    run_lim: Limits
    reserve_mb: int  # what the scheduler reserves on the node while the job lives
    traj: str = field(default_factory=lambda: f"run:{uuid.uuid4().hex}")

    @property
    def areas(self) -> set[str]:
        return areas_of([*self.files, *self.fetch])

    @property
    def warm_eligible(self) -> bool:
        """A warm Python sandbox has only /workspace and /tmp: other absolute areas need binds; and
        its started interpreter already holds some memory, so a tiny limit starts afresh."""
        return self.lang.name == "python" and not self.areas and self.run_lim.memory_mb >= WARM_MIN_MB


def make_job(req: schemas.RunCodeRequest, lang: languages.Language, limits, reserved: frozenset[str],
             default_reserve_mb: int) -> Job:  # fmt: skip
    """`limits(timeout, timeout_field, memory_mb, output_bytes) -> Limits` applies the service's
    ceilings, naming the request's field in any error. Without a memory limit of its own (<= 0, as
    in SandboxFusion) a job runs up to the service's ceiling and reserves `default_reserve_mb`."""
    files = decode_files(req.files, reserved)
    src = languages.source_name(lang, req.code)
    code = locate(src, "code", reserved)
    files = {t: d for t, d in files.items() if (t.area, t.rel) != (code.area, code.rel)}
    files[code] = req.code.encode()
    fetch = [locate(n, f"fetch_files.{n[:200]}", reserved) for n in req.fetch_files]
    memory = req.memory_limit_MB if req.memory_limit_MB > 0 else None
    run_lim = limits(req.run_timeout, "run_timeout", memory, req.output_limit_bytes)
    compile_lim = limits(req.compile_timeout, "compile_timeout", memory, req.output_limit_bytes)
    return Job(
        lang,
        src,
        files,
        fetch,
        (req.stdin or "").encode(),
        compile_lim,
        run_lim,
        memory or default_reserve_mb,
    )


def check_areas(job: Job, sandboxed: bool) -> None:
    if not sandboxed:
        require_relative(job.files, "files")
        require_relative(job.fetch, "fetch_files")


class OneShot:
    """A job's life: its box, made by the first step that runs and removed after the last."""

    def __init__(self, svc, job: Job):
        self.svc, self.job = svc, job
        self.box: Box | None = None
        self.cache: SharedCache | None = None
        self.fetched: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.budget = ResponseBudget(svc.cfg.max_response_bytes)  # outputs, then files

    async def answer(self) -> dict:
        svc, job = self.svc, self.job
        compiled: ExecResult | None = None
        try:
            if job.lang.compile is not None:
                out = await svc.dispatch.run(svc.cpu_action(f"compile:{job.lang.name}", job.traj, job.reserve_mb),
                                             self._compile)  # fmt: skip
                compiled = self.budget.charge(out.result)
                svc.metrics.finished("compile", status_label(compiled), out.act_s, out.queue_s)
                if compiled.status != RunStatus.FINISHED or compiled.return_code != 0:
                    return response(compiled, None, {}, {})
            out = await svc.dispatch.run(svc.cpu_action(f"run_code:{job.lang.name}", job.traj, job.reserve_mb),
                                         self._run, one_shot=True)  # fmt: skip
            ran = out.result
            svc.metrics.finished("run_code", status_label(ran), out.act_s, out.queue_s)
            return response(compiled, ran, self.fetched, self.skipped)
        finally:
            if self.box is not None:
                svc.boxes.remove_soon(self.box)
            svc.orch.end_trajectory(job.traj)

    async def _ensure_box(self) -> Box | str:
        """The job's box, or why there is none (the sandbox's fault, answered as SandboxError)."""
        if self.box is None:
            self.cache = self.svc.caches.get(self.job.lang.cache or "")
            try:
                self.box = await self.svc.boxes.create(self.job.areas, [self.cache] if self.cache else [])
            except OSError as e:
                return f"could not make a sandbox: {e}"
            if self.box is None:
                return "no free sandbox uid; retry later"
            await asyncio.to_thread(self.svc.boxes.storages.write, self.box.storage, self.job.files)
        return self.box

    def _argv(self, step: tuple[str, ...], lim: Limits) -> list[str]:
        names = [t.name for t in self.job.files]
        svc, job = self.svc, self.job
        fallback = not svc.iso.memory_cgroup
        return languages.render(
            job.lang,
            step,
            job.src,
            svc.python,
            svc.toolchains,
            lim.memory_mb,
            names,
            fallback,
            lim.output_bytes,
        )

    async def _compile(self, start: Start) -> tuple[ExecResult, ActionState]:
        res = await self._step(self.job.lang.compile, self.job.compile_lim, start, b"")
        return res, state_of(res)

    async def _run(self, start: Start) -> tuple[ExecResult, ActionState]:
        job, warm = self.job, self.svc.warm
        sb = warm.take() if self.box is None and job.warm_eligible else None
        if sb is not None:
            res, self.fetched, self.skipped = await warm.run(
                sb, job.files, job.src, start.cores, job.run_lim, job.stdin, job.fetch, FETCH_MAX_BYTES, self.budget
            )  # fmt: skip
            return res, state_of(res)
        res = self.budget.charge(await self._step(job.lang.run, job.run_lim, start, job.stdin))
        if self.box is not None:
            self.fetched, self.skipped = await asyncio.to_thread(
                self.svc.boxes.storages.fetch, self.box.storage, job.fetch, FETCH_MAX_BYTES, self.budget
            )
        return res, state_of(res)

    async def _step(self, step: tuple[str, ...], lim: Limits, start: Start, stdin: bytes) -> ExecResult:
        box = await self._ensure_box()
        if isinstance(box, str):
            return ExecResult(RunStatus.ERROR, None, "", "", 0.0, message=box)
        lim = dataclasses.replace(lim, reserves_mb=self.job.lang.reserves_mb)
        env = dict(self.job.lang.env)
        if self.cache is not None:  # the shared build cache, seen through the box's own overlay
            env[self.cache.env] = self.cache.sandbox_path
        return await execute(self.svc.iso, self._argv(step, lim), box, start.cores, lim, stdin, env)


# ---- results ------------------------------------------------------------------------------------


def state_of(res: ExecResult) -> ActionState:
    if res.status == RunStatus.TIMEOUT:
        return ActionState.TIMED_OUT
    if res.status == RunStatus.FINISHED and res.return_code == 0:
        return ActionState.SUCCEEDED
    return ActionState.FAILED


def status_label(res: ExecResult) -> str:
    if res.status == RunStatus.TIMEOUT:
        return "timeout"
    if res.status == RunStatus.ERROR:
        return "sandbox_error"
    return "success" if res.return_code == 0 else "failed"


def notes(res: ExecResult) -> list[str]:
    """What the response's `message` says about one execution besides its output: how it died
    (the signal and the limit: `sandbox.explain`) and what of its output was cut."""
    parts = [res.message] if res.message else []
    if res.death:
        parts.append(res.death)
    inner = HARNESS_CUT.search(res.stdout) if not res.truncated and res.stdout else None
    if res.truncated or inner:
        dropped = res.truncated or int(inner.group(1))
        parts.append(f"output truncated at the output limit ({dropped} bytes dropped)")
    if res.capped:
        parts.append(
            f"output cut to fit the response cap ({res.capped} characters dropped, max_response_bytes)"
        )
    if res.leftovers_killed:
        parts.append(f"{res.leftovers_killed} leftover processes killed")
    return parts


def command_result(res: ExecResult) -> dict:
    if res.status == RunStatus.ERROR:  # the sandbox could not run it: SandboxFusion's Error
        return schemas.command_result("Error", None, None, "", res.message or "the sandbox failed")
    status = "TimeLimitExceeded" if res.status == RunStatus.TIMEOUT else "Finished"
    return schemas.command_result(status, round(res.wall_s, 6), res.return_code, res.stdout, res.stderr)


def response(compiled: ExecResult | None, ran: ExecResult | None, fetched: dict[str, str],
             skipped: dict[str, str]) -> dict:  # fmt: skip
    results = [(n, r) for n, r in (("compile", compiled), ("run", ran)) if r is not None]
    dicts = {n: command_result(r) for n, r in results}
    status, message = schemas.overall_status(list(dicts.values()))
    parts = [message] if message else []
    for name, r in results:
        parts += [f"{name}: {p}" if compiled is not None else p for p in notes(r) if p != message]
    if skipped:
        listed = "; ".join(f"{n[:100]}: {why}" for n, why in list(skipped.items())[:10])
        parts.append(f"fetch_files not returned: {listed}")
    return schemas.run_code_response(
        status, "; ".join(parts), dicts.get("compile"), dicts.get("run"), fetched
    )
