"""The router-independent inputs of robust C-MLFQ's final-length model: GRPO sibling bookkeeping
and feature rows.

A module of its own because it runs on every tool return of every trajectory, which makes it one of
the modules `libra.sim.native` compiles; the router that uses it (`robust.py`) stays plain Python.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from libra.rollout.base import FinishedTrajectory, RouteRequest, Status

FEATURE_GROUPS = ("context", "progress", "last", "tools", "siblings")
TOOL_SLOTS = 16
_GROUP_WIDTH = {"context": 2, "progress": 4, "last": 3, "tools": 2 * TOOL_SLOTS, "siblings": 6}
START_WIDTH = 5
START, TOOL_RETURN = 0, 1  # kinds of remembered decisions
MAX_PENDING = 200_000
Tally = tuple[list[int], int]  # per-tool call counts, failures: a trajectory's path so far
NO_TALLY: Tally = ([], 0)  # for input sets that read neither counts nor failures

# ---- what the router knows about GRPO groups -----------------------------------------------------


@dataclass(slots=True)
class Group:
    """The samples of one prompt in one step, as seen so far."""

    running: dict[str, int] = field(default_factory=dict)  # traj_id -> latest context
    finished: list[int] = field(default_factory=list)


class SiblingBook:
    """Groups by (prompt, step), and each prompt's final lengths in earlier steps; both bounded."""

    __slots__ = ("groups", "history", "max_groups", "max_prompts")

    def __init__(self, max_groups: int = 4096, max_prompts: int = 65536):
        self.groups: dict[tuple[str, int], Group] = {}
        self.history: dict[str, deque[int]] = {}
        self.max_groups, self.max_prompts = max_groups, max_prompts

    def group(self, prompt_id: str, step: int) -> Group:
        key = (prompt_id, step)
        g = self.groups.get(key)
        if g is None:
            if len(self.groups) >= self.max_groups:  # the oldest group's step is long over
                self.groups.pop(next(iter(self.groups)))
            g = self.groups[key] = Group()
        return g

    def seen(self, req: RouteRequest) -> Group:
        g = self.group(req.prompt_id, req.step)
        g.running[req.traj_id] = req.context_tokens
        return g

    def finish(self, traj: FinishedTrajectory) -> None:
        g = self.group(traj.prompt_id, traj.step)
        g.running.pop(traj.traj_id, None)
        g.finished.append(traj.final_tokens)

    def end_step(self, step: int) -> None:
        """Groups of this step and earlier that are done become their prompt's history."""
        for key in [k for k, g in self.groups.items() if k[1] <= step and not g.running]:
            hist = self.history.get(key[0])
            if hist is None:
                if len(self.history) >= self.max_prompts:
                    self.history.pop(next(iter(self.history)))
                hist = self.history[key[0]] = deque(maxlen=32)
            hist.extend(self.groups.pop(key).finished)


# ---- feature rows --------------------------------------------------------------------------------


