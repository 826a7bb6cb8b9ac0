"""The RL post-training pipeline on a simulated clock: rollout batches, training steps, weights.

Disaggregated systems run rollout and training on separate GPUs, asynchronously with bounded
staleness, as slime and AReaL do: rollout batch s may start once at least s-k training steps have
finished (its weights are at most k steps old), so up to k+1 batches are in flight and the next
batch overlaps the tail of the last one. Training step s takes as many whole GRPO groups as batch s
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
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from libra.core.errors import ConfigError
from libra.core.trace import read_trace
from libra.core.trajectory import Trajectory
from libra.costmodel.catalog import load_catalog
from libra.costmodel.efficiency import Profile
from libra.costmodel.training import TrainCostModel
from libra.planner import StepReport
from libra.planner.staleness import Finished, GroupQueue, StalenessGate
from libra.rollout.registry import make_router, params_for, route_params
from libra.rollout.tail import TailLane, TailStats
from libra.sim import isolation
from libra.sim.isolation import Progress
from libra.sim.kernel import Kernel
from libra.sim.rl.config import RLScenario
from libra.sim.rl.driver import RolloutDriver, RoutingStats, make_engines
from libra.sim.rl.elastic_pool import ElasticPool
from libra.sim.rl.limit import BatchFloor, Limit, StepTaken, makespan_bounds
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
        self._floors: dict[int, BatchFloor] = {}
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

    def floors(self, limit: Limit, steps: int) -> dict[int, BatchFloor]:
        """Every step's floors (`sim.rl.limit`); computed once per run, before the systems fork."""
        if not self._floors:
            self._floors = {s: limit.batch(self.get(s)) for s in range(steps)}
        return self._floors


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
        self.setup: Setup = system.setup(sc, self.hw)
        # Routing counts and engine token totals cover the whole run, across re-plans (each
        # re-plan builds new engines and a new driver).
        self.routing = RoutingStats()
        self.tail_stats = TailStats()
        self.retired_tokens = self.retired_preemptions = 0
        self.bucketed = False  # whether any layout of the run had more than one bucket
        self.driver = self._build_driver(self.setup)
        self.history: list[StepRecord] = []
        self.in_flight: dict[int, InFlight] = {}
        self.group_left: dict[tuple[int, str], int] = {}  # (step, prompt) -> samples still running
        self.group_done: dict[tuple[int, str], list[Trajectory]] = {}
        self.gate = StalenessGate(sc.pipeline.staleness, sc.pipeline.consume, self.setup.colocated)
        self.finished: GroupQueue[list[Trajectory]] = GroupQueue(self.gate)
        self.filled = 0  # steps whose training batch is full
        self.version: dict[int, int] = {}  # step -> training steps done when its batch started
        self.group_version: dict[tuple[int, str], int] = {}  # a re-run group's own version
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
        self.next_batch_delay = 0.0
        self.replans = 0
        self.pool = self._make_pool() if system.elastic else None
        self._bounds: list[float] | None = None

    def _make_pool(self) -> ElasticPool:
        return ElasticPool(self.setup.plan, self.driver, self.k, self.sc.elastic)

    def train_par(self):
        """The training layout of the next step: the plan's, plus hybrid replicas that are ACTIVE."""
        t = self.setup.train
        extra = self.pool.active if self.pool is not None else 0
        return replace(t, dp=t.dp + extra) if extra else t

    # ---- construction -------------------------------------------------------------------------

    def _build_driver(self, setup: Setup) -> RolloutDriver:
        engines = make_engines(
            self.k, setup.instances, self.hw, self.model, self.sc, self.profile.rollout, self.tracer
        )
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
        if s >= self.steps or self.pending is not None:
            return False
        return self.gate.may_start(s, self.train_done, busy=self.training or not self._drained())

    def _drained(self) -> bool:
        """No batch and no re-run group in flight."""
        return not self.in_flight and not self.group_version

    def _try_rollout(self) -> None:
        while self._may_roll(self.rollout_started):
            s = self.rollout_started
            self.rollout_started += 1
            self.in_flight[s] = InFlight(s)
            self.version[s] = self.train_done  # the weights batch s is generated with
            delay = self.sc.pipeline.switch_s if self.setup.colocated and s > 0 else 0.0
            delay, self.next_batch_delay = delay + self.next_batch_delay, 0.0
            if self.train_done > self.weights_on_engines and not self.setup.colocated:
                delay += self._weight_sync_s()
                self.weights_on_engines = self.train_done
            self.tracer.step_started(s, self.k.now)
            self.k.after(delay, self._start_batch, s)

    def _weight_sync_s(self) -> float:
        if self.sc.pipeline.weight_sync_s is not None:
            return self.sc.pipeline.weight_sync_s
        tp = min(i.tp for i in self.setup.instances)
        # Each rollout GPU receives its TP shard over the network; plus pausing and resharding.
        return self.model.weight_bytes / tp / (self.hw.inter_node_bw_gbps * 1e9 * 0.75) + 0.5

    def _start_batch(self, s: int) -> None:
        trajs = self.batches.get(s)
        groups: dict[str, list[Trajectory]] = {}
        for t in trajs:
            groups.setdefault(t.prompt_id, []).append(t)
        b = self.in_flight[s]
        b.t0, b.groups = self.k.now, len(groups)
        for pid, members in groups.items():
            self.group_left[(s, pid)] = len(members)
        for t in trajs:
            self.driver.start(t)

    def _traj_done(self, run) -> None:
        t = run.traj
        key = (t.step, t.prompt_id)
        self.group_done.setdefault(key, []).append(t)
        self.group_left[key] -= 1
        if self.group_left[key]:
            return
        del self.group_left[key]
        version = self.group_version.pop(key) if key in self.group_version else self.version[t.step]
        self.finished.add(t.step, version, self.group_done.pop(key))
        if self._fill():
            if self.pending is not None and self._drained():
                self._apply_pending()
            self._try_train()
            self._try_rollout()

    def _fill(self) -> bool:
        """Fill the next steps' batches from finished groups; whether any step was filled."""
        filled = False
        while (b := self.in_flight.get(self.filled)) is not None and b.groups is not None:
            taken = self.finished.take(self.filled, b.groups)
            self._replace(self.filled, self.finished.drain_expired())
            if taken is None:
                break
            self._batch_done(b, taken)
            self.filled += 1
            filled = True
        return filled

    def _replace(self, step: int, expired: list[Finished[list[Trajectory]]]) -> None:
        """Each group too old to train at `step` is replaced by a spare group, started now with the
        weights of now."""
        if expired:
            self.expired_at[step] = self.expired_at.get(step, 0) + len(expired)
        for f in expired:
            spare = self.batches.spare(self.expired_groups, f.group[0].step)
            key = (spare[0].step, spare[0].prompt_id)
            self.expired_groups += 1
            self.group_version[key] = self.train_done
            self.group_left[key] = len(spare)
            for t in spare:
                self.driver.start(t)

    def _batch_done(self, b: InFlight, taken: Sequence[Finished[list[Trajectory]]]) -> None:
        s = b.step
        trajs = [t for f in taken for t in f.group]
        del self.in_flight[s]
        assert b.t0 is not None  # a batch with groups has started
        self.done_batches[s] = StepRecord(s, b.t0, self.k.now, sum(t.generated_tokens for t in trajs),
                                          [t.total_tokens for t in trajs], trajs,
                                          [s - f.version for f in taken])  # fmt: skip
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
        report = StepReport(last.step, last.trajs, last.train_time, last.rollout_makespan, self._pressure())
        pool = None
        if self.pool is not None:
            pool = self.pool.view(
                self.setup.train.dp, self._serving_gpus(), self.sc.workload.prompts_per_step
            )
        dec = ctrl.observe(report, self.setup.plan, pool)
        if dec.elastic is not None and self.pool is not None:
            self.pool.apply(dec.elastic)
        if dec.replan is not None:
            self._switch(self.system.setup_for(dec.replan.plan, self.sc, self.hw, dec.replan.reconfig_s))

    def _switch(self, new: Setup) -> None:
        if _same_layout(new, self.setup):  # only the bucket boundaries moved: router thresholds
            self.setup = replace(new, instances=self.setup.instances)
            self.driver.retune(new.buckets)
            return
        self.pending = new
        if self._drained():
            self._apply_pending()

    def _pressure(self) -> float:
        engines = self.driver.engines.values()
        return sum(len(e.waiting) for e in engines) / max(1, sum(e.max_num_seqs for e in engines))

    def _apply_pending(self) -> None:
        """Every batch has drained: restart the engines in the new layout (after its cost)."""
        new, self.pending = self.pending, None
        self.engine_busy_gpu_s += self._engine_busy()
        retiring = self.driver.engines.values()
        self.retired_tokens += sum(e.prefill_tokens + e.decode_tokens for e in retiring)
        self.retired_preemptions += sum(e.preemptions for e in retiring)
        # A new layout gets a new router: its cost model is the new engines', so nothing a router
        # learned of the old layout (queue levels, per-bucket costs) carries over.
        self.setup, self.driver = new, self._build_driver(new)
        self.next_batch_delay += new.reconfig_s
        self.replans += 1
        if self.pool is not None:  # the new layout's hybrid replicas; the counts run on
            old, self.pool = self.pool, self._make_pool()
            self.pool.carry_over(old)

    # ---- metrics ------------------------------------------------------------------------------

    def bounds(self) -> list[float]:
        """Each trained step's makespan lower bound (`sim.rl.limit`), computed once."""
        if self._bounds is None:
            floors = self.batches.floors(limit_of(self.sc, self.profile), self.steps)
            # Spare groups (replacements of expired ones) are left out: the floors are the batches'
            # own, and fewer groups counted keeps each bound a lower bound.
            taken = [StepTaken(r.step, r.rollout_start, sorted({(t.step, t.prompt_id) for t in r.trajs
                                                               if not t.prompt_id.endswith(SPARE)}))
                     for r in self.history]  # fmt: skip
            completion = self.sc.pipeline.consume == "completion" and not self.setup.colocated
            self._bounds = makespan_bounds(taken, floors, self.total_gpus, completion)
        return self._bounds

    def _engine_busy(self) -> float:
        return sum(e.busy_s * e.tp for e in self.driver.engines.values())

    def summary(self) -> dict:
        h = self.history
        wall = h[-1].train_end
        gen = sum(r.generated_tokens for r in h)
        busy = self.engine_busy_gpu_s + self._engine_busy() + self.train_busy_gpu_s
        engines = self.driver.engines.values()
        rollout_tokens = self.retired_tokens + sum(e.prefill_tokens + e.decode_tokens for e in engines)
        makespan, bound = float(np.mean([r.rollout_makespan for r in h])), float(np.mean(self.bounds()))
        return {
            "throughput_tokens_per_s": gen / wall,
            "mean_step_time_s": wall / len(h),
            "mean_rollout_makespan_s": makespan,
            "makespan_lower_bound_s": bound,
            "distance_to_limit": makespan / bound - 1 if bound > 0 else 0.0,
            "rollout_throughput_tokens_per_s": gen / sum(r.rollout_makespan for r in h),
            "mean_train_time_s": float(np.mean([r.train_time for r in h])),
            "gpu_utilization": busy / (self.total_gpus * wall),
            "wall_time_s": wall,
            "generated_tokens": gen,
            "train_gpus": self.setup.train_gpus,
            "rollout_gpus": self.setup.rollout_gpus,
            "preemptions": self.retired_preemptions + sum(e.preemptions for e in engines),
            "replans": self.replans,
            "mean_staleness": float(np.mean([x for r in h for x in r.staleness])),
            "max_staleness": max(x for r in h for x in r.staleness),
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
                        "mean_length": float(np.mean(r.lengths)), "p90_length": float(np.percentile(r.lengths, 90))})  # fmt: skip
            prev = r.train_end
        return out


