"""Where a sandbox's files live, and how the service writes and reads them safely.

Each sandbox (a session, a one-shot /run_code, a warm one) owns one directory on the host, a
size-limited tmpfs where the host allows (`disk_mb`, mounted in the service's private mount
namespace, see mounts.py), so everything a sandbox can write is bounded in total, not per file:

    <root>/<uid>/w        -> /workspace    (the working directory)
    <root>/<uid>/t        -> /tmp
    <root>/<uid>/a/<top>  -> /<top>        (absolute paths a request names, SandboxFusion-style:
                                            `/mnt/data/x` lives in a/mnt/data/x, bound at /mnt)

Request names map onto those areas (`locate`): relative names are in /workspace; absolute ones in
/workspace, /tmp, or a top-level directory the sandbox does not already mount (so never /usr,
/etc, /proc, /dev ... and never the service's own interpreter): nothing maps outside the sandbox.

The service writes `files` in and reads `fetch_files` out as root, in a worker thread (never on
the event loop), one path component at a time relative to an open directory, refusing symbolic
links, and opening only regular files, non-blocking: a program could have left `out.txt` as a
link to /etc/shadow, a FIFO (opening it would block until a writer came), a socket or a device.
Each of those is an error for that request that names the file.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from libra.core.errors import ConfigError
from libra.runtime.regular_file import read_upto
from libra.runtime.sandbox import mounts

WORKSPACE, TMP = "/workspace", "/tmp"
NAME_MAX = 255  # bytes in one path component (Linux)
NAME_TOTAL_MAX = 1024  # bytes in a whole name; the storage's own path comes on top
# Top-level directories a sandbox always mounts: an absolute path under one is not the sandbox's.
SYSTEM_TOPS = frozenset({"usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev",
                         "sys", "run", "boot"})  # fmt: skip
NAME_RULE = (
    "a path inside the sandbox: relative (to /workspace), or absolute under /workspace, /tmp or a "
    "top-level directory the sandbox does not mount (not /usr, /etc, /proc, /dev, /sys ...); no '.', "
    f"'..' or empty parts, no NUL, each part at most {NAME_MAX} bytes and the whole at most {NAME_TOTAL_MAX}"
)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request's name lives: an area (its mount point in the sandbox) and a path in it."""

    area: str  # /workspace, /tmp, or /<top>
    rel: PurePosixPath
    name: str  # as the request gave it: the key in `files` of the response


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def locate(name: str, field: str, reserved: frozenset[str] = frozenset()) -> Target:
    """Map a request's file name onto a sandbox area (NAME_RULE); `reserved` are the top-level
    directories the sandbox mounts besides the system ones (its interpreter's, `ro_binds`)."""
    absolute = name.startswith("/")
    parts = name[1:].split("/") if absolute else name.split("/")
    if (
        "\0" in name
        or _nbytes(name) > NAME_TOTAL_MAX
        or any(p in ("", ".", "..") or _nbytes(p) > NAME_MAX for p in parts)
        or (absolute and len(parts) < 2)
    ):
        raise ConfigError(field, name[:200], NAME_RULE)
    if not absolute:
        return Target(WORKSPACE, PurePosixPath(*parts), name)
    top = parts[0]
    if top in SYSTEM_TOPS or top in reserved:
        raise ConfigError(field, name[:200], NAME_RULE)
    return Target(f"/{top}", PurePosixPath(*parts[1:]), name)


def decode_files(
    files: dict[str, str | None], reserved: frozenset[str], field: str = "files"
) -> dict[Target, bytes]:
    """Base64-decode a request's files; `None` content is skipped, as SandboxFusion does."""
    out = {}
    for name, data in files.items():
        target = locate(name, f"{field}.{name[:200]}", reserved)
        if data is None:
            continue
        try:
            out[target] = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{field}.{name[:200]}", data[:40], "base64-encoded content") from None
    check_no_clash(out, field)
    return out


def check_no_clash(files: dict[Target, bytes], field: str = "files") -> None:
    """No name may be both a file and a directory of another file (`a` and `a/b`)."""
    dirs = {(t.area, d) for t in files for d in t.rel.parents}
    for t in files:
        if (t.area, t.rel) in dirs:
            raise ConfigError(
                f"{field}.{t.name[:200]}",
                t.name[:200],
                "a file name that is not also another file's directory",
            )


