"""C-MLFQ as published (`cmlfq-paper`): the exact-path causal prefix tree and the mean/P90 rule.

Every trajectory starts in the smallest bucket. At each tool return the router looks up the
deepest node of the causal tree on the trajectory's exact path of tool states, adds the node's mean
and P90 remaining length to the current context, and maps both to buckets. It moves the trajectory
only when the two agree and differ from where it is: disagreement means the tree is not sure, and
a migration made on a guess moves tokens for nothing. There is no step-by-step demotion.

The robust variant (`cmlfq`, in `robust.py`) keeps this rule and this tree and changes what feeds
them; both share `TreeRouterBase`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from libra.rollout.base import Bucket, FinishedTrajectory, RouteRequest, bucket_for_length
from libra.rollout.routers import BaseRouter, BucketParams
from libra.rollout.tree import CausalTree, CursorTable, Match, TrajectoryLog, best_match


def mean_p90_rule(buckets: Sequence[Bucket], current: int, mean_final: float, p90_final: float) -> int:
    """The bucket to be in: move only when mean and P90 map to the same, different, bucket."""
    by_mean = bucket_for_length(buckets, mean_final)
    by_p90 = bucket_for_length(buckets, p90_final)
    return by_mean if by_mean == by_p90 and by_mean != current else current


class TreeParams(BucketParams):
    window: int = Field(default=200, gt=0, description="Samples kept per node (mean and P90 window).")
    max_depth: int = Field(default=64, gt=0, description="Deepest path the tree records.")
    per_prompt: bool = Field(default=True, description="Keep a tree per prompt besides the global one.")
    min_samples: int = Field(default=1, gt=0, description="A node needs this many samples to be used.")
    rebuild_every: int = Field(default=5, ge=0, description="K: rebuild every K steps (0: never).")
    history: int = Field(default=4096, gt=0, description="N: trajectories the rebuild uses.")
    quantile: float = Field(default=0.9, gt=0.5, lt=1.0, description="The upper statistic (P90).")


class TreeRouterBase(BaseRouter):
    """A router that learns a causal tree from finished trajectories and rebuilds it every K steps."""

    Params = TreeParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        p = self.params
        self.tree = CausalTree(p.window, p.max_depth, p.per_prompt)
        self.log = TrajectoryLog(p.history)
        self.cursors = CursorTable()
        self.steps_seen = 0
        self.uses_tree = True  # a subclass that ignores the tree skips its upkeep

    def walks(self, req: RouteRequest):
        """The trajectory's walks down the global and its prompt's tree, extended incrementally."""
        return self.cursors.walks(self.tree, req.traj_id, req.prompt_id, req.path)

    def match(self, req: RouteRequest, min_samples: int) -> Match | None:
        return best_match(*self.walks(req), min_samples)

    def on_finish(self, traj: FinishedTrajectory) -> None:
        self.cursors.forget(traj.traj_id)
        if self.uses_tree:
            self.tree.insert_finished(traj)
            self.log.add(traj)

    def on_step_end(self, step: int) -> None:
        self.steps_seen += 1
        k = self.params.rebuild_every
        if k and self.steps_seen % k == 0:
            self.rebuild()

    def rebuild(self) -> None:
        """Rebuild from the last N trajectories: drops paths and prompts the policy no longer takes."""
        self.log.rebuild(self.tree)


class PaperCMLFQRouter(TreeRouterBase):
    """C-MLFQ exactly as published: exact-path lookup, mean/P90 agreement, start in bucket 0."""

    name = "cmlfq-paper"

    def target(self, req: RouteRequest, floor: int) -> tuple[int, float | None]:
        if req.level is None:
            return 0, None
        match = self.match(req, self.params.min_samples)
        if match is None:  # cold start: nothing learned yet, so no reason to move
            return req.level, None
        mean = req.context_tokens + match.node.mean
        upper = req.context_tokens + match.node.quantile(self.params.quantile)
        return mean_p90_rule(self.buckets, max(req.level, floor), mean, upper), mean
