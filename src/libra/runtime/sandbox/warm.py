"""Warm start for /run_code in Python: sandboxes started ahead of time, waiting for their code.

Starting an interpreter (with its site-packages) is most of the cost of a trivial action. So a
few sandboxes are kept ready: each is built exactly like a cold one (same namespaces, uid,
rlimits, storage, cgroup) and runs a tiny zygote that has finished starting Python and blocks on a
control pipe (its fd number is the zygote's argument). A request writes its files into that
sandbox's storage and sets its cgroup's memory and cpuset, then sends the granted cores and the
script's name; the zygote pins itself to those cores (and, without a cpuset, lowers its
address-space limit to the request's and installs the seccomp filter that keeps it there) and
runs the script as `__main__`, with output exactly as `python script.py` prints it (a syntax error
included). The process then exits and the sandbox is removed in the background; a new one is
started. Other languages, and requests naming absolute paths outside /workspace and /tmp (which
need binds made at start), take the cold path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

from libra.runtime.sandbox.boxes import Box, Boxes
from libra.runtime.sandbox.budget import ResponseBudget
from libra.runtime.sandbox.sandbox import ExecResult, Isolation, Limits, RunStatus, spawn, supervise
from libra.runtime.sandbox.storage import Target

log = logging.getLogger("libra.actions")

ZYGOTE = r"""
import os, sys, json
def _libra_zygote():
    with os.fdopen(int(sys.argv[1]), "rb") as ctl:
        line = ctl.readline()
    if not line:
        os._exit(0)
    msg = json.loads(line)
    import resource
    for limit, value in ((resource.RLIMIT_AS, msg.get("as")), (resource.RLIMIT_CPU, msg.get("cpu"))):
        if value:
            resource.setrlimit(limit, (value, value))
    if msg.get("cores"):
        os.sched_setaffinity(0, msg["cores"])
    if msg.get("seccomp"):
        import ctypes
        prog = ctypes.create_string_buffer(bytes.fromhex(msg["seccomp"]))
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        fprog = Prog(len(prog.raw) // 8, ctypes.addressof(prog))
        if ctypes.CDLL(None, use_errno=True).prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
            os.write(2, b"sandbox: could not install its seccomp filter\n")
            os._exit(125)
    path = os.path.abspath(msg["path"])
    sys.argv = [msg["path"]]
    sys.path[0] = os.path.dirname(path)
    import types
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    status = 0
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        exec(code, main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        # As `python file.py` reports it: through sys.excepthook, from the program's own first
        # frame (a SyntaxError has none), never showing this zygote's frames.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        status = 1
    # What interpreter shutdown would do for the program (threads, atexit, flushing), without
    # tearing down every module, which costs more than the trivial program itself.
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
_libra_zygote()
"""


@dataclass(slots=True)
class WarmSandbox:
    proc: asyncio.subprocess.Process
    box: Box
    ctl: int  # write end of the control pipe


class WarmPool:
    def __init__(self, iso: Isolation, boxes: Boxes, python: str, lim: Limits, size: int):
        self.iso, self.boxes, self.python, self.lim, self.size = iso, boxes, python, lim, size
        self._ready: deque[WarmSandbox] = deque()
        self._starting = 0
        self._closed = False
        self._tasks: set[asyncio.Task] = set()

    def refill(self) -> None:
        while not self._closed and len(self._ready) + self._starting < self.size:
            self._starting += 1
            t = asyncio.get_running_loop().create_task(self._start_one())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _start_one(self) -> None:
        try:
            box = await self.boxes.create()
            if box is None:
                return
            r, w = os.pipe()
            try:
                argv = [self.python, "-c", ZYGOTE, str(r)]
                proc = await spawn(self.iso, argv, box, (), self.lim, pass_fds=(r,), seccomp=False)
            finally:
                os.close(r)
            if isinstance(proc, ExecResult) or self._closed:
                os.close(w)
                if not isinstance(proc, ExecResult):
                    await self._retire(WarmSandbox(proc, box, -1))
                self.boxes.remove_soon(box)
                return
            self._ready.append(WarmSandbox(proc, box, w))
        except Exception:
            log.exception("a warm sandbox could not be started")
        finally:
            self._starting -= 1

    def take(self) -> WarmSandbox | None:
        """A ready sandbox (its zygote may still be finishing its start-up), or None."""
        while self._ready:
            sb = self._ready.popleft()
            if sb.proc.returncode is None:
                return sb  # refilled when it is done, so start-up does not compete with its run
            os.close(sb.ctl)
            self.boxes.remove_soon(sb.box)
        self.refill()
        return None

    async def run(self, sb: WarmSandbox, files: dict[Target, bytes], script: str, cores, lim: Limits,
                  stdin: bytes, fetch: list[Target], fetch_max: int,
                  budget: ResponseBudget) -> tuple[ExecResult, dict[str, str], dict[str, str]]:  # fmt: skip
        t0 = time.monotonic()
        try:
            try:
                problem = await asyncio.to_thread(self._prepare, sb.box, files, lim, cores)
            except BaseException:  # the request's files do not fit: the zygote never runs it
                await self._retire(sb)
                raise
            if problem:
                await self._retire(sb)
                return ExecResult(RunStatus.ERROR, None, "", "", 0.0, message=problem), {}, {}
            self._send(sb, script, cores, lim)
            res = budget.charge(await supervise(self.iso, sb.proc, sb.box, lim, stdin, t0))
            fetched, skipped = await asyncio.to_thread(
                self.boxes.storages.fetch, sb.box.storage, fetch, fetch_max, budget
            )
            return res, fetched, skipped
        finally:
            self.boxes.remove_soon(sb.box)
            self.refill()

    def _prepare(self, box: Box, files: dict[Target, bytes], lim: Limits, cores) -> str | None:
        """In a worker thread: the request's files in, the cgroup's limits set (or why not)."""
        self.boxes.storages.write(box.storage, files)
        try:
            box.limit(lim.memory_mb, cores)
        except OSError as e:
            return f"could not set the sandbox's limits: {e}"
        return None

    def _send(self, sb: WarmSandbox, script: str, cores, lim: Limits) -> None:
        """Tell the zygote what to run, where, and (without cgroups) under which limits."""
        msg = {"path": script, "cores": list(cores), "cpu": lim.cpu_s}
        if not self.iso.memory_cgroup:
            msg["as"] = lim.memory_mb * 2**20
        if self.iso.seccomp is not None and self.iso.sandboxed:
            msg["seccomp"] = self.iso.seccomp.hex()
        with contextlib.suppress(BrokenPipeError):
            os.write(sb.ctl, json.dumps(msg).encode() + b"\n")  # far below a pipe's buffer
        os.close(sb.ctl)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            with contextlib.suppress(Exception):
                await t
        while self._ready:
            sb = self._ready.popleft()
            await self._retire(sb)
            self.boxes.remove_soon(sb.box)

    @staticmethod
    async def _retire(sb: WarmSandbox) -> None:
        """Stop an unused zygote: it reads EOF on its control pipe and exits (killed if it does not)."""
        if sb.ctl >= 0:
            with contextlib.suppress(OSError):
                os.close(sb.ctl)
        try:
            await asyncio.wait_for(sb.proc.wait(), 5.0)
        except Exception:
            with contextlib.suppress(ProcessLookupError):
                sb.proc.kill()
