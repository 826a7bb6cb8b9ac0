"""Offline evaluation of a router: replay finished trajectories and score its bucket choices.

This is the fast, pure check of routing *quality*, separate from the simulator's throughput: no
engines, no clock, a fixed list of idle instances (one per bucket unless given). Trajectories are
replayed step by step in step order. Inside a step, `route` is called at the start of every turn of
every trajectory with exactly what a live router would know then (the path of tool states so far,
the context, the current bucket and instance), in lockstep: turn k of every trajectory before turn
k+1 of any, so a router that watches GRPO siblings never sees one further along than it would be.
When the step is done, `on_finish` is called for each of its trajectories and then `on_step_end`.
So a router only ever learns from earlier steps, as in a synchronous RL loop.

`order="interleaved"` instead advances all trajectories of a step together on a token clock (a
turn starts when the trajectory's context reaches that point, all growing at the same rate) and
calls `on_finish` the moment each one ends. That is closer to the live system, where short GRPO
siblings finish while long ones are still running.

Metrics (defined the same way as the simulator's `systems[NAME].routing`):
- accuracy: of the decisions made at tool returns (turn >= 1), the fraction whose resulting bucket
  is the bucket of the trajectory's true final length;
- migrations: decisions that moved a trajectory to another instance;
- migrated_token_ratio: the context tokens those migrations moved (or re-prefilled), divided by all
  rollout tokens; offline, each trajectory's tokens are counted once (prompt, outputs and tool
  returns), a proxy for the simulator's prefilled + generated tokens.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from libra.core.trajectory import Trajectory
from libra.rollout.base import (
    Bucket,
    FinishedTrajectory,
    InstanceView,
    RouteDecision,
    Router,
    RouteRequest,
    bucket_for_length,
)
from libra.rollout.tool_state import DEFAULT_THRESHOLDS, SizeThresholds, trajectory_path


@dataclass(slots=True)
class EvalResult:
    router: str
    trajectories: int = 0
    decisions: int = 0
    correct: int = 0
    migrations: int = 0
    migrated_tokens: int = 0
    total_tokens: int = 0
    # confusion[true_bucket][chosen_bucket] over tool-return decisions
    confusion: list[list[int]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.decisions if self.decisions else 0.0

    @property
    def migrated_token_ratio(self) -> float:
        return self.migrated_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accuracy"] = round(self.accuracy, 4)
        d["migrated_token_ratio"] = round(self.migrated_token_ratio, 4)
        return d


def default_instances(buckets: Sequence[Bucket], per_bucket: int = 1) -> list[InstanceView]:
    """Idle instances, `per_bucket` of each bucket, on node 0 (migrations stay inside a node)."""
    return [
        InstanceView(id=f"{b.name}-{k}", bucket=i, tp=b.tp, outstanding=0, cap=1 << 30)
        for i, b in enumerate(buckets)
        for k in range(per_bucket)
    ]


@dataclass(slots=True)
class _Replay:
    """One trajectory being replayed: where it is and what the router has said so far."""

    traj: Trajectory
    path: tuple
    contexts: tuple[int, ...]
    generated: tuple[int, ...]
    final_bucket: int
    turn: int = 0
    decision: RouteDecision | None = None


def _prepare(traj: Trajectory, buckets: Sequence[Bucket], thresholds: SizeThresholds) -> _Replay:
    contexts, generated, ctx, gen = [], [], traj.prompt_tokens, 0
    for t in traj.turns:
        contexts.append(ctx)
        generated.append(gen)
        ctx += t.output_tokens + t.tool_return_tokens
        gen += t.output_tokens
    return _Replay(
        traj,
        trajectory_path(traj, thresholds),
        tuple(contexts),
        tuple(generated),
        bucket_for_length(buckets, traj.total_tokens),
    )


class Evaluator:
    """Replays trajectories through one router; see the module docstring."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
        instances: Sequence[InstanceView] | None = None,
        order: Literal["step", "interleaved"] = "step",
    ):
        self.buckets = list(buckets)
        self.thresholds = thresholds
        self.instances = list(instances) if instances is not None else default_instances(self.buckets)
        self.order = order

    def run(self, router: Router, trajectories: Iterable[Trajectory]) -> EvalResult:
        n = len(self.buckets)
        res = EvalResult(router=getattr(router, "name", type(router).__name__))
        res.confusion = [[0] * n for _ in range(n)]
        by_step: dict[int, list[Trajectory]] = defaultdict(list)
        for t in trajectories:
            by_step[t.step].append(t)
        for step in sorted(by_step):
            reps = [_prepare(t, self.buckets, self.thresholds) for t in by_step[step]]
            if self.order == "interleaved":
                self._run_interleaved(router, reps, res)
            else:
                self._run_lockstep(router, reps, res)
            router.on_step_end(step)
        return res

    def _advance(self, router: Router, r: _Replay, res: EvalResult) -> bool:
        """Route turn `r.turn`; return whether the trajectory has more turns."""
        k, traj = r.turn, r.traj
        prev = r.decision
        req = RouteRequest(
            traj_id=traj.id,
            prompt_id=traj.prompt_id,
            step=traj.step,
            turn=k,
            prompt_tokens=traj.prompt_tokens,
            context_tokens=r.contexts[k],
            generated_tokens=r.generated[k],
            path=r.path[:k],
            current_bucket=None if prev is None else prev.bucket,
            current_instance=None if prev is None else prev.instance,
            true_final_tokens=traj.total_tokens,
            target_bucket=None if prev is None else prev.target,
        )
        d = router.route(req, self.instances)
        self._score(r, d, k, res)
        r.decision = d
        r.turn += 1
        if r.turn < len(traj.turns):
            return True
        res.trajectories += 1
        res.total_tokens += traj.total_tokens
        return False

    def _score(self, r: _Replay, d: RouteDecision, k: int, res: EvalResult) -> None:
        if d.migrate:
            res.migrations += 1
            res.migrated_tokens += r.contexts[k]
        if k >= 1:
            res.decisions += 1
            res.correct += d.chosen == r.final_bucket
            chosen = min(max(d.chosen, 0), len(self.buckets) - 1)
            res.confusion[r.final_bucket][chosen] += 1

    def _run_lockstep(self, router: Router, reps: list[_Replay], res: EvalResult) -> None:
        # Turn k of every trajectory before turn k+1 of any: a router that looks at siblings sees
        # them as far along as they would be, never already finished.
        active = list(reps)
        while active:
            active = [r for r in active if self._advance(router, r, res)]
        for r in reps:
            router.on_finish(_finished(r))

    def _run_interleaved(self, router: Router, reps: list[_Replay], res: EvalResult) -> None:
        # Events on a token clock: (time, seq, kind, replay). kind 0 = turn start, 1 = finish.
        heap = [(r.contexts[0], i, 0, i) for i, r in enumerate(reps)]
        heapq.heapify(heap)
        seq = len(heap)
        while heap:
            _, _, kind, i = heapq.heappop(heap)
            r = reps[i]
            if kind == 1:
                router.on_finish(_finished(r))
                continue
            more = self._advance(router, r, res)
            when = r.contexts[r.turn] if more else r.traj.total_tokens
            heapq.heappush(heap, (when, seq, 0 if more else 1, i))
            seq += 1


def _finished(r: _Replay) -> FinishedTrajectory:
    t = r.traj
    return FinishedTrajectory(
        traj_id=t.id,
        prompt_id=t.prompt_id,
        step=t.step,
        path=r.path,
        turn_contexts=r.contexts,
        final_tokens=t.total_tokens,
    )


def evaluate(
    router: Router,
    trajectories: Iterable[Trajectory],
    buckets: Sequence[Bucket],
    thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
    order: Literal["step", "interleaved"] = "step",
) -> EvalResult:
    """Score `router` on `trajectories` with one idle instance per bucket."""
    return Evaluator(buckets, thresholds, order=order).run(router, trajectories)
