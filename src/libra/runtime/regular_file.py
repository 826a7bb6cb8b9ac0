"""Read weights and checkpoints only from regular files, never blocking, never outside their folder.

`torch.load` on a named pipe blocks its thread until a writer comes; an engine given a FIFO as
`model_path` lost one thread per call until updates went unanswered, and `--resume` with a FIFO
`model.pt` hung. A device (`/dev/zero`) reads forever. So a file is looked at before it is opened
(`stat`: a FIFO, a socket, a device or a directory is refused by name, unopened), opened with
`O_NONBLOCK` (opening a FIFO then returns at once instead of waiting for a writer), checked again
on the open descriptor (the same inode, still a regular file), and read to the size it had.

Inside a run folder (`within`), the final name must not be a symlink and the resolved path must
stay under the folder: a checkpoint that points elsewhere is refused, not followed. Callers that
wait on the read (the engine) also bound it with a timeout: a regular file on a hung network mount
blocks too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


class FileRefused(ValueError):
    """A path that is not a readable regular file (or leaves its folder); the message says what it is."""


def kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, within: Path | None = None) -> os.stat_result:
    """The file's stat if it is a regular file (under `within`, not a symlink and not leaving it);
    FileRefused naming what it is otherwise. Opens nothing."""
    try:
        st = os.lstat(path) if within is not None else os.stat(path)
    except FileNotFoundError:
        raise FileRefused(f"{path}: does not exist") from None
    except OSError as e:
        raise FileRefused(f"{path}: cannot be read ({e.strerror})") from None
    if within is not None:
        if stat.S_ISLNK(st.st_mode):
            raise FileRefused(f"{path}: is a symbolic link (to {os.readlink(path)!r}); checkpoint files are read only as regular files")  # fmt: skip
        real, root = Path(os.path.realpath(path)), Path(os.path.realpath(within))
        if real != root and root not in real.parents:
            raise FileRefused(f"{path}: resolves to {real}, outside the run folder {root}")
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{path}: is {kind(st.st_mode)}, not a regular file")
    return st


def read_regular(path: str | Path, within: Path | None = None, max_bytes: int | None = None) -> bytes:
    """The whole file, if it is a regular file (`check_regular`) of at most `max_bytes`."""
    path = Path(path)
    before = check_regular(path, within)
    if max_bytes is not None and before.st_size > max_bytes:
        raise FileRefused(f"{path}: {before.st_size} bytes, more than the {max_bytes} allowed")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if within is not None else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise FileRefused(f"{path}: cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise FileRefused(f"{path}: changed while being opened (now {kind(st.st_mode)})")
        return read_upto(fd, st.st_size)
    finally:
        os.close(fd)


def read_upto(fd: int, size: int) -> bytes:
    """At most `size` bytes of an open file: no more than its size said when it was checked, so a
    file still growing is cut there (a writer cannot make a read unbounded)."""
    chunks, left = [], size
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 22))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