class Featurizer:
    """Turns a `RouteRequest`, and what the router knows, into the models' feature rows.

    The `tools` group is the path as a bag: which tool the last return came from, and how often
    each tool has been called so far. Tools get slots in the order they are first seen (the first
    TOOL_SLOTS - 1; later ones share the last slot), so rows keep a fixed width and an unseen tool
    is simply "another tool". Counts are kept per trajectory and extended by the new states only,
    so a 100-turn path costs no more than a short one.
    """

    __slots__ = ("groups", "book", "width", "vocab", "tallies", "_parts", "_tallied")

    def __init__(self, groups: Sequence[str], book: SiblingBook):
        self.groups = tuple(groups)
        self.book = book
        self.width = 1 + sum(_GROUP_WIDTH[g] for g in self.groups)
        self.vocab: dict[str, int] = {}
        self.tallies: dict[str, tuple[int, list[int], int]] = {}  # traj -> (states seen, counts, fails)
        self._parts = [getattr(self, "_" + name) for name in self.groups]  # bound once: row() is hot
        self._tallied = not {"progress", "tools"}.isdisjoint(self.groups)  # the groups that read it

    def candidates(self) -> list[np.ndarray]:
        """Column masks of nested input sets: the first group alone, then one group more each time."""
        out, cols = [], [True]
        for name in self.groups:
            cols = cols + [True] * _GROUP_WIDTH[name]
            out.append(np.array(cols + [False] * (self.width - len(cols))))
        return out

    def slot(self, tool: str) -> int:
        k = self.vocab.get(tool)
        if k is None:
            k = len(self.vocab) if len(self.vocab) < TOOL_SLOTS - 1 else TOOL_SLOTS - 1
            if k < TOOL_SLOTS - 1:
                self.vocab[tool] = k
        return k

    def forget(self, traj_id: str) -> None:
        self.tallies.pop(traj_id, None)

    def row(self, req: RouteRequest, g: Group) -> list[float]:
        c = max(1, req.context_tokens)
        tally = self._tally(req) if self._tallied else NO_TALLY
        x = [1.0]
        for part in self._parts:
            x += part(req, c, g, tally)
        return x

    def start_row(self, req: RouteRequest) -> list[float]:
        """A first turn knows only its prompt: its length, and how long the prompt ran before."""
        c = max(1, req.context_tokens)
        lc = math.log(c)
        return [1.0, lc, lc * lc, *self._history(req.prompt_id, c)]

    def _context(self, req: RouteRequest, c: int, g: Group, tally: Tally) -> list[float]:
        lc = math.log(c)
        return [lc, lc * lc]

    def _tally(self, req: RouteRequest) -> Tally:
        """Per-tool call counts and failures so far, extended by the path's new states only."""
        seen, counts, fails = self.tallies.get(req.traj_id, (0, None, 0))
        if counts is None or seen > len(req.path):
            seen, counts, fails = 0, [0] * TOOL_SLOTS, 0
        if seen < len(req.path):
            for state in req.path[seen:]:
                counts[self.slot(state.tool)] += 1
                fails += state.status != Status.SUCCESS
            if len(self.tallies) >= MAX_PENDING and req.traj_id not in self.tallies:
                self.tallies.pop(next(iter(self.tallies)))
            self.tallies[req.traj_id] = (len(req.path), counts, fails)
        return counts, fails

    def _progress(self, req: RouteRequest, c: int, g: Group, tally: Tally) -> list[float]:
        tool_tokens = max(0, req.context_tokens - req.prompt_tokens - req.generated_tokens)
        fails = tally[1]
        return [
            math.log1p(req.turn),
            math.log1p(fails),
            math.log1p(tool_tokens),
            math.log1p(max(0, req.generated_tokens)),
        ]

    def _last(self, req: RouteRequest, c: int, g: Group, tally: Tally) -> list[float]:
        if not req.path:
            return [0.0, 0.0, 0.0]
        last = req.path[-1]
        return [float(last.size), float(last.status == Status.FAILURE), float(last.status == Status.TIMEOUT)]

    def _tools(self, req: RouteRequest, c: int, g: Group, tally: Tally) -> list[float]:
        counts = tally[0]
        last = [0.0] * TOOL_SLOTS
        if req.path:
            last[self.slot(req.path[-1].tool)] = 1.0
        return last + [math.log1p(n) for n in counts]

    def _siblings(self, req: RouteRequest, c: int, g: Group, tally: Tally) -> list[float]:
        fin = g.finished
        others = [v for k, v in g.running.items() if k != req.traj_id]
        out = [0.0, 0.0, 0.0, 0.0]
        if fin:
            out[0], out[1] = 1.0, math.log(max(1.0, sum(fin) / len(fin)) / c)
            out[2] = len(fin) / (len(fin) + len(others) + 1)
        if others:
            out[3] = math.log(max(1, max(others)) / c)
        return out + self._history(req.prompt_id, c)

    def _history(self, prompt_id: str, c: int) -> list[float]:
        """The prompt's mean final length in earlier steps, relative to the context."""
        hist = self.book.history.get(prompt_id)
        return [1.0, math.log(max(1.0, sum(hist) / len(hist)) / c)] if hist else [0.0, 0.0]
