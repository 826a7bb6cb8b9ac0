"""The causal prefix tree: remaining-length statistics keyed by tool-state paths.

C-MLFQ's predictor. Every finished trajectory is walked down the tree along its path of tool
states; the node reached after k tool returns records how many tokens the trajectory still added
from there (its *remaining* length at turn k). A live trajectory looks up the deepest node that
matches its own path so far and reads the mean and P90 of the remaining length there. An unseen
state simply stops the walk, so the lookup falls back to the parent: that is the "causal" part —
only what has already happened to this trajectory is used.

There is one global root that pools every prompt, and one root per prompt (the GRPO group and the
same prompt in later epochs). Each node keeps a bounded window of its most recent samples (200 in
the reference code), so its statistics follow drift; the router also rebuilds the whole tree every
K steps from the most recent N trajectories (`TrajectoryLog`), which drops paths the policy no
longer takes. Trees serialise to JSON and merge, so workers that each saw part of a step can pool
what they learned.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from libra.core.errors import LibraError
from libra.rollout.base import FinishedTrajectory, PayloadSize, Status, ToolState

DEFAULT_WINDOW = 200
FORMAT = "libra.causal-tree/1"


class Node:
    """One tree node: its children by state, and a window of remaining-length samples.

    `count` is every sample ever recorded here (what "how many samples" means); mean and P90 are over
    the window of the last `window` samples. The sorted window is cached because a node is read on
    every tool return of every trajectory but written only when one finishes.
    """

    __slots__ = ("children", "samples", "count", "total", "_sorted")

    def __init__(self) -> None:
        self.children: dict[ToolState, Node] | None = None
        self.samples: list[int] = []
        self.count = 0
        self.total = 0
        self._sorted: list[int] | None = None

    def add(self, remaining: int, window: int) -> None:
        self.samples.append(remaining)
        self.total += remaining
        self.count += 1
        if len(self.samples) > window:
            self.total -= self.samples.pop(0)
        self._sorted = None

    def child(self, state: ToolState) -> Node | None:
        return None if self.children is None else self.children.get(state)

    def child_or_new(self, state: ToolState) -> Node:
        if self.children is None:
            self.children = {}
        node = self.children.get(state)
        if node is None:
            node = self.children[state] = Node()
        return node

    @property
    def mean(self) -> float:
        return self.total / len(self.samples) if self.samples else 0.0

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the window (q=0.9 is the P90)."""
        if not self.samples:
            return 0.0
        if self._sorted is None:
            self._sorted = sorted(self.samples)
        s = self._sorted
        return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])

    @property
    def p90(self) -> float:
        return self.quantile(0.9)

    def sorted_samples(self) -> list[int]:
        if self._sorted is None:
            self._sorted = sorted(self.samples)
        return self._sorted

    def size(self) -> int:
        """Nodes in this subtree, this one included (iterative: paths can be deep)."""
        n, stack = 0, [self]
        while stack:
            node = stack.pop()
            n += 1
            if node.children:
                stack.extend(node.children.values())
        return n


def remaining_lengths(traj: FinishedTrajectory) -> list[int]:
    """Remaining tokens at the start of each turn: final length minus the context then."""
    return [max(0, traj.final_tokens - c) for c in traj.turn_contexts]


@dataclass(slots=True)
class Match:
    """The result of a lookup: the node used, its depth, and whether it came from the prompt's tree."""

    node: Node
    depth: int
    per_prompt: bool


