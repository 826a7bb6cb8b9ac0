"""From finished groups to training samples and the step's figures.

Advantages are computed per group in the driver (it has every reward of the group; replicas do
not), then each trajectory is assembled into one sequence (`trajectory.assemble`) and becomes a
`TrainSample`: loss on the model's own choices only (the tokens the grammar forced carry no
signal, so they stay out of the loss's denominator and of its statistics), with the sampling
parameters the trainer must score under. The same function serves the live driver and the
in-process loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.planner.staleness import Finished
from libra.runtime.train.batch import TrainSample
from libra.runtime.train.chat import Sampling
from libra.runtime.train.grpo import group_advantages
from libra.runtime.train.rollout import Group
from libra.runtime.train.trajectory import Sequence, assemble


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
    staleness: list[int]  # per group: the step minus the weight version its batch started at
    token_staleness: dict[int, int]  # model tokens by age: the step minus the oldest weights behind each
    trained_tokens: int  # model tokens the loss trains (not forced by the grammar)
    version_min: int
    version_max: int
    migrations: int
    failovers: int
    buckets: dict[str, int]  # turns served per bucket


def to_samples(
    taken: list[Finished[Group]],
    normalize_std: bool = True,
    negative_weight: float = 1.0,
    sampling: Sampling = Sampling(),
) -> list[TrainSample]:
    out = []
    for f in taken:
        advs = group_advantages([t.reward for t in f.group.trajs], normalize_std, negative_weight)
        for t, a in zip(f.group.trajs, advs, strict=True):
            out.append(sample_of(assemble(t.turns), a, sampling))
    return out


def sample_of(seq: Sequence, advantage: float, sampling: Sampling) -> TrainSample:
    """What the trainer gets of one trajectory: the loss on the tokens the model sampled and the
    grammar did not force; each token's version only where one version made it (its weights and
    its KV cache alike), so a mixed token never counts as the trainer's own."""
    mask = [int(m and not f) for m, f in zip(seq.mask, seq.forced, strict=True)]
    versions = [
        v if m and v == kv else -1 for m, v, kv in zip(mask, seq.versions, seq.kv_versions, strict=True)
    ]
    return TrainSample(ids=seq.ids, mask=mask, logprobs=seq.logprobs, advantage=advantage, versions=versions,
                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)  # fmt: skip


def figures(taken: list[Finished[Group]], step: int, samples: list[TrainSample]) -> RolloutFigures:
    trajs = [t for f in taken for t in f.group.trajs]
    versions = [v for t in trajs for turn in t.turns for v in turn.weight_versions]
    ages: dict[int, int] = {}
    for t in trajs:
        for turn in t.turns:
            for v, kv in zip(turn.weight_versions, turn.kv_versions or turn.weight_versions, strict=True):
                ages[step - min(v, kv)] = ages.get(step - min(v, kv), 0) + 1
    buckets: dict[str, int] = {}
    for t in trajs:
        for turn in t.turns:
            if turn.bucket:
                buckets[turn.bucket] = buckets.get(turn.bucket, 0) + 1
    return RolloutFigures(
        reward=sum(t.reward for t in trajs) / len(trajs),
        success=sum(t.success for t in trajs) / len(trajs),
        trajectories=len(trajs),
        model_tokens=sum(len(turn.token_ids) for t in trajs for turn in t.turns),
        total_tokens=sum(len(s.ids) for s in samples),
        tool_calls=sum(len(t.tools) for t in trajs),
        tool_failures=sum(r.status != "success" for t in trajs for r in t.tools),
        staleness=[step - f.version for f in taken],
        token_staleness=dict(sorted(ages.items())),
        trained_tokens=sum(s.n_model_tokens for s in samples),
        version_min=min(versions, default=0),
        version_max=max(versions, default=0),
        migrations=sum(t.migrations for t in trajs),
        failovers=sum(t.failovers for t in trajs),
        buckets=buckets,
    )
