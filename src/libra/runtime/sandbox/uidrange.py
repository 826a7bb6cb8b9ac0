"""The sandbox uid range a service owns, exclusively, for as long as it runs.

A service runs each sandbox under its own uid and, after every run, kills what is left of that
uid. Two services sharing uids would kill each other's programs (a correct program came back
`Failed, 137`: a wrong reward with no error shown). So a range is owned: uids are grouped in
aligned blocks of `BLOCK` and a service holds an exclusive `flock` on a lock file per block of
its range, for its whole life (the kernel drops the locks when the process dies, however it dies:
no stale state). Without `sandbox.uid_base` the service takes the first free range at or above
`AUTO_BASE`, far from the uids people and containers use; with it, a range that another service
holds, that `/etc/passwd` names, or that a running process already uses is refused with a message
that says who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from libra.core.errors import ConfigError

BLOCK = 64  # uids per lock file
AUTO_BASE = 1_000_000_000  # automatic ranges start here: above subuid ranges and real accounts
AUTO_TRIES = 4096  # ranges tried before giving up
UID_MAX = 2**32 - 2  # (uid_t)-1 means "no change" to setuid


@dataclass(slots=True)
class UidRange:
    """A range of uids whose block locks this process holds until `release()`."""

    base: int
    count: int
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def uids(self) -> range:
        return range(self.base, self.base + self.count)

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def lock_dir() -> Path:
    """Where the block locks live: /run/lock (a tmpfs every service on the host shares)."""
    for d in (Path("/run/lock"), Path(tempfile.gettempdir())):
        if d.is_dir() and os.access(d, os.W_OK):
            out = d / "libra-actions-uids"
            out.mkdir(mode=0o755, exist_ok=True)
            return out
    raise ConfigError("sandbox.uid_base", None, "a writable /run/lock or temp dir for the uid locks")


def acquire(base: int | None, count: int, where: Path | None = None) -> UidRange:
    """Lock `count` uids from `base`, or the first free range when `base` is None."""
    where = where or lock_dir()
    if base is not None:
        return _acquire_exact(base, count, where)
    taken = _uids_in_use()
    blocks = -(-count // BLOCK)
    for i in range(AUTO_TRIES):
        start = AUTO_BASE + i * blocks * BLOCK
        if any(start <= u < start + count for u in taken) or _named_in_passwd(start, count):
            continue
        got = _try_lock(start, count, where)
        if isinstance(got, UidRange):
            return got
    raise ConfigError("sandbox.uid_base", None, f"a free uid range ({AUTO_TRIES} ranges tried)")


def _acquire_exact(base: int, count: int, where: Path) -> UidRange:
    last = base + count - 1
    if last > UID_MAX:
        raise ConfigError("sandbox.uid_base", base, f"a range that ends at or below {UID_MAX}")
    got = _try_lock(base, count, where)
    if not isinstance(got, UidRange):
        raise ConfigError(
            "sandbox.uid_base", base,
            f"a uid range no other actions service holds ({base}-{last} overlaps one held by pid {got or '?'}); "
            "leave sandbox.uid_base unset to pick a free range",
        )  # fmt: skip
    problem = _account_or_process_in(base, last)
    if problem:
        got.release()
        raise ConfigError(
            "sandbox.uid_base", base,
            f"a range no account or running process uses ({problem}, and this service kills only what it "
            "started); leave sandbox.uid_base unset to pick a free range",
        )  # fmt: skip
    return got


def _account_or_process_in(base: int, last: int) -> str | None:
    if user := _named_in_passwd(base, last - base + 1):
        return f"account {user} has a uid in {base}-{last}"
    running = sorted(p for p, u in _processes().items() if base <= u <= last)
    return f"pid {running[0]} runs as a uid in {base}-{last}" if running else None


def _try_lock(base: int, count: int, where: Path) -> UidRange | str:
    """The locked range, or the pid written in the first lock file someone else holds."""
    held = UidRange(base, count)
    for block in range(base // BLOCK, (base + count - 1) // BLOCK + 1):
        fd = os.open(where / f"block-{block}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            held.release()
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        held._fds.append(fd)
    return held


def _processes() -> dict[int, int]:
    """pid -> real uid of every process on the host."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                out[int(entry.name)] = entry.stat().st_uid
    return out


def _uids_in_use() -> set[int]:
    return set(_processes().values())


def _named_in_passwd(base: int, count: int) -> str | None:
    for p in pwd.getpwall():
        if base <= p.pw_uid < base + count:
            return p.pw_name
    return None


class UidPool:
    """The uids of an owned range, handed out one per sandbox and returned when it is gone."""

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
