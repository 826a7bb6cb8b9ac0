"""The planner's decision types: a `Plan`, what it takes to switch to it, and its feasibility check.

A `Plan` is everything a mechanism needs to lay the cluster out: the train/rollout split, the
training parallelism (TP/PP/DP/CP and micro-batch) and the rollout buckets (TP, instance count and
length range of each). It is immutable; a simulator or the live runtime carries it out step by step
from a `PlanDiff` (which GPUs change role, whether training reshards, whether engines restart).

`check_plan` re-derives every constraint from the cost models, independently of the search code,
so tests (and a cautious mechanism) can verify that a plan is feasible rather than trust it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from libra.costmodel.training import TrainParallel
from libra.planner.config import ElasticConfig
from libra.planner.problem import PlanningProblem


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """`instances` engines of TP `tp` serving final lengths in (min_context, max_context]."""

    tp: int
    instances: int
    max_context: int
    min_context: int = 0
    predicted_s: float = 0.0

    @property
    def gpus(self) -> int:
        return self.tp * self.instances

    def to_dict(self) -> dict:
        return {"tp": self.tp, "instances": self.instances, "max_context": self.max_context,
                "min_context": self.min_context, "predicted_s": round(self.predicted_s, 3)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Plan:
    total_gpus: int
    train_gpus: int
    rollout_gpus: int
    train: TrainParallel
    buckets: tuple[BucketPlan, ...]
    t_train_s: float
    t_rollout_s: float  # makespan of one batch's rollout
    context_bound: int
    hybrid_replicas: int = 0
    planner: str = ""
    rollout_work_s: float = 0.0  # the busiest bucket's engine time per batch: a throughput floor
    staleness: int = 1
    # When each group is done (`WorkloadStats.group_spread`) if each step trains the first groups to
    # finish; empty when each step trains its own batch.
    group_spread: tuple[tuple[float, float], ...] = ()

    @property
    def step_time_s(self) -> float:
        return pipeline_period(
            self.t_train_s, self.t_rollout_s, self.rollout_work_s, self.staleness, self.group_spread
        )

    @property
    def rollout_wait_s(self) -> float:
        """From a batch's start until its step can train: T_rollout, or `completion_wait`."""
        return completion_wait(
            self.t_train_s, self.t_rollout_s, self.group_spread, self.staleness, self.rollout_work_s
        )

    @property
    def idle_gpus(self) -> int:
        return self.total_gpus - self.train_gpus - self.rollout_gpus

    @property
    def replica_gpus(self) -> int:
        """GPUs in one training DP replica: the unit the elastic pool moves."""
        return self.train.tp * self.train.pp * self.train.cp

    def layout_key(self) -> tuple:
        """What costs a reconfiguration to change: the split, training parallelism, engines per TP.

        Bucket boundaries are left out on purpose: they are router thresholds, free to move.
        """
        return (self.train_gpus, self.train, tuple((b.tp, b.instances) for b in self.buckets))

    @property
    def boundaries(self) -> tuple[int, ...]:
        return tuple(b.max_context for b in self.buckets)

    def to_dict(self) -> dict:
        t = self.train
        return {
            "split": {
                "train_gpus": self.train_gpus,
                "rollout_gpus": self.rollout_gpus,
                "idle_gpus": self.idle_gpus,
            },
            "train": {"tp": t.tp, "pp": t.pp, "dp": t.dp, "cp": t.cp, "micro_batch": t.micro_batch},
            "buckets": [b.to_dict() for b in self.buckets],
            "t_train_s": round(self.t_train_s, 3),
            "t_rollout_s": round(self.t_rollout_s, 3),
            "rollout_wait_s": round(self.rollout_wait_s, 3),
            "step_time_s": round(self.step_time_s, 3),
            "rollout_work_s": round(self.rollout_work_s, 3),
            "staleness": self.staleness,
            "context_bound": self.context_bound,
            "hybrid_replicas": self.hybrid_replicas,
            "planner": self.planner,
        }


def pipeline_period(
    t_train: float,
    t_rollout: float,
    work: float = 0.0,
    staleness: int = 1,
    spread: Sequence[tuple[float, float]] = (),
) -> float:
    """Seconds per step of the asynchronous pipeline in steady state.

    With staleness s, rollout of step k+s+1 starts when training of step k ends, and training of
    step k starts when its groups are in (and step k-1 has trained). When rollout is the slower
    stage, s+1 step periods therefore hold one rollout wait plus one training step:
    (s+1) P = wait + T_train. Training alone bounds P from below (it runs one step at a time), and
    so does the rollout engines' busy time per batch (they cannot overlap more work than they can
    do). s = 0 gives the sequential T_rollout + T_train; a large s gives max(T_train, work): the
    "max(T_train, T_rollout)" of a fully overlapped pipeline.

    The wait is T_rollout, the batch's makespan, when each step trains its own batch. With
    `spread` (`WorkloadStats.group_spread`) each step trains the first groups to finish, whatever
    their batch, and the wait is `completion_wait`: usually well short of the slowest group.
    """
    wait = completion_wait(t_train, t_rollout, spread, staleness, work) if spread else t_rollout
    return max(t_train, (wait + t_train) / (staleness + 1), work)


