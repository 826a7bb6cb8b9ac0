"""The limit: a lower bound on each step's rollout makespan that no layout, router or split beats.

Why: a ladder of systems says which is fastest, not how much any system could still gain. A step's
rollout cannot end before two things, whatever the engines, routing or GPU split:

- **latency**: each trajectory's *serial floor*, its turns decoded alone (batch 1) on the fastest
  engine the cluster can run (the TP that minimises it), plus its tool latencies. Every decode
  iteration of a turn costs at least the batch-1 decode step at its context, and the turn's prefill
  iteration at least the batch-1 step's non-attention part (`RolloutCostModel.decode_coeffs(1)`);
  queueing, sharing a batch, migration and preemption only add. A GRPO group's floor is its
  slowest member's.
- **work**: the batch's tokens at the cluster's best per-GPU rate, on every GPU of the cluster: a
  token costs at least the per-token time of the fullest iteration an engine runs (the larger of
  `max_num_batched_tokens` and `max_num_seqs` tokens, attention at context 1), plus the decode
  attention of the rest of its context, on the TP where GPU-seconds are fewest.

How the two combine depends on what a step waits for (`pipeline.consume`):
- `batch`: step s waits for batch s, so its bound is max(the slowest group's floor, the batch's
  work / GPUs), the issue's definition.
- `completion`: step s takes the first groups to finish, from any batch. By the time it is full,
  steps 0..s have taken C_s groups, each finished no sooner than its batch's start plus its floor,
  so the step cannot be full before the C_s-th smallest of those times; and the groups it takes
  from batch s or later did all their work after batch s started. Both bounds use the batches'
  actual start times in that run, so the bound is per system and strict for each.

Why it stays a strict lower bound for asynchronous, partial and speculative systems (the peers,
`sim.rl.peers`; a property test runs every system on random seeds, bounds and workloads):

- **Interrupted requests** (AReaL's weight updates): an abort throws away the iteration in flight
  and the resubmitted request prefills its whole context again, and the engines pause for the
  weights. All of that only adds time and work: no trajectory finishes sooner than its serial
  floor after it first started, nor does less than its tokens' work.
- **Partial rollouts** (APRIL): a step trains groups started in earlier steps, and part of their
  work was done then. So a group's floor runs from its *first* submission (`submitted`), not
  from the start of the step that trains it, and the work term counts only the groups first
  submitted inside the step. A colocated system's engines work only inside its rollout windows
  (they are interrupted at the stop and paused while it trains), so a group's engine time (its
  serial floor without tools, `BatchFloor.serial_s`) must also fit in the windows after its first
  submission (`ActiveClock`); its tools may run between windows. Across the run, the windows
  together hold every trained group's work (`window_work`), which bounds the mean makespan.
- **Speculative decoding** (Seer): a decoder that verifies drafts yields several tokens an
  iteration, so plain decoding's floor would not hold. A system with one is bounded by its own
  decoder: per-token coefficients that no verification undercuts at any batch size or draft
  length (`SpeculativeCostModel.floor_coeffs`), and a fullest iteration that counts the drafts
  (`fullest_batch`). The bound is per system: one without speculation keeps plain decoding's.
- **Chunks and migrations** (Seer's divided rollout, Heddle's moves during tool calls) only add
  transfers and prefills.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from libra.core.specs import HardwareSpec, ModelSpec
from libra.core.trajectory import Trajectory
from libra.costmodel.efficiency import RolloutEfficiency
from libra.costmodel.speculative import SpecDecoding, rollout_cost


@dataclass(frozen=True, slots=True)
class TurnArrays:
    """A batch's turns, flattened: what the floors need of each, and whose trajectory it is."""

    out: np.ndarray  # decode tokens of the turn (at least 1, as the engine runs it)
    ctx: np.ndarray  # the context the turn starts from
    tool_s: np.ndarray  # the tool latency after the turn (0 for the last)
    prefill: np.ndarray  # tokens the turn must prefill at least (prompt, then the tool return)
    traj: np.ndarray  # index of the turn's trajectory in the batch


