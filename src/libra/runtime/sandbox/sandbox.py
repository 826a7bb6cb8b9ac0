"""The sandbox executor: run one command under real Linux isolation, bounded in every dimension.

Each execution is a chain of small exec wrappers, so nothing runs Python code between fork and
exec in the service (which would be unsafe with threads):

    sh -c 'echo $$ > cgroup.procs'  join the sandbox's cgroup (resident memory, cpuset), where the
                                host has cgroups for the service (cgroups.py)
    taskset -c CORES            the cores the scheduler granted (per-action CPU affinity)
    bwrap ...                   new PID, network, IPC and UTS namespaces; a read-only view of the
                                system; the sandbox's own storage (storage.py) at /workspace, /tmp
                                and the absolute paths its requests named; without a cpuset, a
                                seccomp filter that refuses sched_setaffinity (seccomp.py)
    setpriv --reuid UID ...     drop to an unprivileged uid of the service's own range, no
                                capabilities, no_new_privs (root in the sandbox could read /etc/shadow)
    prlimit --cpu --nproc ...   rlimits on CPU time, processes, file size, open files, and the
                                address space where no memory cgroup bounds what is resident
    COMMAND

The process tree dies with its action: bwrap's init is PID 1 of the namespace and
--die-with-parent ties it to the outer process, so killing that one (on timeout) or the command
exiting (children left running) tears the whole namespace down. Killing what is left in the
sandbox's cgroup (or, without one, the processes of its uid, a uid this service alone owns)
follows every run as a second line of defence.

Without bwrap (or root) the service refuses to start unless told `--insecure-no-sandbox`; then
commands run with the same rlimits and affinity but no namespaces and as the service's user.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

from libra.runtime.sandbox.config import SandboxConfig
from libra.runtime.sandbox.storage import SYSTEM_TOPS, WORKSPACE

if TYPE_CHECKING:
    from libra.runtime.sandbox.boxes import Box
    from libra.runtime.sandbox.cgroups import CgroupTree

TRUNCATION_MARKER = "\n[... truncated {n} bytes of output ...]\n"
# Executables the wrapper chain needs on the host.
TOOLS = ("bwrap", "setpriv", "prlimit", "taskset")
# Where the sandbox finds programs: its python's directory comes first (sandbox_path()).
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
FALLBACK_ARENAS = 2  # glibc malloc arenas per process where memory is an address-space limit


class RunStatus(IntEnum):
    FINISHED = 0  # exited by itself (any return code)
    TIMEOUT = 1  # killed at the wall-clock limit
    ERROR = 2  # could not be run (the sandbox itself failed)


@dataclass(slots=True)
class ExecResult:
    status: RunStatus
    return_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    truncated: int = 0  # bytes of output dropped beyond the limit
    leftovers_killed: int = 0
    message: str = ""
    oom_killed: bool = False  # the kernel killed a process of it for memory (cgroup limit)
    death: str = ""  # how it ended, when not by exiting normally: the signal and the limit (`explain`)
    capped: int = 0  # characters of output cut so the response fits max_response_bytes (budget.py)


@dataclass(slots=True)
class Limits:
    """Per-execution limits; the service fills them from the request and its configuration."""

    timeout_s: float
    memory_mb: int
    cpu_s: int
    nproc: int
    fsize_mb: int
    nofile: int
    output_bytes: int
    reserves_mb: int = 0  # address space beyond memory_mb, where memory is an address-space rlimit


@dataclass(slots=True)
class Isolation:
    """What the host offers: bwrap isolation and its containment, or nothing (insecure mode).

    The bwrap arguments come in two halves around the sandbox's own binds: `head_args` (namespaces,
    the system) before them, `tail_args` (interpreter binds, /proc, /dev, environment) after, so a
    bind under /tmp (a CI checkout) still shows through the sandbox's own /tmp."""

    sandboxed: bool
    reason: str = ""
    head_args: list[str] = field(default_factory=list)
    tail_args: list[str] = field(default_factory=list)
    reserved_tops: frozenset[str] = frozenset()  # top-level dirs the sandbox mounts: not for requests
    cgroups: CgroupTree | None = None
    seccomp: bytes | None = None  # the affinity filter, when there is no cpuset
    tmpfs: bool = False  # storage is a size-limited tmpfs per sandbox
    notes: dict[str, str] = field(default_factory=dict)  # what each limit uses, for /health

    @property
    def memory_cgroup(self) -> bool:
        return self.cgroups is not None and self.cgroups.memory is not None

    @property
    def cpuset(self) -> bool:
        return self.cgroups is not None and self.cgroups.cpuset is not None