def require_relative(targets, field: str) -> None:
    """Without a sandbox there is nothing to map an absolute path into: only relative names work."""
    for t in targets:
        if t.name.startswith("/"):
            raise ConfigError(field, t.name[:200], "relative names (absolute paths need the sandbox)")


def areas_of(targets) -> set[str]:
    """The absolute areas (other than /workspace and /tmp) some of `targets` live in."""
    return {t.area for t in targets if t.area not in (WORKSPACE, TMP)}


@dataclass(slots=True)
class Storage:
    """One sandbox's directory on the host."""

    root: Path
    uid: int
    overlays: dict[str, Path] = field(default_factory=dict)  # sandbox path -> its view of a shared cache

    def host_dir(self, area: str) -> Path:
        if area == WORKSPACE:
            return self.root / "w"
        if area == TMP:
            return self.root / "t"
        return self.root / "a" / area.lstrip("/")

    def areas(self) -> list[str]:
        """Every area that exists, /workspace and /tmp first: what a sandbox binds."""
        extra = (
            sorted(f"/{p.name}" for p in (self.root / "a").iterdir()) if (self.root / "a").is_dir() else []
        )
        return [WORKSPACE, TMP, *extra]


class FetchBudget(Protocol):
    """What a response has left for fetched files (`budget.ResponseBudget`)."""

    def file_room(self, name: str) -> int: ...

    def charge_file(self, name: str, size: int) -> None: ...

    def refusal(self, size: int) -> str: ...


