"""Sampling helpers shared by the workload families, and the builder that enforces the limits.

Every family draws the same kinds of quantities (lognormal token counts, log-odds decisions, a
weighted choice of tool, a parameter that drifts over training) and must obey the same two limits:
the context never exceeds `max_length`, and a trajectory has at most `max_turns` turns. Keeping
those rules in one `TrajectoryBuilder` means no family can forget them, and a family's module only
describes its generative process.

Everything draws from the `random.Random` passed in, so one seed gives one output.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from itertools import accumulate
from typing import Annotated

from pydantic import Field

from libra.core.trajectory import ToolStatus, Trajectory, Turn

# The largest log-space spread or gain a workload parameter may have. A one-sigma factor of e^5 =
# 148x is already far past any real distribution; a larger value is a typo, and e^(sigma * z) of it
# could overflow a float.
MAX_LOG_SPREAD = 5.0
LogSpread = Annotated[float, Field(ge=0, le=MAX_LOG_SPREAD)]


def sigmoid(x: float) -> float:
    # Clamped so extreme log-odds (large penalties) never overflow math.exp.
    if x < -40.0:
        return 0.0
    if x > 40.0:
        return 1.0
    return 1.0 / (1.0 + math.exp(-x))


def lognormal_int(rng: random.Random, median: float, sigma: float, minimum: int = 1) -> int:
    """A token count: lognormal with this median and log-space sigma, at least `minimum`."""
    if sigma <= 0:
        return max(minimum, round(median))
    return max(minimum, round(median * math.exp(rng.gauss(0.0, sigma))))


def drift_fraction(step: int, drift_steps: int) -> float:
    """How far training has progressed through the drift horizon: 0 at step 0, 1 from drift_steps on."""
    return min(max(step, 0) / drift_steps, 1.0)


def lerp(start: float, end: float, frac: float) -> float:
    return start + (end - start) * frac


def log_lerp(start: float, end: float, frac: float) -> float:
    """Geometric interpolation: token counts grow by a constant factor per step, not a constant amount."""
    return start * (end / start) ** frac


class WeightedChoice:
    """Pick a key with probability proportional to its weight; cumulative weights are built once."""

    __slots__ = ("keys", "cum", "total")

    def __init__(self, weights: dict[str, float]):
        self.keys = list(weights)
        self.cum = list(accumulate(weights.values()))
        self.total = self.cum[-1]

    def pick(self, rng: random.Random) -> str:
        i = bisect_right(self.cum, rng.random() * self.total)
        return self.keys[min(i, len(self.keys) - 1)]


class TrajectoryBuilder:
    """Appends turns to one trajectory while enforcing `max_length` and `max_turns`.

    `add_output` returns False when the output had to be cut at `max_length`; `add_tool` returns
    False when the tool's return would not fit, in which case the turn is left as the final turn
    (the rollout is stopped at the length limit, as an RL agent loop does). Callers stop as soon
    as either returns False, or call `finish` to end with a final answer.
    """

    __slots__ = ("traj", "max_length", "max_turns", "context", "_pending")

    def __init__(self, traj: Trajectory, max_length: int, max_turns: int):
        self.traj, self.max_length, self.max_turns = traj, max_length, max_turns
        self.context = traj.prompt_tokens
        self._pending: Turn | None = None

    @property
    def turns(self) -> int:
        return len(self.traj.turns)

    @property
    def at_turn_limit(self) -> bool:
        """True once the trajectory holds max_turns turns: the last one may not call a tool."""
        return len(self.traj.turns) >= self.max_turns

    def add_output(self, tokens: int) -> bool:
        room = self.max_length - self.context
        fits = tokens < room
        turn = Turn(output_tokens=tokens if fits else max(room, 0))
        self.traj.turns.append(turn)
        self.context += turn.output_tokens
        self._pending = turn if fits and not self.at_turn_limit else None
        return self._pending is not None

    def add_tool(self, tool: str, tokens: int, status: ToolStatus, latency_s: float) -> bool:
        """Attach a tool call to the turn just generated. The return must leave room for one more token."""
        turn = self._pending
        if turn is None:
            raise RuntimeError("add_tool needs a turn from add_output that may call a tool")
        self._pending = None
        if self.context + tokens >= self.max_length:
            return False
        turn.tool, turn.tool_return_tokens = tool, tokens
        turn.tool_status, turn.tool_latency_s = status, latency_s
        self.context += tokens
        return True