def host_problem() -> str | None:
    """Why this host cannot sandbox at all (a missing tool, not root), or None."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pkg = {
            "bwrap": "bubblewrap",
            "setpriv": "util-linux",
            "prlimit": "util-linux",
            "taskset": "util-linux",
        }
        need = sorted({pkg[m] for m in missing})
        return f"missing {', '.join(missing)} (install the Debian package(s) {', '.join(need)})"
    if os.geteuid() != 0:
        return "the sandbox runs actions under their own uids, which needs root"
    return None


def probe(cfg: SandboxConfig, uid: int) -> Isolation:
    """Check that bubblewrap isolation really works here, as `uid` (one the caller owns); say why
    when it does not."""
    if problem := host_problem():
        return Isolation(False, problem)
    head, tail, reserved = bwrap_args(cfg)
    iso = Isolation(True, head_args=head, tail_args=tail, reserved_tops=reserved)
    try:
        r = subprocess.run(
            ["bwrap", *head, *tail, "--", "setpriv", "--reuid", str(uid), "--regid",
             str(uid), "--clear-groups", "--", "/bin/true"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return Isolation(False, f"bwrap could not start a sandbox: {e}")
    if r.returncode != 0:
        return Isolation(False, f"bwrap could not start a sandbox: {r.stderr.strip()[:300]}")
    return iso


def contain(iso: Isolation, cfg: SandboxConfig, name: str, cores: list[int]) -> None:
    """Find what bounds a sandbox on this host, falling back limit by limit (cgroups.py):
    storage: a tmpfs per sandbox in the service's private mount namespace, else per file only;
    memory: a memory cgroup, else an address-space rlimit; cores: a cpuset, else the seccomp
    filter that refuses sched_setaffinity. Must run before the service starts any thread."""
    from libra.runtime.sandbox import cgroups, mounts, seccomp

    why_ns = mounts.enter_private_namespace()
    iso.tmpfs = why_ns is None
    if cfg.cgroups == "off":
        tree, why_cg = None, "sandbox.cgroups is off"
    else:
        tree, why_cg = cgroups.probe(name, cores)
    iso.cgroups = tree
    if not iso.memory_cgroup:
        # Under an address-space limit each thread's malloc arena (64 MB reserved) counts: 32 threads
        # could not start at 1 GB. Two arenas keep thread start-up within it (speed is all it costs).
        iso.tail_args += ["--setenv", "MALLOC_ARENA_MAX", str(FALLBACK_ARENAS)]
    if not iso.cpuset:
        iso.seccomp = seccomp.affinity_filter()
    described = tree.describe() if tree is not None else {}
    iso.notes = {
        "disk": f"tmpfs of {cfg.disk_mb} MB per sandbox" if iso.tmpfs else f"per file only ({why_ns})",
        "memory": f"resident, {described['memory']}"
        if iso.memory_cgroup
        else f"address space (RLIMIT_AS, MALLOC_ARENA_MAX={FALLBACK_ARENAS}): {why_cg or described.get('memory')}",
        "cores": f"cpuset, {described['cpuset']}"
        if iso.cpuset
        else ("affinity, widening refused by seccomp" if iso.seccomp else "affinity only (cooperative)"),
    }


def _mirror_root(args: list[str]) -> None:
    """/bin, /lib ... as the host has them: symlinks into /usr (merged /usr) or read-only binds."""
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        p = Path(top)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), top]
        elif p.is_dir():
            args += ["--ro-bind", top, top]


def _ro_bind_with_parents(args: list[str], path: str, made: set[str]) -> None:
    """Bind `path` read-only, first creating its parents world-traversable: bwrap would copy the
    host's modes (root's 0700 home would hide a pyenv interpreter from the sandbox uid)."""
    _parents_traversable(args, path, made)
    args += ["--ro-bind", path, path]


def _parents_traversable(args: list[str], path: str, made: set[str]) -> None:
    parts = Path(path).parts
    for i in range(2, len(parts)):
        parent = str(Path(*parts[:i]))
        if parent not in made and not parent.startswith("/usr"):
            args += ["--perms", "0755", "--dir", parent]
            made.add(parent)


def interpreter_paths() -> list[str]:
    """What the service's own Python needs to run inside the sandbox (venv and base install)."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    paths.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    return sorted(p for p in paths if not p.startswith("/usr") and Path(p).exists())


