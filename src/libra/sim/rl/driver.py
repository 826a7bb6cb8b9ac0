"""Drives trajectories through simulated engines, asking a router at every turn.

At each turn start the driver builds a `RouteRequest`, calls the router (the same object the live
gateway uses), and carries the decision out: submit to the chosen engine, and when the instance
changes, either transfer the KV cache (after the transfer time) or re-prefill on the target, as
the decision says. It records routing quality (accuracy at tool returns, migrations, migrated
tokens) and calls `on_traj_done` when a trajectory ends.

The mechanisms the peers' papers need, each reusable by any system (`Setup.mechanisms`):
- **Version tags.** Every submission is tagged with the weight version on the engines when it was
  submitted (`version`, which the pipeline advances at each weight update); a trajectory keeps
  (version, tokens) for the tokens each submission wrote (`Run.tags`), so the pipeline can report
  the version lag of every trained token.
- **Interruption** (`interrupt`, AReaL's weight updates and APRIL's abort): every engine aborts
  what it holds at the end of its running iteration and pauses; each aborted trajectory keeps the
  tokens it wrote (`Run.partial`) and is handed to the caller, which resubmits it (it recomputes
  its KV) or suspends it (`suspend`, picked up by `resume`, possibly steps later).
- **Divided rollout** (`chunk_tokens`, Seer): a turn is submitted at most `chunk_tokens` output
  tokens at a time; after each chunk the router places the rest again, on any instance.
- **Migration during tool calls** (`migrate_in_tool`, Heddle): when a turn ends in a tool call,
  the router places the next turn at once and the KV moves while the tool runs.
- **Priority**: a decision's `priority` orders the engine's waiting queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from libra.core.errors import InfeasibleError
from libra.core.trajectory import Trajectory
from libra.costmodel.speculative import SpecDecoding, rollout_cost
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
from libra.sim.kernel import Handle, Kernel


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


class RunState(IntEnum):
    TURN = 0  # a turn (or a chunk of one) is submitted, or its KV is on the way to its engine
    TOOL = 1  # waiting on a tool call
    SUSPENDED = 2  # aborted and kept for later (`resume`)
    DONE = 3


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
    state: int = RunState.TURN
    partial: int = 0  # output tokens of the current turn written by earlier submissions (chunks, aborts)
    seq: Seq | None = None  # the submission in flight
    version: int = 0  # the weight version of the submission in flight: its tokens' tag
    tags: list = field(default_factory=list)  # [version, tokens] per run of equal versions, in order
    pending: Handle | None = None  # the tool's return, or a submission waiting for its KV
    tool_end: float = 0.0  # when the tool call in progress returns
    kv_move: Handle | None = None  # KV on its way to the next turn's engine during a tool call
    kv_ready_at: float = 0.0
    tool_pending: bool = False  # suspended in a tool call: `resume` waits for its return

    def tag(self, version: int, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.tags and self.tags[-1][0] == version:
            self.tags[-1][1] += tokens
        else:
            self.tags.append([version, tokens])


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
        self.version = 0  # the weights on the engines: tags every submission's tokens
        self.active: dict[str, Run] = {}  # trajectories started and not finished, in start order
        self.chunk_tokens = 0  # > 0: divided rollout, at most this many output tokens per submission
        self.migrate_in_tool = False
        self.interrupts = 0

    def retune(self, buckets: list[Bucket]) -> None:
        """New bucket boundaries, same engines: only the router's thresholds move."""
        self.router.retune(buckets)
        self.buckets = list(buckets)

    def set_caps(self, cap: int) -> None:
        for v in self.view_list:
            v.cap = cap

    def start(self, traj: Trajectory) -> None:
        run = Run(traj, t_start=self.k.now, final=traj.total_tokens)
        self.active[traj.id] = run
        self._route_and_submit(run, traj.prompt_tokens)

    def _request(self, run: Run, ctx: int, in_tool: bool = False) -> RouteRequest:
        t = run.traj
        eng = run.engine
        return RouteRequest(t.id, t.prompt_id, t.step, run.turn, t.prompt_tokens, ctx, run.generated, tuple(run.path),
                            None if eng is None else self.views[eng.id].bucket, None if eng is None else eng.id,
                            run.final, run.target, in_tool)  # fmt: skip

    def _route_and_submit(self, run: Run, ctx: int) -> None:
        """A new turn starts from context `ctx`."""
        dec = self.router.route(self._request(run, ctx), self.view_list)
        run.target = dec.target
        if run.turn > 0:
            self._score(run, dec)
        run.contexts.append(ctx)
        self._place(run, dec, ctx)

    def _continue(self, run: Run) -> None:
        """The rest of the current turn, after a chunk or an abort: placed again from where it is."""
        ctx = run.contexts[-1] + run.partial
        dec = self.router.route(self._request(run, ctx), self.view_list)
        run.target = dec.target
        self._place(run, dec, ctx)

    def _place(self, run: Run, dec: RouteDecision, ctx: int) -> None:
        turn = run.traj.turns[run.turn]
        out = max(1, turn.output_tokens) - run.partial
        chunked = 0 < self.chunk_tokens < out
        if chunked:
            out = self.chunk_tokens
        keep = turn.has_tool or chunked  # a chunk's KV stays for the rest of its turn
        prio = 0.0 if dec.priority is None else dec.priority
        seq = Seq(run.traj.id, ctx, out, self._seq_done, keep, owner=run, priority=prio)
        target = self.engines[dec.instance]
        prev = run.engine
        run.engine, run.seq, run.version, run.state = target, seq, self.version, RunState.TURN
        self.views[target.id].outstanding += 1
        if prev is not None:
            self._commit(prev, -run.charged)
        run.charged = run.contexts[-1]
        self._commit(target, run.charged)
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
            run.pending = self.k.after(delay, self._submit_moved, run, seq, held)
        else:
            target.submit(seq)

    def _submit_moved(self, run: Run, seq: Seq, held: int) -> None:
        run.pending = None
        assert run.engine is not None
        run.engine.submit(seq, held)

    def _score(self, run: Run, dec: RouteDecision) -> None:
        st = self.stats
        true = bucket_for_length(self.buckets, run.final)
        st.decisions += 1
        st.correct += dec.chosen == true
        st.placed_correct += dec.bucket == true
        st.spilled += dec.bucket > dec.chosen

    def _seq_done(self, seq: Seq) -> None:
        run: Run = seq.owner
        assert run.engine is not None
        self.views[run.engine.id].outstanding -= 1
        run.seq = None
        run.tag(run.version, seq.out_total)
        run.partial += seq.out_total
        turn = run.traj.turns[run.turn]
        if run.partial < max(1, turn.output_tokens):
            self._continue(run)
            return
        run.partial = 0
        if not turn.has_tool:
            self._finish(run)
            return
        latency = self.tool_default if turn.tool_latency_s is None else turn.tool_latency_s
        if self.tracer is not None:
            self.tracer.tool_span(run.traj.id, turn.tool, self.k.now, latency)
        run.state, run.tool_end = RunState.TOOL, self.k.now + latency
        run.pending = self.k.after(latency, self._tool_return, run)
        if self.migrate_in_tool:
            self._move_during_tool(run)

    def _move_during_tool(self, run: Run) -> None:
        """Place the next turn now and move the KV while the tool runs (Heddle's migration)."""
        prev = run.engine
        assert prev is not None
        ctx = run.contexts[-1] + run.traj.turns[run.turn].output_tokens
        dec = self.router.route(self._request(run, ctx, in_tool=True), self.view_list)
        target = self.engines[dec.instance]
        if target is prev:
            return
        key = run.traj.id
        held = prev.cached(key)
        prev.release(key)
        self._commit(prev, -run.charged)
        self._commit(target, run.charged)
        run.engine, run.target = target, dec.target
        self.stats.migrations += 1
        if held:
            self.stats.migrated_tokens += held
            inter = self.views[prev.id].node != self.views[target.id].node
            delay = target.cost.kv_transfer_time(held, inter)
            run.kv_ready_at = self.k.now + delay
            run.kv_move = self.k.after(delay, self._kv_arrived, run, target, held)

    def _kv_arrived(self, run: Run, target: Engine, held: int) -> None:
        run.kv_move = None
        target.adopt(run.traj.id, held)

    def _tool_return(self, run: Run) -> None:
        if run.kv_move is not None:  # the KV moved during the tool is not there yet: wait for it
            run.pending = self.k.at(run.kv_ready_at, self._tool_return, run)  # after its arrival event
            return
        run.pending = None
        turn = run.traj.turns[run.turn]
        run.path.append(from_turn(turn))
        run.turn += 1
        run.generated += turn.output_tokens
        ctx = run.contexts[-1] + turn.output_tokens + turn.tool_return_tokens
        run.state = RunState.TURN
        self._route_and_submit(run, ctx)

    def _commit(self, engine: Engine, tokens: int) -> None:
        self.committed[engine.id] += tokens
        self.views[engine.id].kv_usage = self.committed[engine.id] / engine.kv_cap

    def _finish(self, run: Run) -> None:
        t = run.traj
        assert run.engine is not None
        self._commit(run.engine, -run.charged)
        run.charged = 0
        run.engine.release(t.id)
        run.state = RunState.DONE
        del self.active[t.id]
        self.router.on_finish(
            FinishedTrajectory(t.id, t.prompt_id, t.step, tuple(run.path), tuple(run.contexts), run.final)
        )
        self.finished.append((t, self.k.now - run.t_start))
        self.on_traj_done(run)

    # ---- interruption: weight updates that abort generation, and aborted rollouts ----------------

    def interrupt(self, on_abort: Callable[[Run], None]) -> None:
        """Abort every submission in flight: each engine at the end of its running iteration (it
        then drops its KV and pauses until `resume_engines`), a submission waiting for its KV at
        once. `on_abort(run)` gets each aborted trajectory, its tokens so far kept in `partial`;
        trajectories in tool calls are not touched (their cached prefix is dropped with the KV)."""
        self.interrupts += 1
        for run in list(self.active.values()):
            self._drop_move(run)  # KV on the way is dropped with the rest
            if run.state == RunState.TURN and run.pending is not None and run.seq is not None:
                run.pending.cancel()
                run.pending = None
                self._aborted(run, 0, on_abort)
        for eng in self.engines.values():
            eng.interrupt(lambda seq, produced: self._aborted(seq.owner, produced, on_abort))

    def _aborted(self, run: Run, produced: int, on_abort: Callable[[Run], None]) -> None:
        assert run.engine is not None
        self.views[run.engine.id].outstanding -= 1
        run.seq = None
        run.tag(run.version, produced)
        run.partial += produced
        on_abort(run)

    def resume_engines(self) -> None:
        for eng in self.engines.values():
            eng.resume()

    def resubmit(self, run: Run) -> None:
        """An aborted trajectory goes on at once (it recomputes its KV where it is placed)."""
        self._continue(run)

    def suspend(self, run: Run) -> None:
        """Keep an aborted trajectory, or one in a tool call, for later: its engine forgets it."""
        run.tool_pending = run.state == RunState.TOOL
        if run.pending is not None:  # the tool goes on in its sandbox: `resume` waits for what is left
            run.pending.cancel()
            run.pending = None
        self._drop_move(run)
        run.state = RunState.SUSPENDED
        if run.engine is not None:
            self._commit(run.engine, -run.charged)
            run.engine.release(run.traj.id)
        run.charged = 0

    def resume(self, run: Run) -> None:
        """Go on with a suspended trajectory: its tool's return (what is left of the call), or the
        rest of its turn, which prefills its whole context again."""
        if run.tool_pending:
            run.tool_pending = False
            run.state = RunState.TOOL
            run.pending = self.k.at(max(self.k.now, run.tool_end), self._tool_return, run)
            return
        self._continue(run)

    def _drop_move(self, run: Run) -> None:
        if run.kv_move is not None:
            run.kv_move.cancel()
            run.kv_move = None
        run.kv_ready_at = 0.0


def make_engines(kernel: Kernel, specs, hw, model, sc, eff, tracer=None, prefix: str = "",
                 speculative: SpecDecoding | None = None) -> list[Engine]:  # fmt: skip
    r = sc.rollout
    policy = KVPolicy.parse(r.kv_during_tool)
    out = []
    for i, spec in enumerate(specs):
        cost = rollout_cost(hw, model, spec.tp, eff, r, speculative)
        if not cost.fits():
            raise InfeasibleError(
                f"a TP{spec.tp} rollout instance of {model.name} on {hw.name} has no memory left for the "
                f"KV cache with rollout.max_num_batched_tokens={r.max_num_batched_tokens} and "
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}"
            )
        out.append(Engine(kernel, f"{prefix}i{i}-tp{spec.tp}-n{spec.node}", cost, r.max_num_seqs,
                          r.max_num_batched_tokens, policy, tracer))  # fmt: skip
    return out