def turn_arrays(trajs: Sequence[Trajectory], default_tool_s: float) -> TurnArrays:
    out, ctx, tool, prefill, owner = [], [], [], [], []
    for i, t in enumerate(trajs):
        c, new = t.prompt_tokens, t.prompt_tokens
        for turn in t.turns:
            out.append(max(1, turn.output_tokens))
            ctx.append(c)
            prefill.append(max(1, new))
            owner.append(i)
            if turn.has_tool:
                tool.append(default_tool_s if turn.tool_latency_s is None else turn.tool_latency_s)
            else:
                tool.append(0.0)
            new = turn.tool_return_tokens
            c += turn.output_tokens + new
    return TurnArrays(np.asarray(out, float), np.asarray(ctx, float), np.asarray(tool, float),
                      np.asarray(prefill, float), np.asarray(owner, np.int64))  # fmt: skip


@dataclass(frozen=True, slots=True)
class BatchFloor:
    """One batch's floors, per GRPO group in the order groups first appear in the batch."""

    index: dict[str, int]  # prompt id -> its position in the arrays
    latency_s: np.ndarray  # the group's slowest member alone on its fastest engine, tools included
    work_gpu_s: np.ndarray  # GPU-seconds of the group's tokens at the best per-GPU rate
    serial_s: np.ndarray | None = None  # latency_s without the tools: time on an engine (None: 0)


class Limit:
    """The floors of one cluster and model: which engines it can run, and their best times."""

    def __init__(self, hw: HardwareSpec, model: ModelSpec, eff: RolloutEfficiency | None, rollout,
                 default_tool_s: float, speculative: SpecDecoding | None = None):  # fmt: skip
        """`rollout`: the scenario's rollout section (memory settings and the engine's limits);
        `speculative`: the speculative decoder of the system bounded, if it has one."""
        self.default_tool_s = default_tool_s
        self.key = speculative  # what tells limits of one scenario apart
        costs = [rollout_cost(hw, model, tp, eff, rollout, speculative) for tp in _tps(hw, model)]
        costs = [c for c in costs if c.fits()]
        if not costs:
            raise ValueError(f"no rollout engine of {model.name} fits on {hw.name}")
        # Serial floor per TP: a turn of `out` tokens from context c costs out*A + B*((out-1)c + out(out-1)/2).
        self.serial = [c.floor_coeffs() for c in costs]
        # GPU-seconds per token at the fullest iteration (attention at context 1), and per
        # context token of a decode's attention; each at its own best TP (a bound, if looser).
        self.per_token = min(
            c.tp * c.step_time(c.fullest_batch(), 0.0, 0, 0.0) / c.fullest_batch() for c in costs
        )
        self.per_ctx = min(c.tp * c.floor_coeffs()[1] for c in costs)

    def batch(self, trajs: Sequence[Trajectory]) -> BatchFloor:
        a = turn_arrays(trajs, self.default_tool_s)
        n = len(trajs)
        decode_ctx = (a.out - 1) * a.ctx + a.out * (a.out - 1) / 2
        serial = np.full(n, np.inf)
        for coef, slope in self.serial:
            serial = np.minimum(serial, np.bincount(a.traj, coef * a.out + slope * decode_ctx, n))
        latency = serial + np.bincount(a.traj, a.tool_s, n)
        work = np.bincount(a.traj, self.per_token * (a.out + a.prefill) + self.per_ctx * decode_ctx, n)
        return _by_group(trajs, latency, work, serial)


def _tps(hw: HardwareSpec, model: ModelSpec) -> list[int]:
    tps, t = [], 1
    while t <= hw.gpus_per_node:
        if model.heads % t == 0:
            tps.append(t)
        t *= 2
    return tps


def _by_group(
    trajs: Sequence[Trajectory], latency: np.ndarray, work: np.ndarray, serial: np.ndarray
) -> BatchFloor:
    index: dict[str, int] = {}
    owner = np.asarray([index.setdefault(t.prompt_id, len(index)) for t in trajs], np.int64)
    lat, ser = np.zeros(len(index)), np.zeros(len(index))
    np.maximum.at(lat, owner, latency)
    np.maximum.at(ser, owner, serial)
    return BatchFloor(index, lat, np.bincount(owner, work, len(index)), ser)


@dataclass(frozen=True, slots=True)
class StepTaken:
    """What one trained step was, as the bound needs it: when its batch started and which groups
    (batch, prompt id) it trained."""

    step: int
    start: float
    groups: Sequence[tuple[int, str]]