def bwrap_args(cfg: SandboxConfig) -> tuple[list[str], list[str], frozenset[str]]:
    """The fixed bwrap arguments before and after a sandbox's own binds, and the top-level
    directories they mount (a request's absolute path may not live under one)."""
    head = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
            "--ro-bind", "/usr", "/usr"]  # fmt: skip
    _mirror_root(head)
    head += ["--ro-bind", "/etc", "/etc"]
    for secret in ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-"):
        if Path(secret).exists():
            head += ["--ro-bind", "/dev/null", secret]
    tail: list[str] = []
    made: set[str] = set()
    extra = interpreter_paths() if cfg.python is None else []
    for p in [*extra, *cfg.ro_binds]:
        _ro_bind_with_parents(tail, p, made)
    for hidden in _service_paths():
        if any(hidden.startswith(p.rstrip("/") + "/") for p in [*extra, *cfg.ro_binds]):
            tail += ["--tmpfs", hidden]  # the service's own code is not the sandbox's business
    tail += ["--proc", "/proc", "--dev", "/dev"]
    tail += ["--clearenv", "--setenv", "PATH", sandbox_path(cfg), "--setenv", "HOME", WORKSPACE,
             "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1"]  # fmt: skip
    tops = {Path(p).parts[1] for p in [*extra, *cfg.ro_binds] if len(Path(p).parts) > 1}
    return head, tail, frozenset(tops - {"tmp", "workspace"}) | SYSTEM_TOPS


def sandbox_path(cfg: SandboxConfig) -> str:
    """PATH inside: the sandbox's python (and what its environment installed, e.g. pytest) first."""
    return f"{Path(python_executable(cfg)).parent}:{SYSTEM_PATH}"


def _service_paths() -> list[str]:
    import libra

    return [str(Path(libra.__file__).resolve().parent)]


def python_executable(cfg: SandboxConfig) -> str:
    return cfg.python or sys.executable


def build_command(iso: Isolation, argv: Sequence[str], box: Box, cores: Sequence[int], lim: Limits,
                  env: dict[str, str] | None = None, seccomp_fd: int | None = None) -> list[str]:  # fmt: skip
    memory = [] if iso.memory_cgroup else [f"--as={(lim.memory_mb + lim.reserves_mb) * 2**20}"]
    rl = ["prlimit", *memory, f"--cpu={lim.cpu_s}", f"--nproc={lim.nproc}", f"--fsize={lim.fsize_mb * 2**20}",
          f"--nofile={lim.nofile}", "--core=0", "--"]  # fmt: skip
    aff = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
    if not iso.sandboxed:
        return [*aff, *rl, *argv]
    uid = str(box.uid)
    drop = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]  # fmt: skip
    binds = []
    for area in box.storage.areas():
        binds += ["--bind", str(box.storage.host_dir(area)), area]
    made: set[str] = set()
    for path, host in box.storage.overlays.items():
        _parents_traversable(binds, path, made)  # bwrap would make them 0700: root's, unreadable
        binds += ["--bind", str(host), path]
    extra = [a for k, v in (env or {}).items() for a in ("--setenv", k, v)]
    if seccomp_fd is not None:
        extra += ["--seccomp", str(seccomp_fd)]
    join = box.cgroup.join_argv() if box.cgroup is not None else []
    return [*join, *aff, "bwrap", *iso.head_args, *binds, *iso.tail_args, *extra, "--chdir", WORKSPACE,
            "--", *drop, *rl, *argv]  # fmt: skip


async def spawn(iso: Isolation, argv: Sequence[str], box: Box, cores: Sequence[int], lim: Limits,
                env: dict[str, str] | None = None, pass_fds: Sequence[int] = (),
                seccomp: bool = True) -> asyncio.subprocess.Process | ExecResult:  # fmt: skip
    """Start the wrapped command; an ExecResult (ERROR) when it cannot even start. `seccomp=False`
    only for the warm zygote, which pins itself and then installs the same filter."""
    filt = _filter_fd(iso.seccomp) if seccomp and iso.sandboxed and iso.seccomp is not None else None
    cmd = build_command(iso, argv, box, cores, lim, env, filt)
    fds = (*pass_fds, filt) if filt is not None else tuple(pass_fds)
    try:
        return await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, cwd=None if iso.sandboxed else str(box.storage.host_dir(WORKSPACE)),
            pass_fds=fds,
        )  # fmt: skip
    except OSError as e:
        return ExecResult(RunStatus.ERROR, None, "", "", 0.0, message=f"could not start: {e}")
    finally:
        if filt is not None:
            os.close(filt)


def _filter_fd(prog: bytes) -> int:
    """A pipe's read end holding the BPF program, for `bwrap --seccomp FD` (which reads it all)."""
    r, w = os.pipe()
    try:
        os.write(w, prog)  # a few hundred bytes: far below a pipe's buffer, never blocks
    finally:
        os.close(w)
    return r


async def execute(iso: Isolation, argv: Sequence[str], box: Box, cores: Sequence[int], lim: Limits,
                  stdin: bytes = b"", env: dict[str, str] | None = None) -> ExecResult:  # fmt: skip
    """Run one command to completion or its time limit; never raises for what the command does."""
    try:
        await asyncio.to_thread(box.limit, lim.memory_mb, cores)
    except OSError as e:
        return ExecResult(
            RunStatus.ERROR, None, "", "", 0.0, message=f"could not set the sandbox's limits: {e}"
        )
    t0 = time.monotonic()
    proc = await spawn(iso, argv, box, cores, lim, env)
    if isinstance(proc, ExecResult):
        return proc
    return await supervise(iso, proc, box, lim, stdin, t0)


