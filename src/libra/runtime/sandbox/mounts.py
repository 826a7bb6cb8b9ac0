"""Mounts the service makes for its sandboxes, in a mount namespace of its own.

Each sandbox's storage is a size-limited tmpfs (storage.py), so a program cannot fill the host's
disk and a sandbox's files vanish at once when it goes. Those mounts are made in a private mount
namespace that the service's main thread enters at start, before its event loop and worker threads
exist (they inherit it): the mounts are invisible to the rest of the host, and if the service dies
however it dies (SIGKILL included) the kernel drops them with the namespace, so no RAM-backed mount
is ever left behind. (A mount namespace belongs to a thread: threads started before, such as
numpy's BLAS pool, stay in the host's; none of them ever touches a sandbox's storage.)

Python has no mount(2); libc's is called through ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
MNT_DETACH = 2

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_private_namespace() -> str | None:
    """Unshare the mount namespace of the calling thread (and all it starts later) and make every
    mount in it private, so nothing mounted later propagates to the host. None, or why it could not."""
    try:
        _check(_c().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(_c().mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    except OSError as e:
        return str(e)
    return None


def mount_tmpfs(path: Path, size_bytes: int, inodes: int, mode: int = 0o711) -> None:
    opts = f"size={size_bytes},nr_inodes={inodes},mode={mode:o},uid=0,gid=0".encode()
    _check(
        _c().mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount tmpfs {path}"
    )


def unmount(path: Path) -> None:
    _check(_c().umount2(str(path).encode(), MNT_DETACH), f"umount {path}")


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """A writable view of the read-only `lower`: writes land in `upper`, `lower` never changes."""
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    _check(
        _c().mount(b"overlay", str(target).encode(), b"overlay", MS_NOSUID | MS_NODEV, opts),
        f"mount overlay {target}",
    )
