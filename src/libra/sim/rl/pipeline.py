"""The RL post-training pipeline on a simulated clock: rollout batches, training steps, weights.

Disaggregated systems run rollout and training on separate GPUs, asynchronously with bounded
staleness, as slime and AReaL do: rollout batch s may start once at least s-k training steps have
finished (its weights are at most k steps old), so up to k+1 batches are in flight and the next
batch overlaps the tail of the last one (under the strict gate the lead ramps up from 1 at the
start, `StalenessGate.lead`). Training step s takes as many whole GRPO groups as batch s
has: by default the first groups to finish (`pipeline.consume: completion`, as AReaL does), so a
straggler's group is trained by a later step instead of holding its own step up; with `batch`,
exactly the groups of batch s. The bound holds for what is trained: a group that finishes more than
k steps after its weights (a straggler under `consume: completion`) is set aside by the shared
`GroupQueue`, counted (`expired_groups`) and replaced by a fresh group (a group of a batch no step
draws, `Batches.spare`, as the live run samples a new problem) started with the weights of the
moment. Training step s starts once its groups are in and step s-1 has
finished. A batch that starts with newer weights than the engines hold first waits for the weight
sync. Colocated systems alternate on all GPUs (rollout, switch, train, switch), one whole batch at a
time.

Metrics (the README defines each): throughput = generated tokens / wall time, where wall time ends
with the last training step; mean step time = wall time / steps; rollout makespan = batch s start to
the moment step s's groups are all in; GPU utilisation = busy GPU-seconds / (all GPUs x wall time).
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property, partial
from pathlib import Path

import numpy as np

from libra.core.errors import ConfigError
from libra.core.trace import read_trace
from libra.core.trajectory import Trajectory
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import Profile
from libra.costmodel.speculative import SpecDecoding
from libra.costmodel.training import TrainCostModel
from libra.planner import StepReport
from libra.planner.partial import PartialRollout
from libra.planner.plan import InFlightBatch
from libra.planner.staleness import Finished, GroupQueue, StalenessGate
from libra.rollout.registry import make_router, params_for, route_params
from libra.rollout.tail import TailLane, TailStats
from libra.sim import isolation
from libra.sim.isolation import Progress
from libra.sim.kernel import Kernel
from libra.sim.rl.config import RLScenario
from libra.sim.rl.driver import RolloutDriver, RoutingStats, Run, RunState, make_engines
from libra.sim.rl.elastic_pool import ElasticPool
from libra.sim.rl.limit import BatchFloor, Limit, StepTaken, makespan_bounds, window_work
from libra.sim.rl.partial import GroupKey, GroupStream
from libra.sim.rl.records import InFlight, SimRecord, StepRecord
from libra.sim.rl.systems import Setup, System, make_system
from libra.sim.tracing import Tracer
from libra.sim.workloads import make_workload, step_rng

SPARE_STEP = 1_000_000  # spare groups come from the batches of these steps, which no run reaches
SPARE = "~spare"  # marks a spare group's prompt id


class Batches:
    """Where each step's trajectories come from: a workload generator or a replayed trace."""

    def __init__(self, sc: RLScenario, seed: int, trace: list[Trajectory] | None = None):
        self.trace = None
        self._floors: dict[object, dict[int, BatchFloor]] = {}
        if trace is not None:
            by_step: dict[int, list[Trajectory]] = {}
            for t in trace:
                by_step.setdefault(t.step, []).append(t)
            self.trace = [by_step[s] for s in sorted(by_step)]
            return
        self.workload = make_workload(sc.workload)
        self.seed = seed
        # Every system of a run simulates the same batches: generate each step once. The sim
        # only reads trajectories, so sharing them is safe (about 0.5 MB per 512-trajectory step).
        self._cache: dict[int, list[Trajectory]] = {}

    @property
    def trace_steps(self) -> int | None:
        return None if self.trace is None else len(self.trace)

    def get(self, step: int) -> list[Trajectory]:
        """Step `step`'s batch. Trace steps are renumbered 0..n-1 in order, and cycled with fresh
        ids when more steps are asked for, so that ids stay unique among batches in flight."""
        if self.trace is None:
            batch = self._cache.get(step)
            if batch is None:
                batch = self._cache[step] = self.workload.generate(step, step_rng(self.seed, step))
            return batch
        cycle, i = divmod(step, len(self.trace))
        suffix = f"#{cycle}" if cycle else ""
        return [replace(t, id=t.id + suffix, step=step) for t in self.trace[i]]

    def spare(self, k: int, step: int) -> list[Trajectory]:
        """The k-th spare group, to replace a group of batch `step` that grew too old to train: the
        first group of a batch no step draws (fresh lengths and ids), relabelled as batch `step`'s."""
        b = SPARE_STEP + k
        batch = self.get(b) if self.trace is not None else self.workload.generate(b, step_rng(self.seed, b))
        first = [t for t in batch if t.prompt_id == batch[0].prompt_id]
        pid = f"{first[0].prompt_id}{SPARE}"
        return [replace(t, id=f"{t.id}{SPARE}", prompt_id=pid, step=step) for t in first]

    def floors(self, limit: Limit, batches: Iterable[int]) -> dict[int, BatchFloor]:
        """The floors (`sim.rl.limit`) of these batches under `limit`, each computed once (the
        scenario's limit for every step before the systems fork; a system that decodes
        speculatively, or starts later batches early, computes the rest in its own process)."""
        done = self._floors.setdefault(limit.key, {})
        for b in batches:
            if b not in done:
                done[b] = limit.batch(self.get(b))
        return done


