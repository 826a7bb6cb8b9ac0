"""Warm start for /run_code in Python: sandboxes started ahead of time, waiting for their code.

Starting an interpreter (with its site-packages) is most of the cost of a trivial action. So a
few sandboxes are kept ready: each is built exactly like a cold one (same namespaces, uid,
rlimits, private work dir) and runs a tiny zygote that has finished starting Python and blocks on
a control pipe (its fd number is the zygote's argument). A request writes its files into that sandbox's work dir, sends the granted cores
and the script's name, and the zygote pins itself to those cores and runs the script as
`__main__` (tracebacks as `python script.py` would print them). The process then exits and the
sandbox is torn down as usual; a new one is started in the background. Requests with their own
memory limit, and bash, take the cold path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from libra.runtime.sandbox.sandbox import ExecResult, Isolation, Limits, spawn, supervise
from libra.runtime.sandbox.workspace import UidPool, Workspaces

ZYGOTE = r"""
import os, sys, json
def _libra_zygote():
    with os.fdopen(int(sys.argv[1]), "rb") as ctl:
        line = ctl.readline()
    if not line:
        os._exit(0)
    msg = json.loads(line)
    if msg.get("cores"):
        os.sched_setaffinity(0, msg["cores"])
    path = os.path.abspath(msg["path"])
    sys.argv = [msg["path"]]
    sys.path[0] = os.path.dirname(path)
    import types
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    status = 0
    try:
        exec(code, main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        import traceback
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
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
    uid: int
    workdir: Path
    ctl: int  # write end of the control pipe


class WarmPool:
    def __init__(self, iso: Isolation, ws: Workspaces, uids: UidPool, python: str, lim: Limits, size: int):
        self.iso, self.ws, self.uids, self.python, self.lim, self.size = iso, ws, uids, python, lim, size
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
            uid = self.uids.acquire()
            if uid is None:
                return
            workdir = self.ws.create(uid)
            r, w = os.pipe()
            try:
                proc = await spawn(
                    self.iso, [self.python, "-c", ZYGOTE, str(r)], workdir, uid, (), self.lim, pass_fds=(r,)
                )
            finally:
                os.close(r)
            if isinstance(proc, ExecResult):
                os.close(w)
                self._discard(uid, workdir)
                return
            self._ready.append(WarmSandbox(proc, uid, workdir, w))
        finally:
            self._starting -= 1

    def take(self) -> WarmSandbox | None:
        """A ready sandbox (its zygote may still be finishing its start-up), or None."""
        while self._ready:
            sb = self._ready.popleft()
            if sb.proc.returncode is None:
                return sb  # refilled when it is done, so start-up does not compete with its run
            os.close(sb.ctl)
            self._discard(sb.uid, sb.workdir)
        self.refill()
        return None

    async def run(self, sb: WarmSandbox, files: dict[PurePosixPath, bytes], script: str, cores, timeout_s: float,
                  stdin: bytes, fetch: list[str], fetch_max: int) -> tuple[ExecResult, dict[str, str]]:  # fmt: skip
        t0 = time.monotonic()
        try:
            try:
                self.ws.write(sb.workdir, files, sb.uid)
            except BaseException:  # the request's files do not fit: the zygote never runs it
                await self._retire(sb)
                raise
            msg = json.dumps({"path": script, "cores": list(cores)}).encode() + b"\n"
            with contextlib.suppress(BrokenPipeError):
                os.write(sb.ctl, msg)
            os.close(sb.ctl)
            lim = Limits(timeout_s, self.lim.memory_mb, self.lim.cpu_s, self.lim.nproc, self.lim.fsize_mb,
                         self.lim.nofile, self.lim.output_bytes)  # fmt: skip
            res = await supervise(self.iso, sb.proc, sb.uid, lim, stdin, t0)
            return res, self.ws.fetch(sb.workdir, fetch, fetch_max)
        finally:
            self._discard(sb.uid, sb.workdir)
            self.refill()

    def _discard(self, uid: int, workdir: Path) -> None:
        self.ws.remove(workdir)
        self.uids.release(uid)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            with contextlib.suppress(Exception):
                await t
        while self._ready:
            sb = self._ready.popleft()
            await self._retire(sb)
            self._discard(sb.uid, sb.workdir)

    @staticmethod
    async def _retire(sb: WarmSandbox) -> None:
        """Stop an unused zygote: it reads EOF on its control pipe and exits (killed if it does not)."""
        os.close(sb.ctl)
        try:
            await asyncio.wait_for(sb.proc.wait(), 5.0)
        except Exception:
            with contextlib.suppress(ProcessLookupError):
                sb.proc.kill()
