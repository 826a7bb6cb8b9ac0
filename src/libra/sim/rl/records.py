"""The RL pipeline's typed records: a batch in flight, a trained step, and one system's run.

Why typed: the per-step history is read by the pipeline, the planner's controller (through a
`StepReport`), the report's plots and the run's summary; a slotted record keeps one spelling of
each field and its meaning in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.core.trajectory import Trajectory
from libra.sim.tracing import Tracer


@dataclass(slots=True)
class InFlight:
    """A batch admitted to rollout whose training batch is not full yet."""

    step: int
    t0: float | None = None  # when it started rolling out (after any weight sync or switch)
    groups: int | None = None  # its GRPO groups: a training step takes as many


@dataclass(slots=True)
class StepRecord:
    """One trained step: its rollout, its training, and the layout it ran on."""

    step: int
    rollout_start: float
    rollout_end: float  # when the step's training groups were all in
    generated_tokens: int
    lengths: list[int]
    trajs: list[Trajectory]
    staleness: list[int]  # per trained group: training steps between its weights and this step
    # trained tokens per version lag: training steps between the weights that wrote them and this step
    token_lag: dict[int, int] = field(default_factory=dict)
    tail_s: float = 0.0  # from the moment 90% of its trajectories had finished to the last one
    train_start: float = 0.0
    train_time: float = 0.0
    train_end: float = 0.0
    train_gpus: int = 0
    rollout_gpus: int = 0
    layout: list[tuple[int, int, int]] = field(default_factory=list)  # per bucket: (TP, instances, max ctx)

    @property
    def rollout_makespan(self) -> float:
        return self.rollout_end - self.rollout_start


@dataclass(slots=True)
class SimRecord:
    """One system's run as the report reads it: its per-step history and its traced step."""

    name: str
    history: list[StepRecord]
    tracer: Tracer
