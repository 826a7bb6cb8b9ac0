"""A sandbox's lasting parts: its uid, its storage and its cgroup, made and removed together.

A box outlives single executions: a session's actions, a /run_code's compile and run steps, and a
warm sandbox's start-up and request all run in one box. Making one (a uid from the owned range, a
tmpfs, a cgroup) and removing one (kill what is left, unmount, rmdir) are file-system work, so they
run in worker threads and the event loop only awaits them; removal after a response is sent runs in
the background, so no request waits for the previous one's clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

from libra.runtime.sandbox.cgroups import Cgroup, CgroupTree
from libra.runtime.sandbox.storage import Storage, Storages
from libra.runtime.sandbox.uidrange import UidPool


@dataclass(slots=True)
class Box:
    uid: int
    storage: Storage
    cgroup: Cgroup | None
    _ooms: int = 0

    def limit(self, memory_mb: int, cores) -> None:
        """Set the next execution's resident memory and cores (in a worker thread)."""
        if self.cgroup is not None:
            self.cgroup.set_memory(memory_mb * 2**20)
            self.cgroup.set_cores(list(cores))
            self._ooms = self.cgroup.oom_kills()

    def settle(self, sandboxed: bool) -> tuple[int, bool]:
        """After an execution: kill whatever of it is left (only this service's own processes: its
        cgroup, or its uid from the owned range) and tell whether the kernel killed one for memory."""
        if self.cgroup is not None:
            killed = self.cgroup.kill(self.uid)
        else:
            killed = reap_uid(self.uid) if sandboxed else 0
        oom = self.cgroup is not None and self.cgroup.oom_kills() > self._ooms
        return killed, oom


class Boxes:
    def __init__(
        self, uids: UidPool, storages: Storages, tree: CgroupTree | None, cores: list[int], sandboxed: bool
    ):
        self.uids, self.storages, self.tree, self.cores = uids, storages, tree, cores
        self.sandboxed = sandboxed
        self._removing: set[asyncio.Task] = set()

    async def create(self, areas: set[str] = frozenset(), caches=()) -> Box | None:
        """A new box, or None when every uid of the range is in use."""
        uid = self.uids.acquire()
        if uid is None:
            return None
        try:
            return await asyncio.to_thread(self._make, uid, areas, caches)
        except BaseException:
            self.uids.release(uid)
            raise

    def _make(self, uid: int, areas: set[str], caches) -> Box:
        st = self.storages.create(uid, areas, caches)
        try:
            cg = self.tree.make(str(uid), self.cores) if self.tree is not None else None
        except BaseException:
            self.storages.remove(st)
            raise
        return Box(uid, st, cg)

    def remove_soon(self, box: Box) -> asyncio.Task:
        """Remove the box in the background; its uid is free again once it is gone. The task is
        kept, so neither a cancelled request nor garbage collection can drop it half-way."""
        task = asyncio.get_running_loop().create_task(self._remove(box))
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)
        return task

    async def remove(self, box: Box) -> None:
        await asyncio.shield(self.remove_soon(box))

    async def _remove(self, box: Box) -> None:
        try:
            await asyncio.to_thread(self._unmake, box)
        finally:
            self.uids.release(box.uid)

    def _unmake(self, box: Box) -> None:
        box.settle(self.sandboxed)
        if box.cgroup is not None:
            box.cgroup.remove()
        self.storages.remove(box.storage)

    async def drain(self) -> None:
        """Wait for every removal in flight (at shutdown)."""
        for t in list(self._removing):
            with contextlib.suppress(Exception):
                await t


def reap_uid(uid: int) -> int:
    """SIGKILL any process still running as `uid` (a uid of this service's own range: its own
    processes only) and count them."""
    killed = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return killed