GC_EVERY_STEPS = 25


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


def _same_layout(a: Setup, b: Setup) -> bool:
    key = lambda s: (s.train, s.train_gpus, s.router, sorted((i.tp, i.bucket) for i in s.instances))  # noqa: E731
    return key(a) == key(b)


def limit_of(sc: RLScenario, profile: Profile) -> Limit:
    """The scenario's limit (`sim.rl.limit`): its cluster, model and engines' settings."""
    cat = load_catalog()
    hw, model = cat.hardware(sc.cluster.hardware), cat.model(sc.model)
    return Limit(hw, model, profile.rollout, sc.rollout, sc.pipeline.tool_latency_default_s)


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
    n = steps or (batches.trace_steps if trajs is not None else sc.steps)
    if n < 1:
        raise ConfigError("steps", n, "an integer >= 1")
    trace_step = sc.trace_step if sc.trace_step is not None else min(2, n - 1)
    # Generated once, here, with their floors: every system's process reads the same batches.
    batches.floors(limit_of(sc, profile or Profile()), n)
    systems_ = [make_system(name) for name in names]  # an unknown name fails here, before anything runs
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


def _simulate(sc: RLScenario, system: System, batches: Batches, n: int, seed: int, profile: Profile | None,
              trace_step: int, progress: Progress) -> tuple[dict, list[dict], SimRecord, dict]:  # fmt: skip
    sim = RLSim(sc, system, batches, n, seed, profile, trace_step)
    sim.progress = progress
    return sim.run(), sim.per_step(), sim.record(), system.shared