async def supervise(iso: Isolation, proc: asyncio.subprocess.Process, box: Box, lim: Limits, stdin: bytes,
                    t0: float) -> ExecResult:  # fmt: skip
    """Feed stdin, capture bounded output, enforce the wall-clock limit, then make sure nothing
    of the action is left running."""
    out, err = _Capture(lim.output_bytes), _Capture(lim.output_bytes)
    io = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr), _feed(proc, stdin))
    status = RunStatus.FINISHED
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=lim.timeout_s)
    except TimeoutError:
        status = RunStatus.TIMEOUT
        _kill(proc)
        await proc.wait()
    finally:
        if proc.returncode is None:  # cancelled: never leave a sandbox behind
            _kill(proc)
            await proc.wait()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(io, timeout=5.0)  # the pipes close when the namespace is gone
    wall = time.monotonic() - t0
    leftovers, oom = await asyncio.to_thread(box.settle, iso.sandboxed)
    code = proc.returncode if status == RunStatus.FINISHED else None
    res = ExecResult(status, code, out.text(), err.text(), wall, out.dropped + err.dropped, leftovers,
                     oom_killed=oom)  # fmt: skip
    res.death = explain(res, lim, address_space=not iso.memory_cgroup)
    return res


# Signals that end a process: the name of the limit that sends each, where one does.
_LIMIT_SIGNALS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "fsize"}
# What a program prints when a limit made a call fail rather than killed it (Python ignores
# SIGXFSZ, a failed fork is an error): the last few KB of its stderr are searched for these.
_FAILED_CALLS = (
    ("nproc", ("Resource temporarily unavailable", "can't start new thread", "failed to create new OS thread",
               "fork: retry", "pthread_create failed", "unable to create native thread")),
    ("fsize", ("File too large", "File size limit exceeded")),
    ("memory", ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory", "OutOfMemoryError",
                "JavaScript heap out of memory")),
)  # fmt: skip


def signal_of(code: int | None) -> int | None:
    """The signal that ended a process, from its return code: -N (a direct child) or 128+N (how
    the sandbox's init, like a shell, reports a child killed by N). A program that exits with
    128+N itself reads the same: there is no telling them apart from outside."""
    if code is None or code == 0:
        return None
    n = -code if code < 0 else code - 128
    return n if n in {s.value for s in signal.Signals} else None


def explain(res: ExecResult, lim: Limits, address_space: bool) -> str:
    """How an execution ended, when not by exiting on its own: the signal's name and which limit
    killed it (time, memory, file size, processes), or the limit a failed call points to."""
    if res.status == RunStatus.TIMEOUT:
        return f"killed at the time limit ({lim.timeout_s:g} s of wall-clock time); the whole process tree was killed"  # fmt: skip
    limits = {
        "cpu": f"over its CPU time limit ({lim.cpu_s} s of CPU)",
        "fsize": f"over the file size limit ({lim.fsize_mb} MB per file, sandbox.fsize_mb)",
        "memory": f"over its memory limit ({lim.memory_mb} MB)",
        "nproc": f"at the process limit ({lim.nproc} processes and threads, sandbox.nproc)",
    }
    sig = signal_of(res.return_code)
    if res.oom_killed:
        return f"killed by the kernel ({_name(sig or signal.SIGKILL)}): {limits['memory']}"
    tail = res.stderr[-4096:] + res.stdout[-1024:] if res.return_code else ""
    hint = next((k for k, marks in _FAILED_CALLS if any(m in tail for m in marks)), None)
    if sig is None:
        return f"it exited with code {res.return_code}, likely {limits[hint]}" if hint else ""
    why = _LIMIT_SIGNALS.get(signal.Signals(sig))
    text = f"killed by signal {_name(sig)}"
    if why is not None:
        return f"{text}: {limits[why]}"
    if hint is not None:
        return f"{text}, likely {limits[hint]}"
    if address_space and sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT):
        return f"{text} (memory is an address-space limit of {lim.memory_mb} MB here: a failed allocation can end this way)"  # fmt: skip
    return text


def _name(sig: int) -> str:
    return f"{signal.Signals(sig).name} ({signal.strsignal(sig)})"


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest, reading to the end so the
    writer never blocks on a full pipe."""

    def __init__(self, limit: int):
        self.limit, self.buf, self.dropped = limit, bytearray(), 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        s = self.buf.decode("utf-8", errors="replace")
        return s + TRUNCATION_MARKER.format(n=self.dropped) if self.dropped else s


def processes_of(uids: range) -> list[int]:
    """PIDs running under any of `uids` (tests use it to check nothing outlives its action)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_uid in uids:
                    out.append(int(entry.name))
    return out