class RLSim:
    """One system on one scenario: the mechanism that carries out the system's decisions."""

    def __init__(self, sc: RLScenario, system: System, batches: Batches, steps: int, seed: int,
                 profile: Profile | None = None, trace_step: int | None = None):  # fmt: skip
        cat = load_catalog()
        self.sc, self.system, self.batches, self.steps = sc, system, batches, steps
        self.hw, self.model = cat.hardware(sc.cluster.hardware), cat.model(sc.model)
        self.profile = profile or Profile()
        self.k = Kernel(seed)
        self.total_gpus = sc.cluster.nodes * self.hw.gpus_per_node
        self.tracer = Tracer(trace_step)
        self.train_cost = TrainCostModel(self.hw, self.model, self.profile.train)
        system.run_steps = steps
        system.sample = batches.trace[0] if batches.trace else None  # a trace's own data to profile
        self.setup: Setup = system.setup(sc, self.hw)
        # Routing counts and engine token totals cover the whole run, across re-plans (each
        # re-plan builds new engines and a new driver).
        self.routing = RoutingStats()
        self.tail_stats = TailStats()
        self.retired_tokens = self.retired_preemptions = 0
        self.bucketed = False  # whether any layout of the run had more than one bucket
        self.driver_version = 0
        self.driver = self._build_driver(self.setup)
        self.history: list[StepRecord] = []
        self.in_flight: dict[int, InFlight] = {}
        self.group_left: dict[tuple[int, str], int] = {}  # (step, prompt) -> samples still running
        self.group_done: dict[tuple[int, str], list[Trajectory]] = {}
        self.gate = StalenessGate(sc.pipeline.staleness, sc.pipeline.consume, self.setup.colocated,
                                  sc.pipeline.strict_staleness)  # fmt: skip
        self.finished: GroupQueue[list[Trajectory]] = GroupQueue(self.gate)
        self.filled = 0  # steps whose training batch is full
        self.version: dict[int, int] = {}  # step -> training steps done when its batch started
        self.rerun: dict[GroupKey, int] = {}  # a spare group in flight -> the version it started with
        self.expired_groups = 0  # groups set aside as older than the staleness bound and replaced
        self.expired_at: dict[int, int] = {}  # step -> groups that expired when it took its groups
        self.done_batches: dict[int, StepRecord] = {}
        self.rollout_started = self.train_done = 0
        self.training = False
        self.weights_on_engines = 0
        self.train_busy_gpu_s = 0.0
        self.engine_busy_gpu_s = 0.0
        self.progress: Progress = lambda label, frac: None
        self.pending: Setup | None = None  # a new layout waiting for the batches in flight to drain
        self.ready_at = 0.0  # when the engines of a new layout are up (a re-plan's restart)
        self.train_delay = 0.0  # a training reshard the next step waits for (`_reshard`)
        self.replans = 0
        self.pool = self._make_pool() if system.elastic else None
        self._bounds: list[float] | None = None
        self.mech = self.setup.mechanisms
        self.submitted: dict[GroupKey, float] = {}  # when each group's first trajectory started
        self.group_version: dict[GroupKey, int] = {}  # the weights its first trajectory started with
        self._tags: dict[str, list] = {}  # finished, untrained trajectory -> its tokens' version tags
        self._finish_at: dict[str, float] = {}  # finished, untrained trajectory -> when it finished
        self.suspended: list[Run] = []  # partial rollouts: trajectories stopped with their step
        self._sync_until = 0.0
        self.partial: PartialRollout[list[Trajectory]] | None = None
        self.stream = GroupStream(batches.get)
        if self.mech.partial:
            target = len({t.prompt_id for t in batches.get(0)})  # a step's groups (a trace's too)
            self.partial = PartialRollout(target, self.mech.over_provision, self.gate)

    def _make_pool(self) -> ElasticPool:
        return ElasticPool(self.setup.plan, self.driver, self.k, self.sc.elastic)

    def train_par(self):
        """The training layout of the next step: the plan's, plus hybrid replicas that are ACTIVE."""
        t = self.setup.train
        extra = self.pool.active if self.pool is not None else 0
        return replace(t, dp=t.dp + extra) if extra else t

    # ---- construction -------------------------------------------------------------------------

    def _build_driver(self, setup: Setup) -> RolloutDriver:
        engines = make_engines(self.k, setup.instances, self.hw, self.model, self.sc, self.profile.rollout,
                               self.tracer, speculative=setup.mechanisms.speculative)  # fmt: skip
        bucket_of = {e.id: s.bucket for e, s in zip(engines, setup.instances, strict=True)}
        node_of = {e.id: s.node for e, s in zip(engines, setup.instances, strict=True)}
        costs = {
            b: engines[[s.bucket for s in setup.instances].index(b)].cost for b in set(bucket_of.values())
        }
        coster = _coster(costs, len(setup.buckets))
        router = make_router(
            setup.router, setup.buckets, cost=coster, seed=0, **params_for(setup.router, setup.router_params)
        )
        if self.system.tail:
            router = TailLane(router, self.sc.tail, coster, self.tail_stats)
        drv = RolloutDriver(self.k, engines, setup.buckets, bucket_of, router, node_of,
                            self.sc.pipeline.tool_latency_default_s, self.tracer)  # fmt: skip
        drv.set_caps(self.sc.rollout.instance_cap)
        drv.chunk_tokens = setup.mechanisms.chunk_tokens
        drv.migrate_in_tool = setup.mechanisms.migrate_in_tool
        if self.driver_version:
            drv.version = self.driver_version
        drv.on_traj_done = self._traj_done
        drv.stats = self.routing
        self.bucketed |= len(setup.buckets) > 1
        return drv

    # ---- the step loop ------------------------------------------------------------------------

    def run(self) -> dict:
        with _collector_paused():
            self._try_rollout()
            self.k.run()
        if self.train_done < self.steps:
            raise RuntimeError(
                f"{self.system.name}: simulation stalled after {self.train_done} of {self.steps} steps"
            )
        return self.summary()

    def _may_roll(self, s: int) -> bool:
        if self.pending is not None or (s >= self.steps and not self._starved()):
            return False
        return self.gate.may_start(s, self.train_done, busy=self.training or not self._drained())

    def _starved(self) -> bool:
        """Under a strict gate a step may train more groups than a batch holds (its overdue ones),
        so the batches of the run may not hold enough groups for its last steps: then one more
        batch starts, whose groups feed those steps (it is never a step of its own)."""
        if not (self.gate.strict and self.gate.by_completion()) or self.filled >= self.steps:
            return False
        have = self.finished.waiting() + len(self.group_left)
        return have < (self.steps - self.filled) * self._groups_per_step

    @cached_property
    def _groups_per_step(self) -> int:
        """GRPO groups a training step takes (batch 0's; every batch has as many)."""
        return len({t.prompt_id for t in self.batches.get(0)})

    def _drained(self) -> bool:
        """No batch and no re-run group in flight."""
        return not self.in_flight and not self.rerun

    def _try_rollout(self) -> None:
        while self._may_roll(self.rollout_started):
            s = self.rollout_started
            self.rollout_started += 1
            self.in_flight[s] = InFlight(s)
            self.version[s] = self.train_done  # the weights batch s is generated with
            delay = self.sc.pipeline.switch_s if self.setup.colocated and s > 0 else 0.0
            delay = max(delay, self.ready_at - self.k.now)
            if self.train_done > self.weights_on_engines and not self.setup.colocated:
                delay += self._weight_sync_s()
                self.weights_on_engines = self.train_done
            self.tracer.step_started(s, self.k.now)
            self.k.after(delay, self._start_batch, s)

    def _update_weights(self) -> None:
        """AReaL's weight update: the new weights go to the engines now; the requests in flight
        are aborted and resubmitted at once, recomputing their KV, and run once the sync is done."""
        self.driver.version = self.weights_on_engines = self.train_done
        self._sync_until = self.k.now + self._weight_sync_s()
        self.driver.interrupt(self.driver.resubmit)
        self.k.at(self._sync_until, self._sync_done)

    def _sync_done(self) -> None:
        if self.k.now >= self._sync_until:  # not a sync that a later update has extended
            self.driver.resume_engines()

    def _weight_sync_s(self) -> float:
        if self.sc.pipeline.weight_sync_s is not None:
            return self.sc.pipeline.weight_sync_s
        tp = min(i.tp for i in self.setup.instances)
        # Each rollout GPU receives its TP shard over the network; plus pausing and resharding.
        return self.model.weight_bytes / tp / (self.hw.inter_node_bw_gbps * 1e9 * 0.75) + 0.5

    def _start_batch(self, s: int) -> None:
        b = self.in_flight[s]
        b.t0 = self.k.now
        self.driver.version = max(self.driver.version, self.version[s])
        if self.partial is not None:
            self._start_partial(b)
            return
        trajs = self.batches.get(s)
        groups: dict[str, list[Trajectory]] = {}
        for t in trajs:
            groups.setdefault(t.prompt_id, []).append(t)
        b.groups = len(groups)
        for pid, members in groups.items():
            self._group_started((s, pid), len(members))
        for t in trajs:
            self.driver.start(t)

    def _group_started(self, key: GroupKey, members: int) -> None:
        self.group_left[key] = members
        self.submitted[key] = self.k.now
        self.group_version[key] = self.driver.version

    def _start_partial(self, b: InFlight) -> None:
        """An over-provisioned step: the groups it carried over resume, then new ones start."""
        assert self.partial is not None
        b.groups = self.partial.target
        self.driver.resume_engines()
        carried, self.suspended = self.suspended, []
        for run in carried:
            self.driver.resume(run)
        for _ in range(self.partial.room()):
            key, members = self.stream.next()
            self.partial.started(key, self.driver.version)
            self._group_started(key, len(members))
            for t in members:
                self.driver.start(t)

    def _traj_done(self, run: Run) -> None:
        t = run.traj
        key = (t.step, t.prompt_id)
        self._tags[t.id] = run.tags
        self._finish_at[t.id] = self.k.now
        self.group_done.setdefault(key, []).append(t)
        self.group_left[key] -= 1
        if self.group_left[key]:
            return
        del self.group_left[key]
        if self.partial is not None:
            self.partial.done(key, self.group_done.pop(key))
            self._fill_partial()
            return
        version = self.rerun.pop(key) if key in self.rerun else self.version[t.step]
        self.finished.add(t.step, version, self.group_done.pop(key))
        if self._fill():
            if self.pending is not None and self._drained():
                self._apply_pending()
            self._try_train()
            self._try_rollout()

    def _fill(self) -> bool:
        """Fill the next steps' batches from finished groups; whether any step was filled."""
        filled = False
        while (
            self.filled < self.steps
            and (b := self.in_flight.get(self.filled)) is not None
            and b.groups is not None
        ):
            taken = self.finished.take(self.filled, b.groups, self._oldest_running())
            self._replace(self.filled, self.finished.drain_expired())
            if taken is None:
                break
            self._batch_done(b, taken)
            self.filled += 1
            filled = True
        return filled

    def _oldest_running(self) -> int | None:
        """The weight version of the oldest group still running (a strict gate waits for it)."""
        if not self.gate.strict or not self.group_left:
            return None
        return min(self.group_version[k] for k in self.group_left)

    def _fill_partial(self) -> None:
        """A partial-rollout step is full once its target has finished (`PartialRollout.ready`):
        the rest of its rollout stops, kept for the next step, and the step trains."""
        assert self.partial is not None
        b = self.in_flight.get(self.filled)
        if b is None or b.t0 is None or not self.partial.ready(self.filled):
            return
        taken = self.partial.take(self.filled)
        end = self._stop_rollout()
        self._batch_done(b, taken, end)
        self.filled += 1
        self._try_train()
        self._try_rollout()

    def _stop_rollout(self) -> float:
        """Abort every request in flight and keep each trajectory, as it stands, for the next step;
        the time the engines stop (each at the end of the iteration it is running)."""
        self.driver.interrupt(self._keep)  # first: it cuts the engines' decode segments short
        end = max([self.k.now] + [e.busy_until() for e in self.driver.engines.values()])
        for run in list(self.driver.active.values()):
            if run.state == RunState.TOOL:
                self._keep(run)
        return end

    def _keep(self, run: Run) -> None:
        self.driver.suspend(run)
        self.suspended.append(run)

    def _replace(self, step: int, expired: list[Finished[list[Trajectory]]]) -> None:
        """Each group too old to train at `step` is replaced by a spare group, started now with the
        weights of now."""
        if expired:
            self.expired_at[step] = self.expired_at.get(step, 0) + len(expired)
        for f in expired:
            spare = self.batches.spare(self.expired_groups, f.group[0].step)
            key = (spare[0].step, spare[0].prompt_id)
            self.expired_groups += 1
            self._group_started(key, len(spare))
            self.rerun[key] = self.group_version[key] = self.train_done
            for t in spare:
                self.driver.start(t)

    def _batch_done(
        self, b: InFlight, taken: Sequence[Finished[list[Trajectory]]], end: float | None = None
    ) -> None:
        s = b.step
        trajs = [t for f in taken for t in f.group]
        del self.in_flight[s]
        assert b.t0 is not None  # a batch with groups has started
        lags: Counter[int] = Counter()
        for t in trajs:
            for version, tokens in self._tags.pop(t.id, ()):
                lags[s - version] += tokens
        done = sorted(self._finish_at.pop(t.id) for t in trajs)
        tail = done[-1] - done[max(0, math.ceil(TAIL_SHARE * len(done)) - 1)] if done else 0.0
        end = self.k.now if end is None else end
        self.done_batches[s] = StepRecord(s, b.t0, end, sum(t.generated_tokens for t in trajs),
                                          [t.total_tokens for t in trajs], trajs,
                                          [s - f.version for f in taken], dict(lags), tail)  # fmt: skip
        self.driver.router.on_step_end(s)

    def _try_train(self) -> None:
        s = self.train_done
        if self.training or s not in self.done_batches:
            return
        self.training = True
        rec = self.done_batches.pop(s)
        self.history.append(rec)
        par = self.train_par()
        dt = self.train_cost.step(par, rec.lengths).step_time_s
        delay = self.sc.pipeline.switch_s if self.setup.colocated else 0.0
        delay, self.train_delay = delay + self.train_delay, 0.0
        rec.train_start, rec.train_time = self.k.now + delay, dt
        rec.train_gpus, rec.rollout_gpus = par.gpus, self._serving_gpus()
        rec.layout = [(b.tp, sum(1 for i in self.setup.instances if i.bucket == k), b.max_context)
                      for k, b in enumerate(self.setup.buckets)]  # fmt: skip
        self.train_busy_gpu_s += dt * par.gpus
        self.tracer.train_span(s, self.k.now + delay, dt)
        self.k.after(delay + dt, self._train_end, s)

    def _train_end(self, s: int) -> None:
        self.history[s].train_end = self.k.now
        self.train_done += 1
        self.training = False
        if self.mech.interrupt_updates and not self.setup.colocated:
            self._update_weights()
        self.tracer.step_ended(s, self.k.now)
        self.progress(self.system.name, self.train_done / self.steps)
        if self.train_done % GC_EVERY_STEPS == 0:
            gc.collect()  # see _collector_paused
        self._replan()
        self._try_train()
        self._try_rollout()

    def _serving_gpus(self) -> int:
        return self.setup.rollout_gpus - (0 if self.pool is None else self.pool.lent_gpus())

    def _replan(self) -> None:
        """Hand the finished step to the system's controller and carry out what it decides."""
        ctrl = self.system.controller
        if ctrl is None:
            return
        last = self.history[-1]
        report = StepReport(last.step, last.trajs, last.train_time, last.rollout_makespan, self._pressure(),
                            in_flight=self._running_batches())  # fmt: skip
        pool = None
        if self.pool is not None:
            pool = self.pool.view(
                self.setup.train.dp, self._serving_gpus(), self.sc.workload.prompts_per_step
            )
        dec = ctrl.observe(report, self.setup.plan, pool)
        if dec.elastic is not None and self.pool is not None:
            self.pool.apply(dec.elastic)
        if dec.replan is not None:
            new = self.system.setup_for(dec.replan.plan, self.sc, self.hw, dec.replan.reconfig_s)
            self._switch(new, dec.replan.interrupt)

    def _running_batches(self) -> tuple[InFlightBatch, ...]:
        """The batches a layout switch would drain (`_switch` waits for all of them), or
        interrupt: every started batch with trajectories still running, with the context their
        running trajectories hold, and those admitted but not yet started."""
        now = self.k.now
        running: dict[int, int] = {}
        age: dict[int, float] = {}
        for key, left in self.group_left.items():  # a batch's age is its youngest running group's
            running[key[0]] = running.get(key[0], 0) + left
            age[key[0]] = min(age.get(key[0], now), now - self.submitted[key])
        tokens: dict[int, int] = {}
        for run in self.driver.active.values():
            tokens[run.traj.step] = tokens.get(run.traj.step, 0) + _context_of(run)
        for s, b in self.in_flight.items():
            if b.t0 is None:
                running[s], age[s] = 1, 0.0
        return tuple(InFlightBatch(s, age[s], n, tokens.get(s, 0)) for s, n in sorted(running.items()))

    def _switch(self, new: Setup, interrupt: bool = False) -> None:
        """Carry a re-plan out: new boundaries and a training reshard at once; new engines once the
        batches in flight have drained, or at once by interrupting them (`interrupt`)."""
        if _same_layout(new, self.setup):  # only the bucket boundaries moved: router thresholds
            self.setup = replace(new, instances=self.setup.instances)
            self.driver.retune(new.buckets)
            return
        if _same_engines(new, self.setup) and (self.pool is None or not self.pool.lent_gpus()):
            self._reshard(new)
            return
        if interrupt:
            self.pending = None  # a drain still waiting is overtaken
            self._interrupt_switch(new)
            return
        self.pending = new
        if self._drained():
            self._apply_pending()

    def _reshard(self, new: Setup) -> None:
        """Only the training layout changes: the engines keep serving (no drain) and the trainer
        reshards before its next step, which waits the switch's cost."""
        self.setup = replace(new, instances=self.setup.instances)
        self.driver.retune(new.buckets)
        self.train_delay += new.reconfig_s
        self.replans += 1
        if self.pool is not None:  # replicas of the new training layout's size, on the same engines
            old, self.pool = self.pool, self._make_pool()
            self.pool.carry_over(old)

    def _pressure(self) -> float:
        engines = self.driver.engines.values()
        return sum(len(e.waiting) for e in engines) / max(1, sum(e.max_num_seqs for e in engines))

    def _apply_pending(self) -> None:
        """Every batch has drained: restart the engines in the new layout (after its cost)."""
        new, self.pending = self.pending, None
        self._new_layout(new)

    def _new_layout(self, new: Setup) -> RolloutDriver:
        """Retire the engines and start the new layout's, which serve from `reconfig_s` on; the
        retired driver is returned (an interrupting switch still hands its trajectories over)."""
        old = self.driver
        self.engine_busy_gpu_s += self._engine_busy()
        retiring = old.engines.values()
        self.retired_tokens += sum(e.prefill_tokens + e.decode_tokens for e in retiring)
        self.retired_preemptions += sum(e.preemptions for e in retiring)
        # A new layout gets a new router: its cost model is the new engines', so nothing a router
        # learned of the old layout (queue levels, per-bucket costs) carries over.
        self.driver_version = old.version
        self.setup, self.driver = new, self._build_driver(new)
        self.ready_at = self.k.now + new.reconfig_s
        self.replans += 1
        if self.pool is not None:  # the new layout's hybrid replicas; the counts run on
            pool, self.pool = self.pool, self._make_pool()
            self.pool.carry_over(pool)
        return old

    def _interrupt_switch(self, new: Setup) -> None:
        """Switch now instead of draining (AReaL's interruption, carried to a re-plan): the engines
        abort what they run at the end of their iteration and stop; once the new layout's engines
        are up (`reconfig_s`), every trajectory in flight goes on there, an aborted turn from the
        tokens it had, recomputing its KV (`RolloutDriver.suspend` / `resume`)."""
        old = self._new_layout(new)
        old.interrupt(_ignore)
        self.k.at(self.ready_at, self._take_over, old)

    def _take_over(self, old: RolloutDriver) -> None:
        # Turns that started on the stopped engines since (a tool returned) are aborted now.
        old.interrupt(partial(self._adopt, old))
        for run in list(old.active.values()):
            if run.seq is None:  # in a tool call, or aborted
                self._adopt(old, run)

    def _adopt(self, old: RolloutDriver, run: Run) -> None:
        old.suspend(run)
        del old.active[run.traj.id]
        run.engine = None  # it holds no KV anywhere now
        self.driver.active[run.traj.id] = run
        self.driver.resume(run)

    # ---- metrics ------------------------------------------------------------------------------

    def bounds(self) -> list[float]:
        """Each trained step's makespan lower bound (`sim.rl.limit`), computed once."""
        if self._bounds is None:
            limit = limit_of(self.sc, self.profile, self.mech.speculative)
            floors = self.batches.floors(limit, sorted({b for b, _ in self.submitted}))
            # Spare groups (replacements of expired ones) are left out: the floors are the batches'
            # own, and fewer groups counted keeps each bound a lower bound.
            taken = [StepTaken(r.step, r.rollout_start, sorted({(t.step, t.prompt_id) for t in r.trajs
                                                               if not t.prompt_id.endswith(SPARE)}))
                     for r in self.history]  # fmt: skip
            partial = self.partial is not None
            completion = partial or self.gate.by_completion()
            windows = (
                [(r.rollout_start, r.rollout_end) for r in self.history]
                if partial and self.setup.colocated
                else None
            )
            # Every batch the run started, with its start: a batch no step is named after may
            # still feed the last steps (its groups count among the earliest finishes).
            began: dict[int, float] = {}
            for (b, g), t in self.submitted.items():
                if not g.endswith(SPARE):
                    began[b] = min(t, began.get(b, t))
            self._bounds = makespan_bounds(taken, floors, self.total_gpus, completion,
                                           self.submitted if partial else None, windows, began)  # fmt: skip
        return self._bounds

    def mean_bound(self) -> float:
        """The mean of the steps' bounds; for a colocated system with partial rollouts, at least
        the work of every trained group over the cluster, spread over the steps (`sim.rl.limit`)."""
        bound = float(np.mean(self.bounds()))
        if self.partial is not None and self.setup.colocated:
            limit = limit_of(self.sc, self.profile, self.mech.speculative)
            floors = self.batches.floors(limit, sorted({b for b, _ in self.submitted}))
            groups = [(t.step, t.prompt_id) for r in self.history for t in r.trajs]
            bound = max(bound, window_work(sorted(set(groups)), floors, self.total_gpus) / len(self.history))
        return bound

    def _engine_busy(self) -> float:
        return sum(e.busy_s * e.tp for e in self.driver.engines.values())

    def summary(self) -> dict:
        h = self.history
        wall = h[-1].train_end
        gen = sum(r.generated_tokens for r in h)
        busy = self.engine_busy_gpu_s + self._engine_busy() + self.train_busy_gpu_s
        engines = self.driver.engines.values()
        rollout_tokens = self.retired_tokens + sum(e.prefill_tokens + e.decode_tokens for e in engines)
        makespan, bound = float(np.mean([r.rollout_makespan for r in h])), self.mean_bound()
        return {
            "throughput_tokens_per_s": gen / wall,
            "mean_step_time_s": wall / len(h),
            "mean_rollout_makespan_s": makespan,
            "makespan_lower_bound_s": bound,
            "distance_to_limit": makespan / bound - 1 if bound > 0 else 0.0,
            "rollout_throughput_tokens_per_s": gen / sum(r.rollout_makespan for r in h),
            "mean_train_time_s": float(np.mean([r.train_time for r in h])),
            "mean_tail_s": float(np.mean([r.tail_s for r in h])),
            "gpu_utilization": busy / (self.total_gpus * wall),
            "wall_time_s": wall,
            "generated_tokens": gen,
            "train_gpus": self.setup.train_gpus,
            "rollout_gpus": self.setup.rollout_gpus,
            "preemptions": self.retired_preemptions + sum(e.preemptions for e in engines),
            "replans": self.replans,
            "mean_staleness": float(np.mean([x for r in h for x in r.staleness])),
            "max_staleness": max(x for r in h for x in r.staleness),
            **_token_lag(h),
            **({"interrupts": self.driver.interrupts} if self.mech.interrupt_updates else {}),
            **({"carried_groups": self.partial.carried_groups} if self.partial is not None else {}),
            **({"mode": d.to_dict()} if (d := getattr(self.system, "mode_decision", None)) else {}),
            "expired_groups": self.expired_groups,
            **({"elastic": self.pool.summary()} if self.pool else {}),
            **({"routing": self.routing.as_dict(rollout_tokens)} if self.bucketed else {}),
            **(
                {"tail": {"lane_turns": self.tail_stats.lane_turns, "evictions": self.tail_stats.evictions}}
                if self.system.tail
                else {}
            ),  # fmt: skip
        }

    def record(self) -> SimRecord:
        """What the report needs of this run (without the trajectories: they stay with the batches)."""
        history = [replace(r, trajs=[]) for r in self.history]
        return SimRecord(self.system.name, history, self.tracer)

    def per_step(self) -> list[dict]:
        out, prev = [], 0.0
        for r, bound in zip(self.history, self.bounds(), strict=True):
            out.append({"step": r.step, "step_time_s": r.train_end - prev,
                        "throughput_tokens_per_s": r.generated_tokens / max(1e-9, r.train_end - prev),
                        "rollout_makespan_s": r.rollout_makespan, "makespan_lower_bound_s": bound,
                        "train_time_s": r.train_time, "expired_groups": self.expired_at.get(r.step, 0),
                        "mean_length": float(np.mean(r.lengths)), "p90_length": float(np.percentile(r.lengths, 90)),
                        "staleness_mean": float(np.mean(r.staleness)) if r.staleness else 0.0,
                        "staleness_max": max(r.staleness, default=0),
                        "train_gpus": r.train_gpus, "rollout_gpus": r.rollout_gpus})  # fmt: skip
            prev = r.train_end
        return out