def completion_wait(
    t_train: float,
    t_rollout: float,
    spread: Sequence[tuple[float, float]],
    staleness: int = 1,
    work: float = 0.0,
) -> float:
    """Seconds from a batch's start until enough groups are done to train its step, in steady state.

    Training step k takes the first groups to finish (as many as a batch has) among those not
    trained yet. A group of the batch started i periods earlier is done by then with probability
    F(x + i P), and one of a batch started i periods later with F(x - i P), where x is this wait,
    P = (x + T_train) / (s + 1) the period, and F the groups' completion-time distribution. The
    steps before k trained as many groups as their batches held, so step k can start when the later
    batches' finished groups make up for the earlier batches' stragglers:

        sum_{i=1..s} F(x - i P) = sum_{i>=0} (1 - F(x + i P))

    The left side grows with x and the right side shrinks, so bisection finds x. A group's
    completion time is the later of its latency fraction x T_rollout and its shared-pool fraction
    x `work` (`WorkloadStats.group_spread`): where the engines have room, groups finish as their
    own latency allows and a few slow groups trail far behind the rest; where the engines are the
    bottleneck, every group waits its turn and most finish near the end. When the groups are alike
    (Search-R1), no later group finishes first and x is the slowest group's time.
    """
    if t_rollout <= 0 or not spread or staleness < 1:
        return t_rollout
    done_at = sorted(max(lat * t_rollout, shared * work) for lat, shared in spread)
    last, n = done_at[-1], len(done_at)
    if last <= 0:
        return t_rollout

    def done(t: float) -> float:  # F(t): the share of a batch's groups done t seconds after it began
        return bisect_right(done_at, t) / n

    def balance(x: float) -> float:
        period = max(t_train, (x + t_train) / (staleness + 1), last / 1000)
        ahead = sum(done(x - i * period) for i in range(1, staleness + 1))
        behind, t = 0.0, x
        while t < last:
            behind += 1.0 - done(t)
            t += period
        return ahead - behind

    lo, hi = 0.0, last
    for _ in range(30):  # to within 1e-9 of the slowest group
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if balance(mid) >= 0 else (mid, hi)
    return hi


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """What changes between two plans, in the terms a mechanism acts on."""

    to_train_gpus: int
    to_rollout_gpus: int
    train_changed: bool
    buckets_changed: bool  # engines start or stop (TP or instance counts differ)
    boundaries_changed: bool = False  # only the routers' length thresholds move: free

    @property
    def empty(self) -> bool:
        return not (
            self.to_train_gpus or self.to_rollout_gpus or self.train_changed or self.buckets_changed
            or self.boundaries_changed
        )  # fmt: skip


def diff(current: Plan, candidate: Plan) -> PlanDiff:
    moved = candidate.train_gpus - current.train_gpus
    cur_b = [(b.tp, b.instances) for b in current.buckets]
    new_b = [(b.tp, b.instances) for b in candidate.buckets]
    return PlanDiff(
        max(0, moved), max(0, -moved), current.train != candidate.train, cur_b != new_b,
        current.boundaries != candidate.boundaries,
    )  # fmt: skip


def reconfig_cost_s(d: PlanDiff, costs: ElasticConfig | None = None) -> float:
    """Seconds of pipeline time a switch costs, from the published transition costs.

    GPUs going to rollout and engines changing layout both pay an engine (re)start; GPUs going to
    training and a training reshard both pay a snapshot fetch and restore. The two sides proceed
    on disjoint GPUs at the same time, so the switch costs the longer of them, not their sum.
    Moving only bucket boundaries is free: it changes router thresholds, no engine restarts.
    """
    c = costs or ElasticConfig()
    engine = c.train_to_rollout_s if (d.to_rollout_gpus or d.buckets_changed) else 0.0
    trainer = c.rollout_to_train_s if (d.to_train_gpus or d.train_changed) else 0.0
    return max(engine, trainer)


@dataclass(frozen=True, slots=True)
class InFlightBatch:
    """A started rollout batch with trajectories still running, as a mechanism measured it: what a
    switch that restarts the engines must wait for when the mechanism drains batches first."""

    step: int
    age_s: float  # seconds since the batch started rolling out
    running: int  # its trajectories not finished yet
    context_tokens: int = 0  # the context its running trajectories hold (an interruption recomputes it)


# A batch still running past the predicted makespan has stragglers of unknown length left (agent
# lengths are heavy-tailed); its drain is priced at no less than this share of the makespan.
DRAIN_FLOOR = 0.25


