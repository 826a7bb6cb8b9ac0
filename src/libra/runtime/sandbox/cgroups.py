"""Kernel-enforced limits per sandbox: resident memory and the cores an action may run on.

An rlimit on address space is not a memory limit (at 1 GB, `ThreadPoolExecutor(32)` could not
start its threads: each reserves a 64 MB malloc arena), and CPU affinity alone is advice (a
program can widen its own mask). A cgroup per sandbox fixes both: `memory.max` bounds what it
holds resident (its files in the RAM-backed workspace included) and `cpuset.cpus` bounds where it
runs, whatever it asks for.

Where the host allows it, the service makes one directory `libra-actions-<first uid>` (its uid
range is exclusive, so the name is too) and one child per sandbox, named by its uid:

- cgroup v2, with the memory and cpuset controllers available at the root of the hierarchy
  (a root service on a VM, or a container given a delegated subtree);
- cgroup v1, with writable `memory` and `cpuset` hierarchies (what this project's machines offer).

Each controller is optional: what is not available falls back (`Containment` in sandbox.py), and
`/health` says what each limit uses. A process joins its cgroup before the sandbox starts, by a
one-line shell wrapper in the exec chain (no Python runs between fork and exec), so nothing of an
action ever runs outside it.

These are small writes to cgroupfs; the service runs them from its worker threads with the rest
of a sandbox's set-up.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path

MEMORY, CPUSET = "memory", "cpuset"


@dataclass(slots=True)
class Hierarchy:
    """One controller's parent directory for this service, and its file names there."""

    parent: Path
    version: int

    def child(self, name: str) -> Path:
        return self.parent / name


@dataclass(slots=True)
class Cgroup:
    """One sandbox's cgroup: a directory per hierarchy (v2: one directory for both)."""

    memory: Path | None
    cpuset: Path | None
    version: int

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys(d for d in (self.memory, self.cpuset) if d is not None))

    def join_argv(self) -> list[str]:
        """A wrapper that moves itself into this cgroup, then execs the rest of the chain."""
        moves = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)
        return ["/bin/sh", "-c", f'{moves} && exec "$@"', "libra-join"]

    def set_memory(self, limit_bytes: int) -> None:
        if self.memory is None:
            return
        if self.version == 2:
            _write(self.memory / "memory.max", str(limit_bytes))
            with contextlib.suppress(OSError):
                _write(self.memory / "memory.swap.max", "0")
        else:
            # v1 refuses a memory limit above memsw's; lower memsw first when it shrinks.
            memsw = self.memory / "memory.memsw.limit_in_bytes"
            with contextlib.suppress(OSError):
                _write(memsw, str(limit_bytes))
            _write(self.memory / "memory.limit_in_bytes", str(limit_bytes))
            with contextlib.suppress(OSError):
                _write(memsw, str(limit_bytes))

    def set_cores(self, cores: list[int] | tuple[int, ...]) -> None:
        if self.cpuset is not None and cores:
            _write(self.cpuset / "cpuset.cpus", ",".join(map(str, cores)))

    def oom_kills(self) -> int:
        """How many times the kernel killed a process here for memory (cumulative)."""
        if self.memory is None:
            return 0
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.memory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def kill(self, uid: int) -> int:
        """SIGKILL every process in this cgroup (all of them this service's own) and count those of
        the program (`uid`), not the sandbox's own helpers still exiting after it."""
        pids: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        counted = 0
        for pid in pids:
            with contextlib.suppress(OSError):
                counted += os.stat(f"/proc/{pid}").st_uid == uid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return counted

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


@dataclass(slots=True)
class CgroupTree:
    """This service's cgroup directories, one per controller it could use."""

    memory: Hierarchy | None
    cpuset: Hierarchy | None
    mems: str  # cpuset.mems a v1 child must be given before a process may join it

    def describe(self) -> dict[str, str]:
        out = {}
        for name, h in ((MEMORY, self.memory), (CPUSET, self.cpuset)):
            out[name] = f"cgroup v{h.version} ({h.parent})" if h is not None else "unavailable"
        return out

    def make(self, name: str, cores: list[int]) -> Cgroup:
        mem = self.memory.child(name) if self.memory is not None else None
        cpu = self.cpuset.child(name) if self.cpuset is not None else None
        version = (self.memory or self.cpuset).version
        for d in dict.fromkeys(x for x in (mem, cpu) if x is not None):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
        cg = Cgroup(mem, cpu, version)
        if cpu is not None:
            if version == 1:
                _write(cpu / "cpuset.mems", self.mems)
            cg.set_cores(cores)
        return cg

    def stale(self) -> list[Cgroup]:
        """Children left by an earlier owner of this uid range that was killed."""
        names: set[str] = set()
        for h in (self.memory, self.cpuset):
            if h is not None:
                with contextlib.suppress(OSError):
                    names.update(p.name for p in h.parent.iterdir() if p.is_dir())
        version = (self.memory or self.cpuset).version
        return [
            Cgroup(
                self.memory.child(n) if self.memory is not None else None,
                self.cpuset.child(n) if self.cpuset is not None else None,
                version,
            )
            for n in sorted(names)
        ]

    def close(self) -> None:
        for cg in self.stale():
            cg.kill(-1)
            cg.remove()
        for h in (self.memory, self.cpuset):
            if h is not None:
                with contextlib.suppress(OSError):
                    h.parent.rmdir()