GC_EVERY_STEPS = 25
# The tail of a step (Seer's definition): its last 10% of trajectories to finish. `mean_tail_s` is
# the time from the moment 90% of a step's trained trajectories had finished to its last one.
TAIL_SHARE = 0.9


@contextmanager
def _collector_paused():
    """Run with Python's cyclic garbage collector off, and collect every GC_EVERY_STEPS steps.

    A simulation keeps a few million small objects alive (trajectories, tree nodes, events) and
    allocates many more, so the automatic collector keeps re-walking the live ones: it took about a
    quarter of the default job's time (223 s with it, 167 s without, `libra simulate`). Reference
    counting still frees everything that is not in a cycle; the periodic full collection bounds
    whatever cycles the run leaves (peak RSS of the whole default job with no collection at all
    was 534 MB).

    What existed before this run (the shared batches; in-process, also the systems simulated
    earlier) is frozen out of the collector's sight: it is alive either way, and in a forked child
    walking it would also copy every page it touches.
    """
    was = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


def _same_engines(a: Setup, b: Setup) -> bool:
    """The same rollout engines (TP and bucket of each) and split: a switch needs no drain."""
    key = lambda s: (s.train_gpus, s.router, sorted((i.tp, i.bucket) for i in s.instances))  # noqa: E731
    return key(a) == key(b)


