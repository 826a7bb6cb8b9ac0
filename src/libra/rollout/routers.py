"""The router base class and the baselines C-MLFQ is measured against.

Every router here is a small class with a pydantic `Params` model (validated when the router is
built, settable from a scenario's `rollout.router_params`) and one policy hook:

- `target(req, floor) -> (bucket, predicted_final_tokens)` for routers that choose a bucket and let
  the shared placement pick the instance (classic MLFQ, the length predictor, the oracle, C-MLFQ);
- or an override of `pick(...)` for the load balancers that ignore lengths (round-robin,
  least-loaded).

`BaseRouter.route` does the rest identically for all of them: it never lets a trajectory sit in a
bucket too small for its context, chooses the instance, and prices the migration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.rollout.base import (
    Bucket,
    FinishedTrajectory,
    InstanceView,
    MigrationCoster,
    MigrationMethod,
    RouteDecision,
    RouteRequest,
    TurnPricer,
    bucket_for_length,
)
from libra.rollout.placement import (
    choose_instance,
    least_loaded,
    migration_method,
    per_gpu_load,
)

PARAMS_FIELD = "rollout.router_params"


class NoParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


class BucketParams(BaseModel):
    """What every router that chooses a bucket shares: when a turn may run above that bucket."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    spill: Literal["cost", "balance", "saturated"] = Field(
        default="cost",
        description="cost: also run in a larger bucket when the cost model says the turn adds less "
        "token time there (without a cost model, as balance); balance: when it has less load per "
        "GPU; saturated: only when the chosen bucket is full (placement.py).",
    )


def check_buckets(buckets: Sequence[Bucket]) -> list[Bucket]:
    """Buckets must be non-empty and strictly ordered by max_context (bucket 0 the smallest)."""
    out = list(buckets or [])
    if not out or not all(isinstance(b, Bucket) for b in out):
        raise ConfigError("rollout.buckets", buckets, "a non-empty list of buckets")
    ctx = [b.max_context for b in out]
    if any(a >= b for a, b in zip(ctx, ctx[1:], strict=False)) or ctx[0] <= 0:
        raise ConfigError("rollout.buckets", ctx, "positive max_context values in strictly increasing order")
    return out


class BaseRouter:
    """Shared mechanics of every router; subclasses supply `target` or override `pick`."""

    name: ClassVar[str] = "base"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(
        self, buckets: Sequence[Bucket], cost: MigrationCoster | None = None, seed: int = 0, **params
    ):
        self.buckets = check_buckets(buckets)
        self.cost = cost
        self.seed = int(seed)
        self.params = build(self.Params, params, PARAMS_FIELD)
        self._spill = getattr(self.params, "spill", "saturated")
        self._pricer = cost if self._spill == "cost" and isinstance(cost, TurnPricer) else None

    def retune(self, buckets: Sequence[Bucket]) -> None:
        """New bucket boundaries, the same buckets and engines: only the length thresholds move
        (a planner's boundary refit; the simulator and the gateway both call this)."""
        new = check_buckets(buckets)
        if [(b.name, b.tp) for b in new] != [(b.name, b.tp) for b in self.buckets]:
            raise ConfigError("buckets", [b.name for b in new], f"the router's buckets {[b.name for b in self.buckets]}, in order")  # fmt: skip
        self.buckets = new

    def route(self, req: RouteRequest, instances: Sequence[InstanceView]) -> RouteDecision:
        floor = bucket_for_length(self.buckets, req.context_tokens)
        inst, predicted, target = self.pick(req, instances, floor)
        method = migration_method(self.cost, instances, req.current_instance, inst, req.context_tokens)
        return RouteDecision(inst.bucket, inst.id, method != MigrationMethod.NONE, method, predicted, target)

    def pick(
        self, req: RouteRequest, instances: Sequence[InstanceView], floor: int
    ) -> tuple[InstanceView, float | None, int | None]:
        """(instance, predicted final tokens, target bucket); length-blind routers have no target."""
        target, predicted = self.target(req, floor)
        target = min(max(target, floor), len(self.buckets) - 1)
        inst = choose_instance(
            instances, target, floor, len(self.buckets), req.current_instance, req.level, self._price(req)
        )
        return inst, predicted, target

    def _price(self, req: RouteRequest) -> Callable[[InstanceView], float] | None:
        """What a turn's candidate instances compete on (`spill`); None: only a full bucket spills."""
        if self._spill == "saturated":
            return None
        pricer, ctx = self._pricer, req.context_tokens
        if pricer is None:
            return per_gpu_load
        return lambda inst: pricer.turn_price(inst.bucket, inst.outstanding, ctx)

    def target(self, req: RouteRequest, floor: int) -> tuple[int, float | None]:
        raise NotImplementedError

    def on_finish(self, traj: FinishedTrajectory) -> None:
        """Most baselines learn nothing from finished trajectories."""

    def on_step_end(self, step: int) -> None:
        """Most baselines keep no per-step state."""


