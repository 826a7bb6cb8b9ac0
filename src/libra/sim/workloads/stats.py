"""Statistics of a set of trajectories, in the rows of the real-trajectory README.

Why: the generators are only trustworthy if their output has the statistics of real agents, and
the router is only judged fairly on realistic causal strength. The same function computes the
statistics of a generated trace and of a real one (`libra trace stats`), so they can be compared
row by row, and the tests hold the generators' defaults to the real figures.

Definitions (also in docs/workloads.md):
- turns: model turns per trajectory; final context: `Trajectory.total_tokens`.
- failing tool turns: tool turns whose status is failure or timeout, over all tool turns.
- tool-return share: all tool-return tokens over all final-context tokens (prompt included).
- Spearman correlations of total length with the number of failures, the total tool-return
  tokens, and the number of turns; average ranks for ties, computed with numpy.
- rollout-time proxy (needs no engine model): each turn's output tokens cost
  `decode_s_per_token * (1 + context / context_doubling_tokens)` each, at the context in the
  middle of the turn, plus every tool's latency. With the default doubling length (7545 tokens) a
  32K-token rollout costs 95x a 1K one, the Libra paper's measurement (DESIGN.md 1.3).
- tail share: the share of the summed rollout-time proxy taken by the longest 10% of
  trajectories (longest by final context).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from libra.core.trajectory import ToolStatus, Trajectory

DECODE_S_PER_TOKEN = 0.03  # one sequence's share of a batched decode step, Qwen3-14B class, seconds
CONTEXT_DOUBLING_TOKENS = 7545.0  # per-token decode time doubles here; gives the paper's 95x (1K->32K)
DEFAULT_TOOL_LATENCY_S = 1.0  # a tool turn without a recorded latency (real traces may lack it)


def rollout_time_proxy(
    traj: Trajectory,
    decode_s_per_token: float = DECODE_S_PER_TOKEN,
    context_doubling_tokens: float = CONTEXT_DOUBLING_TOKENS,
) -> float:
    """Seconds to roll out `traj` alone: context-dependent decode time plus tool latency."""
    ctx, total = traj.prompt_tokens, 0.0
    for t in traj.turns:
        mid = ctx + t.output_tokens / 2
        total += t.output_tokens * decode_s_per_token * (1.0 + mid / context_doubling_tokens)
        if t.has_tool:
            total += DEFAULT_TOOL_LATENCY_S if t.tool_latency_s is None else t.tool_latency_s
        ctx += t.output_tokens + t.tool_return_tokens
    return total


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    ordinal = np.empty(len(x), dtype=float)
    ordinal[order] = np.arange(len(x), dtype=float)
    _, inverse = np.unique(x, return_inverse=True)
    return (np.bincount(inverse, weights=ordinal) / np.bincount(inverse))[inverse]


def spearman(a, b) -> float | None:
    """Spearman's rank correlation; None when either side is constant or there are < 3 points."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def tail_share(lengths: np.ndarray, times: np.ndarray, frac: float = 0.1) -> float:
    """Share of total time taken by the `frac` longest trajectories."""
    k = max(1, int(round(len(lengths) * frac)))
    top = np.argsort(-lengths, kind="mergesort")[:k]
    total = times.sum()
    return float(times[top].sum() / total) if total > 0 else 0.0


_FEATURES = ("turns", "total", "failures", "timeouts", "tool_turns", "tool_tokens", "time", "step")


def features(trajs: Iterable[Trajectory]) -> dict[str, np.ndarray]:
    """One row of numbers per trajectory: everything the statistics need, in one pass."""
    rows = []
    for t in trajs:
        tool_turns = sum(1 for u in t.turns if u.has_tool)
        timeouts = sum(1 for u in t.turns if u.has_tool and u.tool_status == ToolStatus.TIMEOUT)
        rows.append((len(t.turns), t.total_tokens, t.failures, timeouts, tool_turns,
                     t.tool_return_tokens, rollout_time_proxy(t), t.step))  # fmt: skip
    arr = np.array(rows, dtype=float).reshape(-1, len(_FEATURES))
    return {name: arr[:, i] for i, name in enumerate(_FEATURES)}


def summarize(trajs: Iterable[Trajectory]) -> dict:
    """The README's rows (and a few more) for a set of trajectories."""
    return summarize_features(features(trajs))


def summarize_features(f: dict[str, np.ndarray]) -> dict:
    n = len(f["total"])
    if n == 0:
        return {"trajectories": 0}
    tool_turns = f["tool_turns"].sum()
    return {
        "trajectories": n,
        "steps": int(len(np.unique(f["step"]))),
        "turns_p50": float(np.percentile(f["turns"], 50)),
        "turns_p90": float(np.percentile(f["turns"], 90)),
        "turns_max": int(f["turns"].max()),
        "context_mean": float(f["total"].mean()),
        "context_p50": float(np.percentile(f["total"], 50)),
        "context_p90": float(np.percentile(f["total"], 90)),
        "context_max": int(f["total"].max()),
        "failing_tool_turns": float(f["failures"].sum() / tool_turns) if tool_turns else 0.0,
        "timeouts": int(f["timeouts"].sum()),
        "trajectories_with_failure": float((f["failures"] > 0).mean()),
        "tool_return_share": float(f["tool_tokens"].sum() / f["total"].sum()),
        "spearman_failures_length": spearman(f["failures"], f["total"]),
        "spearman_tool_return_length": spearman(f["tool_tokens"], f["total"]),
        "spearman_turns_length": spearman(f["turns"], f["total"]),
        "tail10_time_share": tail_share(f["total"], f["time"]),
    }


# Row labels for tables, in the README's order.
ROWS = {
    "trajectories": "trajectories",
    "steps": "RL steps",
    "turns_p50": "turns p50",
    "turns_p90": "turns p90",
    "turns_max": "turns max",
    "context_mean": "final context mean",
    "context_p50": "final context p50",
    "context_p90": "final context p90",
    "context_max": "final context max",
    "failing_tool_turns": "tool turns that fail",
    "timeouts": "  of which timeouts (count)",
    "trajectories_with_failure": "trajectories with >= 1 failure",
    "tool_return_share": "tool-return share of tokens",
    "spearman_failures_length": "Spearman: failures vs total length",
    "spearman_tool_return_length": "Spearman: tool-return size vs total length",
    "spearman_turns_length": "Spearman: turns vs total length",
    "tail10_time_share": "rollout-time share of longest 10%",
}