def _same_layout(a: Setup, b: Setup) -> bool:
    return a.train == b.train and _same_engines(a, b)


def limit_of(sc: RLScenario, profile: Profile, speculative: SpecDecoding | None = None) -> Limit:
    """The scenario's limit (`sim.rl.limit`): its cluster, model and engines' settings (and the
    speculative decoder of a system that has one)."""
    cat = load_catalog()
    hw, model = cat.hardware(sc.cluster.hardware), cat.model(sc.model)
    return Limit(hw, model, profile.rollout, sc.rollout, sc.pipeline.tool_latency_default_s, speculative)


def _context_of(run: Run) -> int:
    """The context a running trajectory holds: what an interruption makes it recompute."""
    if not run.contexts:
        return run.traj.prompt_tokens
    done = run.traj.turns[run.turn].output_tokens if run.state == RunState.TOOL else run.partial
    return run.contexts[-1] + done


def _ignore(run: Run) -> None:
    """An aborted trajectory that stays where it is until it is handed over."""


def _token_lag(history: list[StepRecord]) -> dict:
    """The version lag of every trained token: how many training steps older than the step that
    trains it the weights that wrote it are (mean over tokens, and the largest)."""
    lags: Counter[int] = Counter()
    for r in history:
        lags.update(r.token_lag)
    tokens = sum(lags.values())
    mean = sum(lag * n for lag, n in lags.items()) / tokens if tokens else 0.0
    return {"mean_token_lag": mean, "max_token_lag": max(lags, default=0)}