def _current_usable(req: RouteRequest, instances: Sequence[InstanceView], floor: int) -> InstanceView | None:
    """The trajectory's current instance, if it can keep serving it (affinity keeps the prefix).

    Only failure or a context too large for its bucket moves it; not the request cap, which
    others filled while it was in a tool call (see `placement.choose_instance`).
    """
    if req.current_instance is None:
        return None
    for inst in instances:
        if inst.id == req.current_instance:
            return inst if (inst.healthy and inst.bucket >= floor) else None
    return None


class RoundRobinRouter(BaseRouter):
    """Length-blind: each new trajectory goes to the next instance in turn and stays there.

    Affinity keeps the prefix cache (what verl and slime do with sticky sessions); a trajectory
    moves only when its instance fails or is too small for its context.
    """

    name = "round-robin"

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        self._next = self.seed

    def pick(self, req, instances, floor):
        keep = _current_usable(req, instances, floor)
        if keep is not None:
            return keep, None, None
        n = len(instances)
        for k in range(n):
            inst = instances[(self._next + k) % n]
            if not inst.saturated and inst.bucket >= floor:
                self._next = (self._next + k + 1) % n
                return inst, None, None
        return least_loaded(instances, floor), None, None


class LeastLoadedParams(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    per_gpu: bool = Field(
        default=False, description="Weigh load by GPUs (outstanding/TP) instead of outstanding/cap."
    )


class LeastLoadedRouter(BaseRouter):
    """Length-blind: each new trajectory goes to the instance with the lowest outstanding/cap (the
    request count balancers of vLLM's and SGLang's routers), or with `per_gpu` outstanding/TP."""

    name = "least-loaded"
    Params = LeastLoadedParams

    def pick(self, req, instances, floor):
        keep = _current_usable(req, instances, floor)
        if keep is None:
            keep = least_loaded(instances, floor, self.params.per_gpu)
        return keep, None, None


class ClassicMLFQParams(BucketParams):
    thresholds: list[int] | None = Field(
        default=None, description="Demotion thresholds in tokens; default: the buckets' max_context."
    )
    measure: Literal["context", "generated"] = "context"


class ClassicMLFQRouter(BaseRouter):
    """Classic MLFQ: levels are buckets; one level down each time the trajectory crosses the next
    threshold. It reacts to length already used and never predicts, so it keeps moving the same
    tokens as a long trajectory walks down the levels.

    `measure=context` counts the tokens the trajectory holds (prompt, outputs, tool returns);
    `generated` counts only its model outputs (attained service, as in LLM-serving MLFQs).
    """

    name = "classic-mlfq"
    Params = ClassicMLFQParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        th = self.params.thresholds
        if th is None:
            th = [b.max_context for b in self.buckets[:-1]]
        if len(th) != len(self.buckets) - 1 or any(a >= b for a, b in zip(th, th[1:], strict=False)):
            raise ConfigError(
                f"{PARAMS_FIELD}.thresholds", th, f"{len(self.buckets) - 1} increasing token counts"
            )
        self.thresholds = th

    def target(self, req, floor):
        level = 0 if req.level is None else req.level
        used = req.context_tokens if self.params.measure == "context" else req.generated_tokens
        if level < len(self.thresholds) and used > self.thresholds[level]:
            level += 1
        return level, None


class OracleRouter(BaseRouter):
    """Knows the true final length (the simulator fills `true_final_tokens`) and places the
    trajectory in that bucket from its first turn. Without it, it falls back to the bucket of the
    current context, i.e. it behaves like a perfectly reactive router."""

    name = "oracle"
    Params = BucketParams

    def target(self, req, floor):
        if req.true_final_tokens is None:
            return floor, None
        return bucket_for_length(self.buckets, req.true_final_tokens), float(req.true_final_tokens)


class LengthPredictorParams(BucketParams):
    prior_strength: float = Field(
        default=2.0, gt=0, description="Pseudo-samples of the global fit when a prompt has history."
    )
    history_per_prompt: int = Field(default=64, gt=0, description="Final lengths kept per prompt.")


class LengthPredictorRouter(BaseRouter):
    """Predicts a trajectory's final length once, at its start, from prompt-level features.

    This stands in for the embedding-based predictor the Libra paper compares against: a regressor
    from what the prompt looks like to how long its rollouts get. Its features are the prompt's
    token count (a log-log least-squares fit over all finished trajectories) and, when the same
    prompt was rolled out in an earlier step, that prompt's mean final length (what an embedding
    nearest-neighbour finds), shrunk toward the fit by `prior_strength` pseudo-samples. It is refit
    after every step from the trajectories finished so far. Its error is therefore the real error of
    these features on the workload, not injected noise. Between tool returns it keeps its bucket
    and only moves when the context outgrows it: it never sees what happens during the rollout.
    """

    name = "length-predictor"
    Params = LengthPredictorParams

    def __init__(self, buckets, cost=None, seed=0, **params):
        super().__init__(buckets, cost, seed, **params)
        self._by_prompt: dict[str, list[int]] = {}
        self._xy: list[tuple[float, float]] = []
        self._fit: tuple[float, float] | None = None

    def predict(self, prompt_id: str, prompt_tokens: int) -> float | None:
        if self._fit is None:
            return None
        a, b = self._fit
        log_pred = a + b * math.log(max(1, prompt_tokens))
        hist = self._by_prompt.get(prompt_id)
        if hist:
            k = self.params.prior_strength
            mean_log = sum(math.log(max(1, x)) for x in hist) / len(hist)
            log_pred = (k * log_pred + len(hist) * mean_log) / (k + len(hist))
        return math.exp(log_pred)

    def target(self, req, floor):
        if req.level is not None:
            return req.level, None
        pred = self.predict(req.prompt_id, req.prompt_tokens)
        return (0, None) if pred is None else (bucket_for_length(self.buckets, pred), pred)

    def on_finish(self, traj: FinishedTrajectory) -> None:
        hist = self._by_prompt.setdefault(traj.prompt_id, [])
        hist.append(traj.final_tokens)
        del hist[: -self.params.history_per_prompt]
        prompt = traj.turn_contexts[0] if traj.turn_contexts else traj.final_tokens
        self._xy.append((math.log(max(1, prompt)), math.log(max(1, traj.final_tokens))))
        del self._xy[:-20000]

    def on_step_end(self, step: int) -> None:
        self._fit = _loglog_fit(self._xy)


def _loglog_fit(xy: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = a + b x; a flat fit (b = 0) when x does not vary."""
    if not xy:
        return None
    n = len(xy)
    mx = sum(x for x, _ in xy) / n
    my = sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    if sxx < 1e-9:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in xy) / sxx
    return my - b * mx, b
