"""What the planner knows about the workload: statistics of recent steps, never future lengths.

A `WorkloadStats` is a snapshot the mechanism builds from trajectories that have *finished* (the
last step or a window of steps), plus the train and rollout times it measured. It keeps one small
record per trajectory (final length, generated tokens, prefilled tokens, mean decode context,
summed tool latency, turns), which is a histogram at its finest grain; `from_histogram` builds the
same thing from a coarse length histogram when that is all a live system kept.

From trajectories it also keeps each one's GRPO group, so `group_spread` can say how the groups'
latencies spread below the slowest one: what a pipeline that trains the first groups to finish
waits for (`plan.completion_wait`). A histogram has no groups, and then the planner assumes a step
waits for its slowest group.

The rollout DP needs the batch in quantile bins, and training needs a list of sequence lengths of
the batch's size; both are derived here, deterministically, so two planners given the same stats
agree exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from libra.core.errors import ConfigError
from libra.core.trajectory import Trajectory

SPREAD_POINTS = 256  # groups kept by `WorkloadStats.group_spread`


@dataclass(frozen=True, slots=True)
class LengthBins:
    """The batch cut into quantile bins of final length, scaled to one step's trajectory count.

    Per bin: trajectories per step, summed generated / prefilled tokens, the generated-token
    weighted sum of decode context, the largest final length, and, separately for each step of
    the history, the (generated tokens, tool seconds) of the bin's `LINES` champion trajectories
    (see `champion_lines`) and whether the step has any trajectory in the bin.
    """

    count: np.ndarray
    gen: np.ndarray
    prefill: np.ndarray
    gen_ctx: np.ndarray
    final: np.ndarray  # summed final lengths: the KV a bin's trajectories hold at their peak
    tool: np.ndarray  # summed tool seconds
    final_max: np.ndarray
    line_gen: np.ndarray  # (bins, steps, LINES)
    line_tool: np.ndarray  # (bins, steps, LINES)
    present: np.ndarray  # (bins, steps): 1.0 where the step has a trajectory in the bin

    def __len__(self) -> int:
        return len(self.count)


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    final_tokens: tuple[int, ...] = ()
    generated_tokens: tuple[int, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    decode_context: tuple[float, ...] = ()
    tool_latency_s: tuple[float, ...] = ()
    turns: tuple[int, ...] = ()
    train_time_s: float | None = None
    rollout_time_s: float | None = None
    steps: tuple[int, ...] = ()  # the RL step of each trajectory, when known
    groups: tuple[int, ...] = ()  # the GRPO group (prompt) of each trajectory, when known

    def __post_init__(self) -> None:
        n = len(self.final_tokens)
        for name in ("steps", "groups"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ConfigError(
                    f"stats.{name}", len(getattr(self, name)), f"{n} entries, one per trajectory, or none"
                )
        for name in ("generated_tokens", "prefill_tokens", "decode_context", "tool_latency_s", "turns"):
            if len(getattr(self, name)) != n:
                raise ConfigError(
                    f"stats.{name}", len(getattr(self, name)), f"{n} entries, one per trajectory"
                )
        if n and min(self.final_tokens) < 1:
            raise ConfigError("stats.final_tokens", min(self.final_tokens), "lengths >= 1")
        for name in ("train_time_s", "rollout_time_s"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ConfigError(f"stats.{name}", v, "a time >= 0 s, or None when not measured")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_trajectories(
        cls,
        trajs: Sequence[Trajectory],
        train_time_s: float | None = None,
        rollout_time_s: float | None = None,
        default_tool_latency_s: float = 0.0,
    ) -> WorkloadStats:
        """Records of finished trajectories. A tool call without a recorded latency counts as
        `default_tool_latency_s` (the trace format leaves the latency optional)."""
        recs = [_record(t, default_tool_latency_s) for t in trajs]
        cols = list(zip(*recs, strict=True)) if recs else [()] * 6
        group_of: dict[tuple[int, str], int] = {}
        groups = tuple(group_of.setdefault((t.step, t.prompt_id), len(group_of)) for t in trajs)
        return cls(
            *(tuple(c) for c in cols), train_time_s=train_time_s, rollout_time_s=rollout_time_s,
            steps=tuple(t.step for t in trajs), groups=groups,
        )  # fmt: skip

    @classmethod
    def from_histogram(
        cls,
        edges: Sequence[int],
        counts: Sequence[int],
        generated_fraction: float = 0.3,
        tool_latency_s: float = 0.0,
        turns: int = 1,
        **measured: float | None,
    ) -> WorkloadStats:
        """A coarse length histogram: `counts[k]` trajectories ended in (edges[k], edges[k+1]].

        Each is taken at its bin's upper edge (so the plan is never too small for the bin), with
        `generated_fraction` of it generated and the rest prefilled (prompt and tool returns).
        """
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise ConfigError("histogram.edges", list(edges), "len(counts)+1 increasing edges")
        if not 0 < generated_fraction <= 1 or any(c < 0 for c in counts):
            raise ConfigError(
                "histogram", (generated_fraction, list(counts)), "0 < fraction <= 1, counts >= 0"
            )
        finals = [int(edges[k + 1]) for k, c in enumerate(counts) for _ in range(int(c))]
        gens = [max(1, int(f * generated_fraction)) for f in finals]
        pre = [f - g for f, g in zip(finals, gens, strict=True)]
        ctx = [p + g / 2 for p, g in zip(pre, gens, strict=True)]
        n = len(finals)
        return cls(
            tuple(finals),
            tuple(gens),
            tuple(pre),
            tuple(ctx),
            (tool_latency_s,) * n,
            (turns,) * n,
            **measured,
        )

    # ---- derived views -----------------------------------------------------------------------

    @property
    def is_empty(self) -> bool:
        return not self.final_tokens

    @property
    def size(self) -> int:
        return len(self.final_tokens)

    @property
    def max_final(self) -> int:
        return max(self.final_tokens) if self.final_tokens else 0

    def with_times(self, train_time_s: float | None, rollout_time_s: float | None) -> WorkloadStats:
        return replace(self, train_time_s=train_time_s, rollout_time_s=rollout_time_s)

    def by_step(self) -> list[WorkloadStats]:
        """One snapshot per RL step in the history; [] unless it spans two steps or more."""
        if len(set(self.steps)) < 2:
            return []
        cols = (
            "final_tokens",
            "generated_tokens",
            "prefill_tokens",
            "decode_context",
            "tool_latency_s",
            "turns",
        )
        out = []
        for step in sorted(set(self.steps)):
            keep = [k for k, s in enumerate(self.steps) if s == step]
            sub = {c: tuple(getattr(self, c)[k] for k in keep) for c in cols}
            groups = tuple(self.groups[k] for k in keep) if self.groups else ()
            out.append(WorkloadStats(**sub, steps=(step,) * len(keep), groups=groups))
        return out

    def group_spread(self, points: int = SPREAD_POINTS) -> tuple[tuple[float, float], ...]:
        """When each GRPO group is done, relative to its step, in the two regimes a rollout spans.

        A group is done when its slowest sample is. Per group, two fractions in (0, 1]:
        - latency: the slowest sample's serial time on the line D * X_REF_S + S (decode tokens at
          a typical iteration, plus tool seconds) over the slowest group's of the same step. This
          is when it finishes where the engines have room (latency-bound);
        - shared: the share of its step's decode tokens served by the time its slowest sample is
          done, when the engines are full and share their iterations (processor sharing: a sample
          of D tokens is done once every sample has had min(D, its own) tokens). This is when it
          finishes where the engines are the bottleneck (capacity-bound).

        `plan.completion_wait` scales the first by T_rollout and the second by the work bound.
        At most `points` groups are kept, evenly spaced in latency order. Empty without group
        labels.
        """
        if not self.groups or self.is_empty:
            return ()
        gen = np.asarray(self.generated_tokens, dtype=np.float64)
        serial = gen * X_REF_S + np.asarray(self.tool_latency_s, dtype=np.float64)
        steps = np.asarray(self.steps) if self.steps else np.zeros(self.size, dtype=np.int64)
        groups = np.asarray(self.groups)
        lat, shared = np.zeros(self.size), np.zeros(self.size)
        for step in np.unique(steps):
            m = steps == step
            lat[m] = serial[m] / max(serial[m].max(), 1e-12)
            srt = np.sort(gen[m])
            cum = np.concatenate(([0.0], np.cumsum(srt)))
            k = np.searchsorted(srt, gen[m], side="right")
            shared[m] = (cum[k] + gen[m] * (len(srt) - k)) / max(cum[-1], 1e-12)
        _, g = np.unique(groups, return_inverse=True)
        n = int(g.max()) + 1
        lat_g, shared_g = np.zeros(n), np.zeros(n)
        np.maximum.at(lat_g, g, lat)
        np.maximum.at(shared_g, g, shared)
        order = np.argsort(lat_g, kind="stable")
        if n > points:
            order = order[np.linspace(0, n - 1, points).round().astype(np.int64)]
        return tuple((float(lat_g[i]), float(shared_g[i])) for i in order)

    def step_groups(self, batch_size: int) -> np.ndarray:
        """Each trajectory's step in the history as 0..S-1, S <= MAX_STEP_GROUPS.

        Without step labels, a history of k batches is dealt round-robin into k pseudo-steps.
        Histories longer than MAX_STEP_GROUPS steps have neighbouring steps merged.
        """
        if len(set(self.steps)) >= 2:
            index = {s: k for k, s in enumerate(sorted(set(self.steps)))}
            g, n = np.asarray([index[s] for s in self.steps]), len(index)
        else:
            n = self.steps_covered(batch_size)
            g = np.arange(self.size) % n
        return g * MAX_STEP_GROUPS // n if n > MAX_STEP_GROUPS else g

    def arrays(self, batch_size: int = 0) -> dict[str, np.ndarray]:
        """Per-trajectory columns sorted by final length (ties keep their order: a stable sort)."""
        order = np.argsort(np.asarray(self.final_tokens), kind="stable")
        cols = {
            "final": self.final_tokens, "gen": self.generated_tokens, "prefill": self.prefill_tokens,
            "ctx": self.decode_context, "tool": self.tool_latency_s,
        }  # fmt: skip
        out = {k: np.asarray(v, dtype=np.float64)[order] for k, v in cols.items()}
        out["step"] = self.step_groups(batch_size or self.size)[order]
        return out

    def bins(self, n_bins: int, batch_size: int) -> LengthBins:
        """Equal-count quantile bins; with fewer trajectories than bins, one bin per trajectory."""
        if self.is_empty:
            raise ConfigError("stats", "empty history", "at least one finished trajectory to plan from")
        a = self.arrays(batch_size)
        groups = np.array_split(np.arange(self.size), min(n_bins, self.size))
        scale, n_steps = batch_size / self.size, int(a["step"].max()) + 1
        keys = (
            "count",
            "gen",
            "prefill",
            "gen_ctx",
            "final",
            "tool",
            "final_max",
            "line_gen",
            "line_tool",
            "present",
        )
        agg = {k: [] for k in keys}
        for g in groups:
            agg["count"].append(len(g) * scale)
            agg["gen"].append(a["gen"][g].sum() * scale)
            agg["prefill"].append(a["prefill"][g].sum() * scale)
            agg["gen_ctx"].append((a["gen"][g] * a["ctx"][g]).sum() * scale)
            agg["final"].append(a["final"][g].sum() * scale)
            agg["tool"].append(a["tool"][g].sum() * scale)
            agg["final_max"].append(a["final"][g].max())
            lg, lt, present = champion_lines(a["gen"][g], a["tool"][g], a["step"][g], n_steps)
            agg["line_gen"].append(lg)
            agg["line_tool"].append(lt)
            agg["present"].append(present)
        return LengthBins(**{k: np.asarray(v, dtype=np.float64) for k, v in agg.items()})

    def steps_covered(self, batch_size: int) -> int:
        """How many steps of `batch_size` trajectories the history holds (at least 1)."""
        return max(1, round(self.size / max(1, batch_size)))

    def batch_lengths(self, batch_size: int) -> list[int]:
        """`batch_size` sequence lengths at evenly spaced quantiles of the recent lengths.

        Training is planned for one step's batch whatever the size of the history window.
        """
        if self.is_empty:
            raise ConfigError("stats", "empty history", "at least one finished trajectory to plan from")
        srt = sorted(self.final_tokens)
        n = len(srt)
        return [srt[min(n - 1, int((k + 0.5) * n / batch_size))] for k in range(batch_size)]


# A trajectory's serial time is D * x + S: D decode iterations of x seconds each, plus S seconds of
# tools. The slowest trajectory of a group depends on x (which depends on TP and batch), so a group
# keeps the trajectories that win at three points of the line family: the most decode (x large),
# the most tool time (x small), and the largest D * X_REF + S at a typical decode iteration. The
# range's latency floor is the largest of their lines: exact at both ends and at X_REF, and never
# more than the slowest real trajectory (unlike max(D) * x + max(S), which may pair two of them).
#
# The lines are kept per step of the history and the floor is their mean over steps: a step's
# makespan waits for the slowest trajectory of *that step*, so the expected floor is the mean of
# per-step maxima. The maximum over the whole window would grow with the window and let one
# outlier set the prediction for every step.
X_REF_S = 0.03
LINES = 3
MAX_STEP_GROUPS = 8


def champions(gen: np.ndarray, tool: np.ndarray) -> np.ndarray:
    """Indices of the LINES champion trajectories of a group (see X_REF_S)."""
    return np.asarray([np.argmax(gen), np.argmax(tool), np.argmax(gen * X_REF_S + tool)])


def champion_lines(
    gen: np.ndarray, tool: np.ndarray, step: np.ndarray, n_steps: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: the champions' (generated, tool seconds), shape (n_steps, LINES), and presence."""
    lg, lt, present = np.zeros((n_steps, LINES)), np.zeros((n_steps, LINES)), np.zeros(n_steps)
    for s in range(n_steps):
        members = np.flatnonzero(step == s)
        if len(members):
            champ = members[champions(gen[members], tool[members])]
            lg[s], lt[s], present[s] = gen[champ], tool[champ], 1.0
    return lg, lt, present


def _record(t: Trajectory, default_latency: float) -> tuple[int, int, int, float, float, int]:
    """(final, generated, prefilled, generated-weighted mean decode context, tool seconds, turns)."""
    ctx, gen_ctx, tool = t.prompt_tokens, 0.0, 0.0
    for turn in t.turns:
        # While a turn generates o tokens its context grows from c to c + o: mean c + o/2.
        gen_ctx += turn.output_tokens * (ctx + turn.output_tokens / 2)
        ctx += turn.output_tokens + turn.tool_return_tokens
        if turn.has_tool:
            tool += default_latency if turn.tool_latency_s is None else turn.tool_latency_s
    gen = t.generated_tokens
    mean_ctx = gen_ctx / gen if gen else float(t.prompt_tokens)
    return t.total_tokens, gen, t.total_tokens - gen, mean_ctx, tool, len(t.turns)