def drain_s(in_flight: Sequence[InFlightBatch], makespan_s: float) -> float:
    """Seconds until every batch in flight has finished, when a batch's slowest trajectory takes
    `makespan_s` from its start: the largest of makespan - age over the batches still running.

    Why it is priced: a mechanism that restarts engines only once the batches on them have
    drained (the simulator) starts no new batch meanwhile, and a drain waits for the slowest
    trajectory of every batch in flight, which under completion order no step waits for. On
    R2E-Gym that is several step times (docs/planner.md, "Switching costs a drain").
    """
    left = [max(makespan_s - b.age_s, DRAIN_FLOOR * makespan_s) for b in in_flight if b.running > 0]
    return max(left, default=0.0)


def restarts_engines(d: PlanDiff) -> bool:
    """Whether carrying the diff out restarts rollout engines (and so waits for a drain)."""
    return bool(d.to_rollout_gpus or d.to_train_gpus or d.buckets_changed)


def pack(sizes: Sequence[int], nodes: int, per_node: int) -> list[int] | None:
    """Node index for each group (TP or TP*CP GPUs that must share a node), or None if they do not fit.

    First-fit decreasing is exact here: every size is a power of two dividing `per_node`, so a node
    never ends with a gap a later (smaller) group cannot fill.
    """
    free = [per_node] * nodes
    where = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        node = next((n for n in range(nodes) if free[n] >= sizes[i]), None)
        if node is None:
            return None
        free[node] -= sizes[i]
        where[i] = node
    return where


def placement_groups(plan: Plan) -> list[int]:
    """The node-local groups of a plan: one TP x CP group per training (pp, dp) slot, one per engine."""
    t = plan.train
    return [t.tp * t.cp] * (t.pp * t.dp) + [b.tp for b in plan.buckets for _ in range(b.instances)]


def check_plan(plan: Plan, problem: PlanningProblem, min_concurrent: int = 1) -> list[str]:
    """Every constraint a plan must meet, re-derived from the cost models; [] when feasible."""
    out = _check_train(plan, problem) + _check_rollout(plan, problem, min_concurrent)
    if plan.train_gpus + plan.rollout_gpus > problem.gpus:
        out.append(f"{plan.train_gpus} + {plan.rollout_gpus} GPUs exceed the cluster's {problem.gpus}")
    if pack(placement_groups(plan), problem.nodes, problem.hw.gpus_per_node) is None:
        out.append("the TP groups do not pack into the cluster's nodes")
    return out


def _check_train(plan: Plan, problem: PlanningProblem) -> list[str]:
    t, m, out = plan.train, problem.model, []
    if t.gpus != plan.train_gpus:
        out.append(f"training parallelism uses {t.gpus} GPUs, the split gives it {plan.train_gpus}")
    if t.tp * t.cp > problem.hw.gpus_per_node or m.heads % t.tp or t.pp > m.layers:
        out.append(f"tp={t.tp} cp={t.cp} pp={t.pp} break node/head divisibility or exceed the layers")
    if problem.prompts_per_step % t.dp:
        out.append(f"{problem.prompts_per_step} GRPO groups do not divide over dp={t.dp}")
    elif (problem.batch_size // t.dp) % t.micro_batch:
        out.append(
            f"{problem.batch_size // t.dp} samples per DP rank do not divide into micro_batch={t.micro_batch}"
        )
    if not problem.train_model().memory(t, plan.context_bound).fits:
        out.append(f"training does not fit in memory at {plan.context_bound} tokens")
    return out


def _check_rollout(plan: Plan, problem: PlanningProblem, min_concurrent: int) -> list[str]:
    out = []
    if sum(b.gpus for b in plan.buckets) != plan.rollout_gpus:
        out.append("bucket instances do not add up to the rollout GPUs")
    if not plan.buckets or plan.buckets[-1].max_context < problem.max_length:
        out.append(f"no bucket holds the maximum length {problem.max_length}")
    for b in plan.buckets:
        if b.instances < 1 or not problem.tp_allowed(b.tp):
            out.append(f"bucket tp={b.tp} x {b.instances} is not an allowed layout")
        elif problem.rollout_model(b.tp).kv_capacity_tokens() < min_concurrent * b.max_context:
            out.append(f"a TP{b.tp} engine cannot hold {min_concurrent} x {b.max_context} tokens of KV")
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a plan's groups go: the node of each training TP x CP group, and of each engine."""

    train_groups: tuple[int, ...]  # one node per (pp, dp) slot, each holding tp * cp GPUs
    engines: tuple[tuple[int, ...], ...]  # per bucket, one node per engine


def place(plan: Plan, gpus_per_node: int) -> Placement:
    """Nodes for every group of `plan` (the packing `check_plan` verifies); for mechanisms."""
    nodes = plan.total_gpus // gpus_per_node
    groups = placement_groups(plan)
    where = pack(groups, nodes, gpus_per_node)
    if where is None:
        raise ValueError(f"plan does not pack into {nodes} nodes of {gpus_per_node} GPUs")
    n_train = plan.train.pp * plan.train.dp
    out, k = [], n_train
    for b in plan.buckets:
        out.append(tuple(where[k : k + b.instances]))
        k += b.instances
    return Placement(tuple(where[:n_train]), tuple(out))