class Storages:
    """Makes, fills, reads and removes sandboxes' storage. Every method does file I/O: the service
    calls them from worker threads."""

    def __init__(self, root: Path, disk_mb: int, tmpfs: bool, chown: bool):
        self.root, self.disk_mb, self.tmpfs, self.chown = root, disk_mb, tmpfs, chown
        if root.exists():  # an earlier owner of this uid range died: what it left is ours to remove
            for child in root.iterdir():
                self._remove_dir(child)
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o711)

    def create(self, uid: int, areas: set[str] = frozenset(), caches=()) -> Storage:
        """A sandbox's storage, with its areas and a private overlay of each shared cache
        (caches.py): the overlay's writes land in this storage, so they count in its bound."""
        d = self.root / str(uid)
        d.mkdir(mode=0o711)
        if self.tmpfs:
            try:
                # About one inode per 16 KiB, so a million empty files cannot exhaust kernel memory.
                mounts.mount_tmpfs(d, self.disk_mb * 2**20, max(1024, self.disk_mb * 64))
            except OSError:
                d.rmdir()
                raise
        st = Storage(d, uid)
        for area in (WORKSPACE, TMP, *sorted(areas)):
            self.make_area(st, area)
        for i, cache in enumerate(caches):
            st.overlays[cache.sandbox_path] = self._overlay(st, i, cache.lower)
        return st

    def _overlay(self, st: Storage, i: int, lower: Path) -> Path:
        upper, work, merged = st.root / f"o{i}" / "u", st.root / f"o{i}" / "w", st.root / f"c{i}"
        for path in (upper.parent, upper, work, merged):
            os.mkdir(path, 0o711)
        if self.chown:
            os.chown(upper, st.uid, st.uid)  # the merged view's root is upper's: the sandbox's own
        mounts.mount_overlay(lower, upper, work, merged)
        return merged

    def make_area(self, st: Storage, area: str) -> None:
        path = st.host_dir(area)
        if area not in (WORKSPACE, TMP):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.parent, 0o711)
        try:
            os.mkdir(path, 0o711)  # bwrap, which has dropped its capabilities, must traverse it
        except FileExistsError:
            return
        if self.chown:
            os.chown(path, st.uid, st.uid)

    def remove(self, st: Storage) -> None:
        self._remove_dir(st.root)

    def _remove_dir(self, d: Path) -> None:
        with contextlib.suppress(OSError):
            mounts.unmount(d)  # a tmpfs goes at once, whatever is in it
        shutil.rmtree(d, ignore_errors=True)

    def cleanup(self) -> None:
        for child in list(self.root.iterdir()) if self.root.exists() else []:
            self._remove_dir(child)
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- files in ----------------------------------------------------------------------------

    def write(self, st: Storage, files: dict[Target, bytes], field: str = "files") -> None:
        """Write each file as the sandbox's uid. A name the storage cannot hold (a directory, a link,
        a FIFO or another non-regular file in the way, left by an earlier action; a full disk) is
        the request's error, naming the file."""
        for t in areas_of(files):
            self.make_area(st, t)
        for target, data in files.items():
            try:
                self._write_one(st, target, data)
            except OSError as e:
                raise ConfigError(f"{field}.{target.name[:200]}", target.name[:200], self._why(e)) from None

    def _why(self, e: OSError) -> str:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"files that fit the sandbox's disk ({self.disk_mb} MB in all)"
        if e.errno == errno.EFBIG:
            return "a file within the sandbox's file size limit"
        return f"a path the sandbox can hold as a regular file ({e.strerror})"

    def _write_one(self, st: Storage, t: Target, data: bytes) -> None:
        parent = self._open_dir(st, t, create=True)
        try:
            _must_be_regular_or_absent(parent, t.rel.name)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(t.rel.name, flags, 0o644, dir_fd=parent)
        finally:
            os.close(parent)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in between: refuse, write nothing
                raise OSError(errno.EINVAL, "not a regular file")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.chown:
                os.fchown(fd, st.uid, st.uid)
        finally:
            os.close(fd)

    def _open_dir(self, st: Storage, t: Target, create: bool) -> int:
        """An fd of the target's directory, walked from the area one component at a time with
        O_NOFOLLOW (created as the sandbox's uid when `create`)."""
        fd = os.open(st.host_dir(t.area), _O_DIR)
        try:
            for part in t.rel.parent.parts:
                try:
                    nxt = os.open(part, _O_DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if self.chown:
                        os.chown(part, st.uid, st.uid, dir_fd=fd, follow_symlinks=False)
                    nxt = os.open(part, _O_DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ENOTDIR, errno.ELOOP):
                        kind = _kind_at(fd, part)
                        raise OSError(e.errno, f"{part!r} on the way is {kind}, not a directory") from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ---- files out ---------------------------------------------------------------------------

    def fetch(
        self, st: Storage, targets: list[Target], max_bytes: int, budget: FetchBudget | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Base64 of each requested regular file, and why each other one was not read (missing, a
        link, a FIFO, a socket, a device, a directory, too large for one file or for what the
        response has left of its `budget`): never followed, never blocked on, never read past a cap."""
        out, skipped = {}, {}
        for t in targets:
            if t.name in out or t.name in skipped:
                continue  # named twice: returned once
            try:
                data = self._read_one(st, t, max_bytes, budget)
                if budget is not None:
                    budget.charge_file(t.name, len(data))
                out[t.name] = base64.b64encode(data).decode()
            except FileNotFoundError:
                skipped[t.name] = "missing"
            except OSError as e:
                skipped[t.name] = e.strerror or str(e)
        return out, skipped

    def _read_one(self, st: Storage, t: Target, max_bytes: int, budget: FetchBudget | None = None) -> bytes:  # fmt: skip
        if not st.host_dir(t.area).is_dir():
            raise FileNotFoundError(t.name)
        parent = self._open_dir(st, t, create=False)
        try:
            kind = _kind_at(parent, t.rel.name)
            if kind != "a regular file":
                raise OSError(errno.EINVAL, f"{kind}, not a regular file")
            fd = os.open(
                t.rel.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
            )
        finally:
            os.close(parent)
        try:
            size = os.fstat(fd).st_size
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if size > max_bytes:
                raise OSError(errno.EFBIG, f"{size} bytes, more than the {max_bytes} a fetched file may have")
            if budget is not None and size > budget.file_room(t.name):
                raise OSError(errno.EFBIG, budget.refusal(size))
            return read_upto(fd, size)  # never more than fstat said
        finally:
            os.close(fd)


def _kind_at(dir_fd: int, name: str) -> str:
    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _must_be_regular_or_absent(dir_fd: int, name: str) -> None:
    try:
        kind = _kind_at(dir_fd, name)
    except FileNotFoundError:
        return
    if kind != "a regular file":
        raise OSError(errno.EINVAL, f"it is {kind}, not a regular file")
