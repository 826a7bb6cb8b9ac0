"""One step's record: what steps.json, the timeline and the metrics say about it."""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.planner.staleness import Finished
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.control import PublishResult, TrainResult
from libra.runtime.train.report import StepRecord, Timeline
from libra.runtime.train.rollout import DropLog, Group
from libra.runtime.train.samples import figures


@dataclass(slots=True)
class StepClock:
    """Wall-clock marks of a step's phases, in order."""

    start: float
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        import time

        self.marks[phase] = time.time()

    def seconds(self, phase: str) -> float:
        names = list(self.marks)
        i = names.index(phase)
        before = self.marks[names[i - 1]] if i else self.start
        return self.marks[phase] - before

    @property
    def end(self) -> float:
        return max(self.marks.values(), default=self.start)


def step_record(step: int, groups: list[Finished[Group]], samples: list[TrainSample], train: TrainResult, pub: PublishResult, clock: StepClock, drops: DropLog) -> StepRecord:  # fmt: skip
    fig = figures(groups, step, samples)
    step_s = clock.end - clock.start
    tokens = train.total("tokens")
    return StepRecord(
        step=step,
        reward=fig.reward,
        success=fig.success,
        weight_version=train.version,
        trained=fig.trajectories,
        dropped={
            "trajectories": drops.trajectories,
            "reasons": dict(drops.reasons),
            "examples": drops.details,
        },
        step_time_s=step_s,
        rollout_wait_s=clock.seconds("rollout"),
        train_s=clock.seconds("train"),
        publish_s=clock.seconds("publish"),
        tokens={"model": fig.model_tokens, "total": fig.total_tokens},
        tokens_per_s=fig.total_tokens / max(step_s, 1e-9),
        staleness={
            "groups": fig.staleness,
            "mean": sum(fig.staleness) / len(fig.staleness),
            "max": max(fig.staleness),
        },
        sampled_versions={"min": fig.version_min, "max": fig.version_max},
        routing={"turns_by_bucket": fig.buckets, "migrations": fig.migrations, "failovers": fig.failovers},
        tools={"calls": fig.tool_calls, "failures": fig.tool_failures},
        loss={
            "policy": train.total("loss"),
            "clip_fraction": train.total("clipped") / max(tokens, 1),
            "kl": train.total("kl_sum") / max(tokens, 1),
            "logprob_diff_max": max(float(r["logprob_diff_max"]) for r in train.replicas),
            "grad_norm": float(train.replicas[0]["grad_norm"]),
        },
        replicas_equal=train.equal,
        planner=None,
        memory={
            f"rank{r.get('rank', i)}": r["memory"] for i, r in enumerate(train.replicas) if r.get("memory")
        },
    )


def trace_step(tl: Timeline, step: int, groups: list[Finished[Group]], clock: StepClock) -> None:
    """The driver's phases, the batches' spans and every turn on the engine that ran it."""
    t = clock.start
    for phase, end in clock.marks.items():
        tl.span("driver", f"{phase} (step {step})", t, end, step=step)
        t = end
    for f in groups:
        for traj in f.group.trajs:
            for k, turn in enumerate(traj.turns):
                tl.span(f"engine {turn.instance or 'in-process'}", f"{traj.id} turn {k}", turn.started, turn.ended,
                        tokens=len(turn.token_ids), bucket=turn.bucket, version=turn.weight_versions[:1])  # fmt: skip
            if traj.turns:
                tl.span(f"rollout batch {traj.batch % 4}", f"batch {traj.batch} group {traj.group}", traj.turns[0].started, traj.turns[-1].ended)  # fmt: skip
