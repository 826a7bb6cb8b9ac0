"""Causal-tree persistence: load at start, save periodically and at shutdown.

What C-MLFQ learned (the causal prefix tree of remaining lengths) is worth keeping across gateway
restarts: a cold tree routes nothing ahead until enough sessions finish again. The router owns its
tree (`router.tree`, a `CausalTree`); this store only moves it to and from a JSON file.

- Loading merges the file into the router's fresh tree, so the router's own window and depth
  limits apply to what is loaded. A file that exists but cannot be read is a configuration error:
  starting empty would overwrite what it holds at the first save.
- Saving snapshots the tree on the event loop (`to_dict` copies every node, so the loop can keep
  mutating the live tree), then encodes and writes it in a worker thread, atomically (a temporary
  file renamed over the old one) so a crash mid-write never leaves a truncated tree behind.
- A save happens only when sessions finished since the last one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from libra.core.config import read_text_file
from libra.core.errors import ConfigError, LibraError
from libra.rollout.tree import CausalTree

log = logging.getLogger("libra.gateway")

# A tree of 100k nodes with full windows is about 100 MiB of JSON; 2 GiB is far beyond any real
# one and still loads in this process's memory.
MAX_TREE_BYTES = 2 << 30


def router_tree(router) -> CausalTree | None:
    tree = getattr(router, "tree", None)
    return tree if isinstance(tree, CausalTree) else None


class TreeStore:
    def __init__(self, router, path: str | Path, interval_s: float):
        if router_tree(router) is None:
            raise ConfigError("tree_path", str(path), f"a router with a causal tree (router {getattr(router, 'name', router)!r} has none; use cmlfq or cmlfq-paper)")  # fmt: skip
        self.router, self.path, self.interval_s = router, Path(path), interval_s
        if not self.path.parent.is_dir():
            raise ConfigError("tree_path", str(path), "a file in an existing directory")
        self.dirty = 0
        self.saves = 0
        self.on_save = lambda: None

    @property
    def tree(self) -> CausalTree:
        return self.router.tree

    def load(self) -> int:
        """Merge the file into the router's tree; returns the samples loaded (0 if no file yet)."""
        if not self.path.exists():
            log.info("tree %s does not exist yet; starting with an empty tree", self.path)
            return 0
        # A regular file of at most MAX_TREE_BYTES (/dev/zero would be read forever); ValueError is
        # a special file, too big a file, or not JSON.
        try:
            loaded = CausalTree.from_dict(json.loads(read_text_file(self.path, MAX_TREE_BYTES)))
        except (OSError, ValueError, RecursionError, LibraError) as e:
            raise ConfigError(
                "tree_path", str(self.path), f"a causal tree file written by Libra, a regular file ({e})"
            ) from None
        self.tree.merge(loaded)
        log.info("loaded tree %s: %d nodes, %d samples", self.path, loaded.node_count(), loaded.root.count)
        return loaded.root.count

    def changed(self, n: int = 1) -> None:
        self.dirty += n

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.dirty:
                await self.save()

    async def save(self) -> None:
        snapshot, self.dirty = self.tree.to_dict(), 0
        try:
            await asyncio.to_thread(_write_atomic, self.path, snapshot)
        except OSError as e:  # a full disk must not take routing down; try again next period
            self.dirty += 1
            log.error("could not save tree to %s: %s", self.path, e)
            return
        self._saved()

    def save_now(self) -> None:
        """Synchronous save (at shutdown, when the loop is about to stop)."""
        snapshot, self.dirty = self.tree.to_dict(), 0
        _write_atomic(self.path, snapshot)
        self._saved()

    def _saved(self) -> None:
        self.saves += 1
        self.on_save()

    def describe(self) -> dict:
        t = self.tree
        return {"path": str(self.path), "nodes": t.node_count(), "samples": t.root.count,
                "prompts": len(t.prompts), "unsaved_finishes": self.dirty, "saves": self.saves}  # fmt: skip


def _write_atomic(path: Path, snapshot: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(snapshot, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