def probe(name: str, cores: list[int]) -> tuple[CgroupTree | None, str]:
    """The service's cgroup tree, or None and why not. Tries v2, then v1."""
    mounts = _cgroup_mounts()
    tree, why2 = _probe_v2(mounts, name, cores)
    if tree is not None:
        return tree, ""
    tree, why1 = _probe_v1(mounts, name, cores)
    if tree is not None:
        return tree, ""
    return None, f"cgroup v2: {why2}; cgroup v1: {why1}"


def _cgroup_mounts() -> list[tuple[str, Path, set[str]]]:
    """(fstype, mount point, super options) of every cgroup mount, from /proc/self/mountinfo."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                out.append((rest[0], Path(fields[4]), set(rest[2].split(","))))
    return out


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` (None: the v2 hierarchy)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if (controller is None and ctrls == "") or (
                controller is not None and controller in ctrls.split(",")
            ):
                return path
    return None


def _probe_v2(mounts, name: str, cores: list[int]) -> tuple[CgroupTree | None, str]:
    root = next((p for fs, p, _ in mounts if fs == "cgroup2"), None)
    if root is None:
        return None, "no cgroup2 mount"
    try:
        available = set((root / "cgroup.controllers").read_text().split())
    except OSError as e:
        return None, f"cannot read {root}/cgroup.controllers ({e.strerror})"
    want = [c for c in (MEMORY, CPUSET) if c in available]
    if not want:
        return (
            None,
            f"neither memory nor cpuset is available at {root} (controllers: {sorted(available) or 'none'})",
        )
    parent = root / name
    try:
        _write(root / "cgroup.subtree_control", " ".join(f"+{c}" for c in want))
        with contextlib.suppress(FileExistsError):
            parent.mkdir()
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in want))
    except OSError as e:
        with contextlib.suppress(OSError):
            parent.rmdir()
        return None, f"cannot delegate {'+'.join(want)} under {root} ({e.strerror})"
    h = Hierarchy(parent, 2)
    tree = CgroupTree(h if MEMORY in want else None, h if CPUSET in want else None, "")
    return _checked(tree, cores)


def _probe_v1(mounts, name: str, cores: list[int]) -> tuple[CgroupTree | None, str]:
    hier: dict[str, Hierarchy] = {}
    why = []
    mems = ""
    for ctrl in (MEMORY, CPUSET):
        mount = next((p for fs, p, opts in mounts if fs == "cgroup" and ctrl in opts), None)
        own = _own_path(ctrl)
        if mount is None or own is None:
            why.append(f"no {ctrl} hierarchy")
            continue
        base = mount / own.lstrip("/")
        parent = base / name
        try:
            with contextlib.suppress(FileExistsError):
                parent.mkdir()
            if ctrl == CPUSET:
                mems = (base / "cpuset.mems").read_text().strip()
                _write(parent / "cpuset.mems", mems)
                _write(parent / "cpuset.cpus", (base / "cpuset.cpus").read_text().strip())
        except OSError as e:
            with contextlib.suppress(OSError):
                parent.rmdir()
            why.append(f"{ctrl} at {base} is not writable ({e.strerror})")
            continue
        hier[ctrl] = Hierarchy(parent, 1)
    if not hier:
        return None, "; ".join(why)
    return _checked(CgroupTree(hier.get(MEMORY), hier.get(CPUSET), mems), cores)


def _checked(tree: CgroupTree, cores: list[int]) -> tuple[CgroupTree | None, str]:
    """Make and remove one child with a limit, so a tree that cannot do its job is not used."""
    try:
        cg = tree.make("probe", cores)
        cg.set_memory(64 * 2**20)
        cg.remove()
    except OSError as e:
        tree.close()
        return None, f"a child cgroup could not be set up ({e.strerror})"
    for cg in tree.stale():  # left by an earlier owner of this uid range that was killed
        cg.kill(-1)
        cg.remove()
    return tree, ""


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
