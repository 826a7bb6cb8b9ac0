"""From finished groups to training samples and the step's figures.

Advantages are computed per group in the driver (it has every reward of the group; replicas do
not), then each trajectory is assembled into one sequence (`trajectory.assemble`) and becomes a
`TrainSample`. The same function serves the live driver and the in-process loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.planner.staleness import Finished
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.grpo import group_advantages
from libra.runtime.train.rollout import Group
from libra.runtime.train.trajectory import assemble


@dataclass(slots=True)
class RolloutFigures:
    """What a step's trained groups were like (steps.json's rollout fields)."""

    reward: float
    success: float
    trajectories: int
    model_tokens: int
    total_tokens: int
    tool_calls: int
    tool_failures: int
    staleness: list[int]
    version_min: int
    version_max: int
    migrations: int
    failovers: int
    buckets: dict[str, int]  # turns served per bucket


def to_samples(
    taken: list[Finished[Group]], normalize_std: bool = True, negative_weight: float = 1.0
) -> list[TrainSample]:
    out = []
    for f in taken:
        advs = group_advantages([t.reward for t in f.group.trajs], normalize_std, negative_weight)
        for t, a in zip(f.group.trajs, advs, strict=True):
            seq = assemble(t.turns)
            out.append(TrainSample(ids=seq.ids, mask=seq.mask, logprobs=seq.logprobs, advantage=a))
    return out


def figures(taken: list[Finished[Group]], step: int, samples: list[TrainSample]) -> RolloutFigures:
    trajs = [t for f in taken for t in f.group.trajs]
    versions = [v for t in trajs for turn in t.turns for v in turn.weight_versions]
    buckets: dict[str, int] = {}
    for t in trajs:
        for turn in t.turns:
            if turn.bucket:
                buckets[turn.bucket] = buckets.get(turn.bucket, 0) + 1
    return RolloutFigures(
        reward=sum(t.reward for t in trajs) / len(trajs),
        success=sum(t.success for t in trajs) / len(trajs),
        trajectories=len(trajs),
        model_tokens=sum(s.n_model_tokens for s in samples),
        total_tokens=sum(len(s.ids) for s in samples),
        tool_calls=sum(len(t.tools) for t in trajs),
        tool_failures=sum(r.status != "success" for t in trajs for r in t.tools),
        staleness=[step - f.version for f in taken],
        version_min=min(versions, default=0),
        version_max=max(versions, default=0),
        migrations=sum(t.migrations for t in trajs),
        failovers=sum(t.failovers for t in trajs),
        buckets=buckets,
    )