class CausalTree:
    """A global root plus one root per prompt, with bounded windows and bounded depth."""

    __slots__ = ("window", "max_depth", "per_prompt", "root", "prompts", "generation")

    def __init__(self, window: int = DEFAULT_WINDOW, max_depth: int = 64, per_prompt: bool = True):
        self.window, self.max_depth, self.per_prompt = window, max_depth, per_prompt
        self.root = Node()
        self.prompts: dict[str, Node] = {}
        # Bumped whenever nodes are replaced wholesale (rebuild, load), so cached walks know to redo.
        self.generation = 0

    # ---- writing ------------------------------------------------------------------------------

    def insert(self, prompt_id: str, path: Sequence[ToolState], remaining: Sequence[int]) -> None:
        """Record one trajectory: `remaining[k]` is its remaining length after `k` tool returns."""
        roots = [self.root]
        if self.per_prompt:
            roots.append(self.prompts.get(prompt_id) or self.prompts.setdefault(prompt_id, Node()))
        depth = min(len(remaining) - 1, len(path), self.max_depth)
        if depth < 0:
            return
        for node in roots:
            node.add(remaining[0], self.window)
            for k in range(depth):
                node = node.child_or_new(path[k])
                node.add(remaining[k + 1], self.window)

    def insert_finished(self, traj: FinishedTrajectory) -> None:
        self.insert(traj.prompt_id, traj.path, remaining_lengths(traj))

    def clear(self) -> None:
        self.root = Node()
        self.prompts = {}
        self.generation += 1

    # ---- reading ------------------------------------------------------------------------------

    def walk(self, start: Node, path: Sequence[ToolState]) -> list[Node]:
        """Nodes along `path` from `start` (start first) until the path leaves the tree."""
        nodes = [start]
        node: Node | None = start
        for state in path[: self.max_depth]:
            node = nodes[-1].child(state)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def walks(self, prompt_id: str, path: Sequence[ToolState]) -> tuple[list[Node], list[Node]]:
        """Nodes along `path` from the global root and from the prompt's root (empty if none)."""
        proot = self.prompts.get(prompt_id) if self.per_prompt else None
        return self.walk(self.root, path), (self.walk(proot, path) if proot is not None else [])

    def lookup(self, prompt_id: str, path: Sequence[ToolState], min_samples: int = 1) -> Match | None:
        """The deepest node on `path` with at least `min_samples`, the prompt's tree winning ties.

        None only when the tree is empty (cold start) or no node on the path has enough samples.
        """
        return best_match(*self.walks(prompt_id, path), min_samples)

    def exact(self, prompt_id: str, path: Sequence[ToolState]) -> tuple[Node | None, Node | None]:
        """The global and the prompt's node for exactly `path` (None where the path is unseen)."""
        return exact_nodes(*self.walks(prompt_id, path), min(len(path), self.max_depth))

    def node_count(self) -> int:
        return self.root.size() + sum(r.size() for r in self.prompts.values())

    # ---- merge and JSON ----------------------------------------------------------------------

    def merge(self, other: CausalTree) -> None:
        """Pool another worker's tree into this one: counts add, windows interleave."""
        _merge_node(self.root, other.root, self.window)
        for pid, root in other.prompts.items():
            _merge_node(self.prompts.setdefault(pid, Node()), root, self.window)
        self.generation += 1

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "window": self.window,
            "max_depth": self.max_depth,
            "per_prompt": self.per_prompt,
            "global": _node_to_dict(self.root),
            "prompts": {pid: _node_to_dict(n) for pid, n in self.prompts.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> CausalTree:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise LibraError(f"causal tree: expected a JSON object with format {FORMAT!r}")
        try:
            tree = cls(int(data["window"]), int(data["max_depth"]), bool(data["per_prompt"]))
            tree.root = _node_from_dict(data["global"])
            tree.prompts = {str(p): _node_from_dict(n) for p, n in data["prompts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise LibraError(f"causal tree: malformed node data ({type(e).__name__}: {e})") from None
        return tree

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CausalTree:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LibraError(f"causal tree {path}: cannot be read as JSON ({e})") from None
        return cls.from_dict(data)


class Cursor:
    """A trajectory's walk down one root, kept between its turns.

    A trajectory's path only grows, so the walk of turn k+1 is the walk of turn k plus the new
    state: caching it makes a lookup O(1) per turn instead of O(depth), which is what keeps a
    decision on a 100-turn SWE trajectory inside the latency budget. Nodes are never replaced
    except by a rebuild or a load (the tree's generation changes), so cached nodes stay valid, and
    a walk that stopped at an unseen state retries that one state each turn, in case a finished
    sibling has added it since.
    """

    __slots__ = ("generation", "nodes")

    def __init__(self) -> None:
        self.generation = -1
        self.nodes: list[Node] = []

    def advance(self, tree: CausalTree, root: Node, path: Sequence[ToolState]) -> list[Node]:
        nodes = self.nodes
        if (
            self.generation != tree.generation
            or not nodes
            or nodes[0] is not root
            or len(nodes) > len(path) + 1
        ):
            self.generation, nodes = tree.generation, [root]
            self.nodes = nodes
        limit = min(len(path), tree.max_depth)
        while len(nodes) <= limit:
            node = nodes[-1].child(path[len(nodes) - 1])
            if node is None:
                break
            nodes.append(node)
        return nodes


class CursorTable:
    """Cursors of running trajectories (global and per-prompt walk), bounded in number."""

    __slots__ = ("cursors", "limit")

    def __init__(self, limit: int = 200_000):
        self.cursors: dict[str, tuple[Cursor, Cursor]] = {}
        self.limit = limit

    def walks(self, tree: CausalTree, traj_id: str, prompt_id: str, path: Sequence[ToolState]):
        """(global nodes, prompt nodes) along `path`; the prompt's list is empty without a tree."""
        pair = self.cursors.get(traj_id)
        if pair is None:
            if len(self.cursors) >= self.limit:  # trajectories abandoned without on_finish
                self.cursors.pop(next(iter(self.cursors)))
            pair = self.cursors[traj_id] = (Cursor(), Cursor())
        g = pair[0].advance(tree, tree.root, path)
        proot = tree.prompts.get(prompt_id) if tree.per_prompt else None
        return g, (pair[1].advance(tree, proot, path) if proot is not None else [])

    def forget(self, traj_id: str) -> None:
        self.cursors.pop(traj_id, None)


def best_match(glob: Sequence[Node], mine: Sequence[Node], min_samples: int) -> Match | None:
    """From two walks: the deepest node with `min_samples`, the prompt's walk winning ties."""
    g = deepest(glob, min_samples)
    p = deepest(mine, min_samples)
    if p is not None and (g is None or p[1] >= g[1]):
        return Match(p[0], p[1], True)
    return Match(g[0], g[1], False) if g is not None else None


def exact_nodes(glob: Sequence[Node], mine: Sequence[Node], depth: int) -> tuple[Node | None, Node | None]:
    """From two walks: the nodes at exactly `depth`, where the walks got that far."""
    return (
        glob[depth] if len(glob) > depth else None,
        mine[depth] if len(mine) > depth else None,
    )


def deepest(nodes: Sequence[Node], min_samples: int) -> tuple[Node, int] | None:
    for depth in range(len(nodes) - 1, -1, -1):
        if nodes[depth].count >= min_samples and nodes[depth].samples:
            return nodes[depth], depth
    return None


def _merge_node(dst: Node, src: Node, window: int) -> None:
    stack = [(dst, src)]
    while stack:
        d, s = stack.pop()
        d.samples = _interleave(d.samples, s.samples)[-window:]
        d.total = sum(d.samples)
        d.count += s.count
        d._sorted = None
        for state, child in (s.children or {}).items():
            stack.append((d.child_or_new(state), child))


def _interleave(a: list[int], b: list[int]) -> list[int]:
    """Alternate from the oldest ends so that truncating keeps recent samples of both workers."""
    out: list[int] = []
    la, lb = len(a), len(b)
    longest = max(la, lb)
    for i in range(longest):
        # Align the two windows at their newest ends.
        ia, ib = i - (longest - la), i - (longest - lb)
        if ia >= 0:
            out.append(a[ia])
        if ib >= 0:
            out.append(b[ib])
    return out


def state_key(s: ToolState) -> str:
    return f"{s.tool}|{int(s.size)}|{int(s.status)}"


def state_from_key(key: str) -> ToolState:
    tool, size, status = key.rsplit("|", 2)
    return ToolState(tool, PayloadSize(int(size)), Status(int(status)))


def _node_to_dict(root: Node) -> list:
    """A flat list of [parent index, state key, count, window], root first (parent -1).

    Flat on purpose: a nested encoding of a path hundreds of states deep overflows the JSON
    encoder's and decoder's recursion limits.
    """
    out: list = [[-1, None, root.count, list(root.samples)]]
    stack = [(root, 0)]
    while stack:
        node, index = stack.pop()
        for state, child in (node.children or {}).items():
            out.append([index, state_key(state), child.count, list(child.samples)])
            stack.append((child, len(out) - 1))
    return out


def _node_from_dict(rows: list) -> Node:
    nodes: list[Node] = []
    for parent, key, count, samples in rows:
        node = Node() if parent < 0 else nodes[parent].child_or_new(state_from_key(key))
        node.samples = [int(x) for x in samples]
        node.total = sum(node.samples)
        node.count = int(count)
        nodes.append(node)
    if not nodes:
        raise ValueError("a tree needs its root")
    return nodes[0]


class TrajectoryLog:
    """The most recent N finished trajectories, kept compact, to rebuild the tree from."""

    __slots__ = ("items",)

    def __init__(self, capacity: int):
        self.items: deque[tuple[str, tuple[ToolState, ...], list[int]]] = deque(maxlen=capacity)

    def add(self, traj: FinishedTrajectory) -> None:
        self.items.append((traj.prompt_id, tuple(traj.path), remaining_lengths(traj)))

    def rebuild(self, tree: CausalTree) -> None:
        tree.clear()
        for prompt_id, path, remaining in self.items:
            tree.insert(prompt_id, path, remaining)

    def __iter__(self) -> Iterable:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
