"""Work directories and sandbox uids: where an action's files live and whom it runs as.

Each session (and each one-shot /run_code) gets a private directory owned by its own uid from a
reserved range, mode 0700 under a 0711 root, so sandboxes cannot see each other's files. The
service writes request files in and reads `fetch_files` out as root, so both refuse to follow
symbolic links or leave the directory: a sandbox could have left `out.txt -> /etc/shadow` behind.
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath

from libra.core.errors import ConfigError


class UidPool:
    """A range of uids handed out one per sandbox owner and returned when it is gone."""

    def __init__(self, base: int, count: int):
        self._free = list(range(base + count - 1, base - 1, -1))
        self.range = range(base, base + count)

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, uid: int) -> None:
        self._free.append(uid)

    @property
    def available(self) -> int:
        return len(self._free)


NAME_MAX = 255  # bytes in one path component (Linux)
NAME_TOTAL_MAX = 1024  # bytes in a whole relative name; the work dir's own path comes on top
NAME_RULE = (
    f"a relative path inside the work dir: no leading '/', no '.', '..' or empty parts, no NUL,"
    f" each part at most {NAME_MAX} bytes and the whole at most {NAME_TOTAL_MAX}"
)


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def check_name(name: str, field: str) -> PurePosixPath:
    """A relative path inside the work dir that the file system can hold (NAME_RULE)."""
    parts = name.split("/")
    if (
        "\0" in name
        or _nbytes(name) > NAME_TOTAL_MAX
        or any(part in ("", ".", "..") or _nbytes(part) > NAME_MAX for part in parts)
    ):
        raise ConfigError(field, name[:200], NAME_RULE)
    return PurePosixPath(name)


def decode_files(files: dict[str, str | None], field: str = "files") -> dict[PurePosixPath, bytes]:
    out = {}
    for name, data in files.items():
        path = check_name(name, f"{field}.{name}")
        try:
            out[path] = base64.b64decode(data or "", validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{field}.{name}", (data or "")[:40], "base64-encoded content") from None
    check_no_clash(out, field)
    return out


def check_no_clash(files: dict[PurePosixPath, bytes], field: str = "files") -> None:
    """No name may be both a file and a directory of another file (`a` and `a/b`)."""
    dirs = {d for p in files for d in p.parents}
    for p in files:
        if p in dirs:
            raise ConfigError(f"{field}.{p}", str(p), "a file name that is not also another file's directory")


class Workspaces:
    def __init__(self, root: str | None, chown: bool):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="libra-actions-"))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self.chown = chown

    def create(self, uid: int) -> Path:
        d = Path(tempfile.mkdtemp(dir=self.root))
        if self.chown:
            os.chown(d, uid, uid)
        os.chmod(d, 0o711)  # bwrap (root, no capabilities) must be able to chdir into it
        return d

    def write(self, workdir: Path, files: dict[PurePosixPath, bytes], uid: int) -> None:
        """Write each file as `uid`. A name the directory cannot hold (a directory, a link or a file
        already in the way, left there by an earlier action) is the request's error, not ours."""
        for rel, data in files.items():
            try:
                self._write_one(workdir, rel, data, uid)
            except OSError as e:
                raise ConfigError(
                    f"files.{rel}", str(rel), f"a path the work dir can hold ({e.strerror})"
                ) from None

    def _write_one(self, workdir: Path, rel: PurePosixPath, data: bytes, uid: int) -> None:
        parent = self._dir_inside(workdir, rel.parent, uid)
        fd = os.open(parent / rel.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, data) if data else None
            if self.chown:
                os.fchown(fd, uid, uid)
        finally:
            os.close(fd)

    def _dir_inside(self, workdir: Path, rel: PurePosixPath, uid: int) -> Path:
        """Create (as the owner) and return a directory under `workdir`, refusing symlinks."""
        d = workdir
        for part in rel.parts:
            d = d / part
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                os.mkdir(d, 0o755)
                if self.chown:
                    os.chown(d, uid, uid)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError("files", str(rel), "a path whose directories are not links or files")
        return d

    def fetch(self, workdir: Path, names: list[str], max_bytes: int) -> dict[str, str]:
        """Base64 of each requested regular file; a missing, linked or oversized one is skipped
        (and reported by the caller), never followed."""
        out = {}
        base = os.path.realpath(workdir)
        for name in names:
            rel = check_name(name, f"fetch_files.{name}")
            path = os.path.join(base, *rel.parts)
            if os.path.realpath(os.path.dirname(path)) != os.path.dirname(path):
                continue  # a directory on the way is a link
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size <= max_bytes:
                    out[name] = base64.b64encode(os.read(fd, st.st_size)).decode()
            finally:
                os.close(fd)
        return out

    def remove(self, workdir: Path) -> None:
        shutil.rmtree(workdir, ignore_errors=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