def _coster(costs: dict, n_buckets: int):
    from libra.rollout.placement import CostModelCoster

    if len(costs) != n_buckets:
        return None
    return CostModelCoster([costs[b] for b in range(n_buckets)])


def run(sc: RLScenario, systems: list[str] | None, steps: int | None, seed: int, out_dir: Path | None,
        progress: Progress, trace: str | None = None, profile: Profile | None = None,
        isolate: bool = True) -> dict:  # fmt: skip
    """Simulate each system on the scenario; return the summary (and write plots/trace to out_dir).

    Each system runs in a forked child process, one after another (`sim.isolation`); tests that
    spy on a system's objects pass `isolate=False` to keep it in this process.
    """
    trajs = read_trace(trace) if trace else None
    names = systems or sc.systems or ["verl-colocated", "static-uniform"]
    batches = Batches(sc, seed, trajs)
    if batches.trace:
        sc = trace_shaped(sc, batches.trace[0])
    n = steps or (batches.trace_steps if trajs is not None else sc.steps)
    if n < 1:
        raise ConfigError("steps", n, "an integer >= 1")
    trace_step = sc.trace_step if sc.trace_step is not None else min(2, n - 1)
    # Generated once, here, with their floors: every system's process reads the same batches.
    batches.floors(limit_of(sc, profile or Profile()), range(n))
    systems_ = [make_system(name) for name in names]  # an unknown name fails here, before anything runs
    for system in systems_:
        if sc.pipeline.staleness < system.min_staleness:
            raise ConfigError("pipeline.staleness", sc.pipeline.staleness,
                              f">= {system.min_staleness} for {system.name}: {system.needs_staleness}")  # fmt: skip
    route_params({s.router for s in systems_}, sc.rollout.router_params)  # a param no router has: error
    results, per_step, records, shared = {}, {}, {}, {}
    for name, system in zip(names, systems_, strict=True):
        system.shared = shared
        job = partial(_simulate, sc, system, batches, n, seed, profile, trace_step)
        # `shared` comes back with this system's memoised planner searches, for the next ones.
        results[name], per_step[name], records[name], shared = isolation.call(job, progress, isolate)
    out = {"scenario": sc.name, "seed": seed, "steps": n, "systems": results, "per_step": per_step}
    if out_dir is not None:
        from libra.sim.rl.report import write_outputs

        write_outputs(out, records, Path(out_dir))
    return out


def trace_shaped(sc: RLScenario, batch: Sequence[Trajectory]) -> RLScenario:
    """The scenario with its workload's batch shape (prompts per step, samples per prompt) set to
    a replayed trace's: the planners size training and rollout for the batches the run replays,
    not for the scenario's own workload (a tau-bench step is 10 x 4, R2E-Gym's 32 x 16)."""
    sizes = Counter(t.prompt_id for t in batch)
    shape = {"prompts_per_step": len(sizes), "samples_per_prompt": max(sizes.values())}
    return sc.model_copy(update={"workload": sc.workload.model_copy(update=shape)})


def _simulate(sc: RLScenario, system: System, batches: Batches, n: int, seed: int, profile: Profile | None,
              trace_step: int, progress: Progress) -> tuple[dict, list[dict], SimRecord, dict]:  # fmt: skip
    sim = RLSim(sc, system, batches, n, seed, profile, trace_step)
    sim.progress = progress
    return sim.run(), sim.per_step(), sim.record(), system.shared
