"""The routing and queueing policies of the peer systems, and the dispatch of their baseline.

Pure policies like every router (`rollout.base`): they see a request and the instances' load and
return a decision, now with a `priority` for the engine's waiting queue (lower first). Registered
in `rollout.registry`, so each is also a `router:NAME` and `planned:NAME` system, and Libra's
planner can run any of them on its own layouts.

- `group-round-robin`: veRL's dispatch in its synchronous rollout, the baseline of Seer: each GRPO
  group goes whole to the next instance in turn (all its samples, all their turns), whatever the
  load. Groups' lengths differ, so instances finish at different times.
- `seer`: Seer's context-aware scheduling (arXiv 2511.14617, section 4.2). Each group's first
  request is a probe, run first (shortest so far first among probes); once a member of the group
  has finished, the group's length is estimated from its finished members (their longest) and the
  group's requests go longest estimated first. Requests of groups with no estimate yet wait behind
  those (FCFS). Placement: the least loaded instance per GPU; with divided rollout
  (`Mechanisms.chunk_tokens`) every chunk is placed again, so requests move to instances as they
  free up (Seer keeps KV in a global pool; here the move is a KV transfer at its cost).
- `heddle`: Heddle's trajectory-level scheduling (arXiv 2603.28101, sections 4-6). A progressive
  runtime prediction: a trajectory's final length is predicted, at every turn, as the mean of
  the final lengths seen so far that exceed its current context, from its own prompt's history
  (earlier steps and finished siblings) when it has any, else from all recent trajectories; one
  longer than everything seen is predicted to double. Its priority is the predicted remaining
  length, longest first, so long trajectories queue least; its bucket (a length range of the
  presorted DP's layout, each with its own TP) is the one its predicted final length falls in,
  so long trajectories run on large TP. With `Mechanisms.migrate_in_tool` the next turn is placed
  while the tool runs and the KV moves then.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, replace

from pydantic import Field

from libra.rollout.base import FinishedTrajectory, RouteDecision, RouteRequest, bucket_for_length
from libra.rollout.placement import least_loaded
from libra.rollout.routers import BaseRouter, BucketParams, LeastLoadedParams, NoParams, _current_usable

# Groups (and prompts) older than this many steps are forgotten: no step revisits them.
KEEP_STEPS = 8
MAX_PROMPTS = 8192  # prompts whose history Heddle's predictor keeps, the least recent out first
PROBE = -1e15  # probes go before every estimated request (whose priority is minus a length)


class GroupRoundRobinRouter(BaseRouter):
    """veRL's synchronous dispatch: whole GRPO groups to instances in turn, blind to load."""

    name = "group-round-robin"
    Params = NoParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        self._next = self.seed
        self._home: dict[tuple[int, str], int] = {}

    def pick(self, req, instances, floor):
        keep = _current_usable(req, instances, floor)
        if keep is not None:
            return keep, None, None
        if not instances:
            return least_loaded(instances, floor), None, None  # raises NoInstanceError
        key = (req.step, req.prompt_id)
        home = self._home.get(key)
        if home is None:
            home = self._home[key] = self._next
            self._next += 1
        inst = instances[home % len(instances)]
        if not inst.healthy or inst.bucket < floor:
            inst = least_loaded(instances, floor)
        return inst, None, None

    def on_step_end(self, step: int) -> None:
        self._home = {k: v for k, v in self._home.items() if k[0] > step - KEEP_STEPS}


class SeerParams(LeastLoadedParams):
    context_aware: bool = Field(True, description="Seer: probe each group, then longest estimated first.")


@dataclass(slots=True)
class _Group:
    probe: str | None = None
    estimate: float | None = None


class SeerRouter(BaseRouter):
    """Seer's context-aware scheduling and load-balanced placement (see the module docstring)."""

    name = "seer"
    Params = SeerParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        self._groups: dict[tuple[int, str], _Group] = {}

    def pick(self, req, instances, floor):
        best = least_loaded(instances, floor, per_gpu=True)
        here = _current_usable(req, instances, floor)
        # Moving costs a KV transfer: stay unless the least loaded has a request per GPU less.
        if here is not None and not here.saturated:
            if here.outstanding / here.tp <= best.outstanding / best.tp + 1:
                return here, None, None
        return best, None, None

    def route(self, req: RouteRequest, instances) -> RouteDecision:
        dec = super().route(req, instances)
        if not self.params.context_aware:
            return dec
        return replace(dec, priority=self.priority(req))

    def priority(self, req: RouteRequest) -> float:
        g = self._groups.setdefault((req.step, req.prompt_id), _Group())
        if g.estimate is not None:
            return -g.estimate
        if g.probe is None:
            g.probe = req.traj_id
        if g.probe == req.traj_id:
            return PROBE + req.generated_tokens
        return 0.0

    def on_finish(self, traj: FinishedTrajectory) -> None:
        g = self._groups.setdefault((traj.step, traj.prompt_id), _Group())
        g.estimate = max(g.estimate or 0.0, float(traj.final_tokens))

    def on_step_end(self, step: int) -> None:
        self._groups = {k: v for k, v in self._groups.items() if k[0] > step - KEEP_STEPS}


class HeddleParams(BucketParams):
    priority: bool = Field(True, description="Heddle: longest predicted remaining first.")
    window: int = Field(2048, ge=16, le=1 << 16, description="Recent final lengths the prediction draws on.")
    per_prompt: int = Field(64, ge=1, le=4096, description="Final lengths kept per prompt.")
    oracle: bool = Field(
        False,
        description="Heddle's ceiling: predict the true final length (the simulator's `true_final_tokens`).",
    )


class HeddleRouter(BaseRouter):
    """Heddle's progressive runtime prediction, priority and placement (see the module docstring)."""

    name = "heddle"
    Params = HeddleParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        self._recent: deque[int] = deque(maxlen=self.params.window)
        self._sorted: list[int] = []  # `_recent`, sorted (kept in step with it)
        self._by_prompt: dict[str, list[int]] = {}

    def predict(self, req: RouteRequest) -> float:
        """The predicted final length of a trajectory now at `req.context_tokens` (progressive:
        conditioned on the context it has already reached)."""
        ctx = req.context_tokens
        if self.params.oracle and req.true_final_tokens is not None:
            return float(req.true_final_tokens)
        own = [x for x in self._by_prompt.get(req.prompt_id, ()) if x > ctx]
        if own:
            return sum(own) / len(own)
        i = bisect.bisect_right(self._sorted, ctx)
        rest = self._sorted[i:]
        if rest:
            return sum(rest) / len(rest)
        return 2.0 * ctx if self._sorted else float(ctx)

    def target(self, req, floor):
        pred = self.predict(req)
        return bucket_for_length(self.buckets, pred), pred

    def route(self, req: RouteRequest, instances) -> RouteDecision:
        dec = super().route(req, instances)
        if not self.params.priority:
            return dec
        pred = dec.predicted_final_tokens or float(req.context_tokens)
        return replace(dec, priority=-(pred - req.context_tokens))

    def on_finish(self, traj: FinishedTrajectory) -> None:
        x = traj.final_tokens
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(x)
        bisect.insort(self._sorted, x)
        hist = self._by_prompt.pop(traj.prompt_id, [])  # re-inserted last: the dict is by recency
        hist.append(x)
        del hist[: -self.params.per_prompt]
        self._by_prompt[traj.prompt_id] = hist
        if len(self._by_prompt) > MAX_PROMPTS:
            del self._by_prompt[next(iter(self._by_prompt))]