def makespan_bounds(steps: Sequence[StepTaken], floors: dict[int, BatchFloor], gpus: int, completion: bool,
                    submitted: dict[tuple[int, str], float] | None = None,
                    windows: Sequence[tuple[float, float]] | None = None,
                    batch_starts: dict[int, float] | None = None) -> list[float]:  # fmt: skip
    """Each step's lower bound on its rollout makespan, seconds (see the module's docstring).

    `submitted`: when each group's first trajectory started, for a system that does not start its
    groups batch by batch (partial rollouts); by default every group starts with its batch.
    `windows`: the only intervals in which the engines work (a colocated system's rollout
    phases), if they do not work all the time. `batch_starts`: when every batch the run started
    began, steps' own or not: under completion order a step may train groups of a batch that no
    step of the run is named after (a batch started beyond the run's last step, whose early groups
    fill its last steps), and the C_s-th earliest finish must count those groups too, or it is
    the C_s-th of fewer groups, which can be later than any real finish (seen once the strict
    gate's lead ramped up, `planner.staleness`)."""
    starts = {**(batch_starts or {}), **{s.step: s.start for s in steps}}
    out, taken = [], 0
    finish = None
    if completion:
        if submitted is None:
            finish = _earliest_finishes(floors, starts)
        else:
            finish = _submitted_finishes(floors, submitted, ActiveClock(windows) if windows else None)
    for s in steps:
        taken += len(s.groups)
        if not completion:
            own = list(s.groups)
        elif submitted is None:
            own = [(b, g) for b, g in s.groups if b >= s.step]
        else:
            own = [(b, g) for b, g in s.groups if submitted[(b, g)] >= s.start]
        work = sum(floors[b].work_gpu_s[floors[b].index[g]] for b, g in own) / gpus
        if finish is None:
            f = floors[s.step]
            latency = float(f.latency_s.max()) if len(f.index) else 0.0
        else:
            latency = max(0.0, float(finish[min(taken, len(finish)) - 1]) - s.start)
        out.append(max(latency, work))
    return out


def _earliest_finishes(floors: dict[int, BatchFloor], starts: dict[int, float]) -> np.ndarray:
    """Every started batch's groups' earliest possible finish times, sorted."""
    times = [starts[b] + f.latency_s for b, f in floors.items() if b in starts]
    return np.sort(np.concatenate(times)) if times else np.zeros(0)


class ActiveClock:
    """Time counted only inside the windows where engines work (sorted, disjoint intervals)."""

    def __init__(self, windows: Sequence[tuple[float, float]]):
        self.windows = sorted(windows)
        self.before = np.cumsum([0.0] + [b - a for a, b in self.windows])  # active time before each

    def active(self, t: float) -> float:
        i = bisect.bisect_right([a for a, _ in self.windows], t) - 1
        if i < 0:
            return 0.0
        a, b = self.windows[i]
        return float(self.before[i] + min(t, b) - a)

    def when(self, active: float) -> float:
        """The first time the active clock reads `active` (after the last window, as if the
        engines then worked all the time: never later than the true time)."""
        i = int(np.searchsorted(self.before, active, side="left")) - 1
        if i >= len(self.windows) or i < 0:
            last = self.windows[-1][1] if self.windows else 0.0
            return last + active - float(self.before[-1]) if i >= 0 else 0.0
        return self.windows[i][0] + active - float(self.before[i])


def _submitted_finishes(floors: dict[int, BatchFloor], submitted: dict[tuple[int, str], float],
                        clock: ActiveClock | None) -> np.ndarray:  # fmt: skip
    """Every started group's earliest possible finish time, sorted: its start plus its floor, and,
    when engines work only in windows, the time the windows give it for its engine time."""
    times = []
    for (b, g), t in submitted.items():
        k = floors[b].index[g]
        finish = t + float(floors[b].latency_s[k])
        serial = floors[b].serial_s
        if clock is not None and serial is not None:
            finish = max(finish, clock.when(clock.active(t) + float(serial[k])))
        times.append(finish)
    return np.sort(np.asarray(times, dtype=np.float64))


def window_work(groups: Sequence[tuple[int, str]], floors: dict[int, BatchFloor], gpus: int) -> float:
    """The least total rollout time of these groups' work on `gpus` GPUs: a bound on the sum of the
    makespans of a system whose engines work only inside its steps' rollout windows (a colocated
    one), whichever window did the work (partial rollouts carry it from step to step)."""
    return sum(floors[b].work_gpu_s[floors[b].index[g]] for b, g in groups) / gpus
