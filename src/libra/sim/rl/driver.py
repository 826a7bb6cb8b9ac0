"""Drives trajectories through simulated engines, asking a router at every turn.

At each turn start the driver builds a `RouteRequest`, calls the router (the same object the live
gateway uses), and carries the decision out: submit to the chosen engine, and when the instance
changes, either transfer the KV cache (after the transfer time) or re-prefill on the target, as
the decision says. It records routing quality (accuracy at tool returns, migrations, migrated
tokens) and calls `on_finish` when a trajectory ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from libra.core.errors import InfeasibleError
from libra.core.trajectory import Trajectory
from libra.costmodel.rollout import RolloutCostModel
from libra.rollout.base import (
    Bucket,
    FinishedTrajectory,
    InstanceView,
    MigrationMethod,
    RouteDecision,
    RouteRequest,
    bucket_for_length,
)
from libra.rollout.tool_state import from_turn
from libra.sim.engine import Engine, KVPolicy, Seq
from libra.sim.kernel import Kernel


@dataclass(slots=True)
class RoutingStats:
    """Routing quality. A decision is scored on the bucket the router chose (`RouteDecision.target`;
    the bucket it ran in for the length-blind routers, which choose none): that is what the router
    predicted. Where it ran can differ when the turn spilled to a larger bucket (the chosen one was
    full, or with `spill: balance` less loaded per GPU), which says how the load was spread, not
    how well the router predicted; that is `placement_accuracy`, and `spilled` the share of
    decisions that ran above their target."""

    decisions: int = 0
    correct: int = 0
    placed_correct: int = 0
    spilled: int = 0
    migrations: int = 0
    migrated_tokens: int = 0

    def as_dict(self, rollout_tokens: int) -> dict:
        n = max(1, self.decisions)
        return {
            "accuracy": self.correct / n,
            "placement_accuracy": self.placed_correct / n,
            "spilled": self.spilled / n,
            "migrated_token_ratio": self.migrated_tokens / rollout_tokens if rollout_tokens else 0.0,
            "migrations": self.migrations,
            "decisions": self.decisions,
        }


@dataclass(slots=True)
class Run:
    """One trajectory in flight."""

    traj: Trajectory
    turn: int = 0
    engine: Engine | None = None
    path: list = field(default_factory=list)
    contexts: list = field(default_factory=list)
    t_start: float = 0.0
    generated: int = 0  # output tokens of the turns before `turn` (kept incrementally: no O(turns) sums)
    final: int = 0  # the trajectory's final length, computed once
    charged: int = 0  # the context this trajectory commits on its engine's KV cache (see _commit)
    target: int | None = None  # the bucket the router chose at the last turn (RouteDecision.target)


class RolloutDriver:
    def __init__(self, kernel: Kernel, engines: list[Engine], buckets: list[Bucket], bucket_of: dict[str, int],
                 router, node_of: dict[str, int], tool_latency_default_s: float, tracer=None):  # fmt: skip
        self.k, self.engines, self.buckets, self.router = kernel, {e.id: e for e in engines}, buckets, router
        self.views = {
            e.id: InstanceView(e.id, bucket_of[e.id], e.tp, 0, 10**9, True, node_of[e.id]) for e in engines
        }
        self.view_list = list(self.views.values())
        self.tool_default = tool_latency_default_s
        self.tracer = tracer
        self.stats = RoutingStats()
        self.on_traj_done: Callable[[Run], None] = lambda run: None
        self.finished: list[tuple[Trajectory, float]] = []
        # KV each engine is committed to: the contexts of the trajectories that live on it, in a
        # turn or in a tool call (their prefix stays resident). The cache itself never shows more
        # than full, so only this tells a router that an engine holds more agents than fit.
        self.committed = {e.id: 0 for e in engines}

    def retune(self, buckets: list[Bucket]) -> None:
        """New bucket boundaries, same engines: only the router's thresholds move."""
        self.router.retune(buckets)
        self.buckets = list(buckets)

    def set_caps(self, cap: int) -> None:
        for v in self.view_list:
            v.cap = cap

    def start(self, traj: Trajectory) -> None:
        run = Run(traj, t_start=self.k.now, final=traj.total_tokens)
        self._route_and_submit(run, traj.prompt_tokens)

    def _request(self, run: Run, ctx: int) -> RouteRequest:
        t = run.traj
        eng = run.engine
        return RouteRequest(t.id, t.prompt_id, t.step, run.turn, t.prompt_tokens, ctx, run.generated, tuple(run.path),
                            None if eng is None else self.views[eng.id].bucket, None if eng is None else eng.id,
                            run.final, run.target)  # fmt: skip

    def _route_and_submit(self, run: Run, ctx: int) -> None:
        dec = self.router.route(self._request(run, ctx), self.view_list)
        target = self.engines[dec.instance]
        run.target = dec.target
        if run.turn > 0:
            self._score(run, dec)
        run.contexts.append(ctx)
        turn = run.traj.turns[run.turn]
        seq = Seq(run.traj.id, ctx, max(1, turn.output_tokens), self._turn_done, turn.has_tool, owner=run)
        prev = run.engine
        run.engine = target
        self.views[target.id].outstanding += 1
        if prev is not None:
            self._commit(prev, -run.charged)
        run.charged = ctx
        self._commit(target, ctx)
        if prev is None or prev is target:
            target.submit(seq)
            return
        self._migrate(run, prev, target, seq, dec.method)

    def _migrate(self, run: Run, prev: Engine, target: Engine, seq: Seq, method: MigrationMethod) -> None:
        held = prev.cached(run.traj.id)
        prev.release(run.traj.id)
        self.stats.migrations += 1
        if not held:  # nothing cached to move: the target prefills, as it would anyway
            target.submit(seq)
            return
        self.stats.migrated_tokens += held
        if method == MigrationMethod.KV_TRANSFER:
            inter = self.views[prev.id].node != self.views[target.id].node
            delay = target.cost.kv_transfer_time(held, inter)
            self.k.after(delay, target.submit, seq, held)
        else:
            target.submit(seq)

    def _score(self, run: Run, dec: RouteDecision) -> None:
        st = self.stats
        true = bucket_for_length(self.buckets, run.final)
        st.decisions += 1
        st.correct += dec.chosen == true
        st.placed_correct += dec.bucket == true
        st.spilled += dec.bucket > dec.chosen

    def _turn_done(self, seq: Seq) -> None:
        run: Run = seq.owner
        assert run.engine is not None
        self.views[run.engine.id].outstanding -= 1
        turn = run.traj.turns[run.turn]
        if not turn.has_tool:
            self._finish(run)
            return
        latency = self.tool_default if turn.tool_latency_s is None else turn.tool_latency_s
        if self.tracer is not None:
            self.tracer.tool_span(run.traj.id, turn.tool, self.k.now, latency)
        self.k.after(latency, self._tool_return, run)

    def _tool_return(self, run: Run) -> None:
        turn = run.traj.turns[run.turn]
        run.path.append(from_turn(turn))
        run.turn += 1
        run.generated += turn.output_tokens
        self._route_and_submit(run, run.contexts[-1] + turn.output_tokens + turn.tool_return_tokens)

    def _commit(self, engine: Engine, tokens: int) -> None:
        self.committed[engine.id] += tokens
        self.views[engine.id].kv_usage = self.committed[engine.id] / engine.kv_cap

    def _finish(self, run: Run) -> None:
        t = run.traj
        assert run.engine is not None
        self._commit(run.engine, -run.charged)
        run.engine.release(t.id)
        self.router.on_finish(
            FinishedTrajectory(t.id, t.prompt_id, t.step, tuple(run.path), tuple(run.contexts), run.final)
        )
        self.finished.append((t, self.k.now - run.t_start))
        self.on_traj_done(run)


def make_engines(kernel: Kernel, specs, hw, model, sc, eff, tracer=None, prefix: str = "") -> list[Engine]:
    r = sc.rollout
    policy = KVPolicy.parse(r.kv_during_tool)
    out = []
    for i, spec in enumerate(specs):
        cost = RolloutCostModel(hw, model, spec.tp, eff, r.gpu_memory_utilization, r.max_num_batched_tokens,
                                r.engine, r.max_num_seqs)  # fmt: skip
        if not cost.fits():
            raise InfeasibleError(
                f"a TP{spec.tp} rollout instance of {model.name} on {hw.name} has no memory left for the "
                f"KV cache with rollout.max_num_batched_tokens={r.max_num_batched_tokens} and "
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}"
            )
        out.append(Engine(kernel, f"{prefix}i{i}-tp{spec.tp}-n{spec.node}", cost, r.max_num_seqs,
                          r.max_num_batched_tokens, policy, tracer))  # fmt: skip
    return out
