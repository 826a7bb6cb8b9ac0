"""The `tangram` scenario runner: trajectories whose tool and reward calls compete for resources.

`libra simulate --scenario tangram-coding` (or `tangram-mopd`) lands here. Each system of the
scenario replays the same workload (same seed, same trajectories) on the same hardware:

1. Steps run one after another. At a step's start every trajectory starts; each alternates
   generation (a fixed time per turn, the same for every system) and an action it submits to the
   system, and the step ends when its last trajectory does.
2. The system decides when each action starts and on what; the simulator records submit, start
   and end, and from them the action completion time (ACT = queueing + execution).

For GPU scenarios it also finds `gpus_for_equal_act`: the fewest GPUs with which the pooled
system's mean ACT matches the static baseline's, by a sweep over pool sizes.

No wall clock anywhere: the kernel's seeded clock and rng only, so a seed reproduces a run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from libra.actions.cpu import CpuNode
from libra.actions.gpu import GpuService
from libra.actions.profiles import load_profiles
from libra.actions.quota import QuotaManager
from libra.core.errors import ConfigError
from libra.costmodel.catalog import load_catalog
from libra.sim.kernel import Kernel
from libra.sim.output import write_results
from libra.sim.tangram.config import TangramScenario
from libra.sim.tangram.systems import Resources, SimAction, make_system
from libra.sim.tangram.workloads import ActionSpec, CodingParams, CodingWorkload, MopdWorkload, TrajPlan
from libra.sim.tracing import span, write_trace


def run(
    sc: TangramScenario,
    systems: list[str] | None = None,
    steps: int | None = None,
    seed: int = 0,
    out_dir: Path | None = None,
    progress: Callable[[str, float], None] | None = None,
    profile=None,
) -> dict:
    names = _system_names(sc, systems)
    n_steps = steps or sc.steps
    progress = progress or (lambda label, frac: None)
    setup = SETUPS[sc.workload](sc, profile)
    results, records, per_step = {}, {}, {}
    for name in names:
        res, recs = simulate_system(setup, name, sc.systems[name], n_steps, seed, progress)
        per_step[name] = res.pop("per_step")
        results[name], records[name] = res, recs
    out = {"scenario": sc.name, "kind": "tangram", "workload": sc.workload, "steps": n_steps, "seed": seed}
    out["systems"] = results
    if setup.sweeps_gpus and sc.equal_act is not None:
        out.update(equal_act_sweep(setup, sc, results, n_steps, seed, progress))
    out["per_step"] = per_step
    if out_dir is not None:
        write_outputs(out, records, Path(out_dir))
    return out


def _system_names(sc: TangramScenario, systems: list[str] | None) -> list[str]:
    names = systems if systems is not None else (sc.default_systems or list(sc.systems))
    for n in names:
        if n not in sc.systems:
            raise ConfigError("--systems", n, sorted(sc.systems))
    return names


class CodingSetup:
    """CPU sandboxes: the coding workload on `cluster.nodes` nodes of cores."""

    sweeps_gpus = False

    def __init__(self, sc: TangramScenario, profile):
        self.sc, c = sc, sc.cluster
        self.params = sc.coding or CodingParams()
        self.workload = CodingWorkload(self.params, load_profiles(sc.profiles))
        self.env_memory_gib = self.params.env_memory_gib
        if self.env_memory_gib > c.memory_gib_per_node:  # no trajectory could ever be pinned
            raise ConfigError("coding.env_memory_gib", self.env_memory_gib,
                              f"<= cluster.memory_gib_per_node ({c.memory_gib_per_node:g})")  # fmt: skip
        self.nodes = [CpuNode.uniform(c.cores_per_node, c.numa_per_node, c.memory_gib_per_node, first=i * c.cores_per_node) for i in range(c.nodes)]  # fmt: skip

    def resources(self, gpus: int | None = None) -> Resources:
        return Resources(cpu_nodes=self.nodes, quota=_quota(self.sc))

    def ideal_s(self, spec: ActionSpec) -> float:
        """The action alone at its best number of cores on one node (see `ideal_exec_s`)."""
        return ideal_exec_s(spec, self.sc.cluster.cores_per_node)

    def plans(self, step: int, seed: int) -> list[TrajPlan]:
        return self.workload.step(step, random.Random(f"{seed}:{step}"))


class MopdSetup:
    """GPU services: teacher / reward models on a GPU type, scored per GRPO group."""

    sweeps_gpus = True
    env_memory_gib = 0.0

    def __init__(self, sc: TangramScenario, profile):
        if sc.mopd is None:
            raise ConfigError("mopd", None, "a `mopd:` mapping for workload mopd")
        self.sc, m = sc, sc.mopd
        eff = profile.rollout if profile is not None else None
        self.workload = MopdWorkload(m, load_catalog(), sc.cluster.hardware, eff)
        self.hw = hw = self.workload.hw
        self.services = {
            s: GpuService(name=s, state_gib=self.workload.state_gib(s), workspace_gib=m.workspace_gib,
                          restore_gbps=m.restore_gbps, restore_fixed_s=m.restore_fixed_s)
            for s in self.workload.models
        }  # fmt: skip
        self.dops = {s: v.dops(hw.memory_gib, hw.gpus_per_node) for s, v in self.services.items()}
        for s, d in self.dops.items():
            if not d:
                raise ConfigError(
                    f"mopd.services.{s}", s, f"a model that fits on {hw.gpus_per_node} x {hw.name}"
                )

    def resources(self, gpus: int | None = None) -> Resources:
        total = gpus or self.sc.cluster.gpus or 4 * len(self.services)
        return Resources(gpu_nodes=split_nodes(total, self.hw.gpus_per_node), gpu_memory_gib=self.hw.memory_gib,
                         services=self.services, quota=_quota(self.sc))  # fmt: skip

    def plans(self, step: int, seed: int) -> list[TrajPlan]:
        return self.workload.step(step, random.Random(f"{seed}:{step}"), self.dops)

    def ideal_s(self, spec: ActionSpec) -> float:
        """The action at its best DoP the service fits at on one node, already resident."""
        dops = self.dops.get(spec.service or "", ())
        return ideal_exec_s(spec, max(dops, default=1), dops)


def ideal_exec_s(spec: ActionSpec, most: int, allowed: tuple[int, ...] | None = None) -> float:
    """An action's execution time at its best feasible degree of parallelism up to `most` units
    (and in `allowed`, if given): what it takes with no queueing and no restore, the limit its
    completion time is measured against."""
    key = spec.demand.get(spec.demand.key) if spec.demand.key else None
    if spec.profile is None or key is None:
        return spec.t1
    units = [m for m in key.values(most) if m > 0 and (allowed is None or m in allowed)]
    return min((spec.profile.duration(spec.t1, m) for m in units), default=spec.t1)


SETUPS = {"coding": CodingSetup, "mopd": MopdSetup}


def _quota(sc: TangramScenario) -> QuotaManager | None:
    return QuotaManager(sc.quotas) if sc.quotas else None


def split_nodes(gpus: int, per_node: int) -> list[int]:
    """Whole nodes, then the remainder as power-of-two partial nodes (20 on 8-GPU nodes: 8, 8, 4)."""
    nodes = [per_node] * (gpus // per_node)
    rest, size = gpus % per_node, per_node
    while rest:
        size //= 2
        if rest >= size:
            nodes.append(size)
            rest -= size
    return nodes


def simulate_system(
    setup: CodingSetup | MopdSetup, name: str, spec: dict, steps: int, seed: int, progress, overrides=None
):
    k = Kernel(seed)
    res = setup.resources(overrides.get("gpus") if overrides else None)
    system = make_system(name, spec, res, k, overrides)
    records: list[SimAction] = []
    step_times, tokens, per_step = [], 0, []
    for i in range(steps):
        plans = setup.plans(i, seed)
        t0, first = k.now, len(records)
        _run_step(k, system, plans, records, setup)
        k.run()
        step_times.append(k.now - t0)
        tokens += sum(p.tokens for p in plans)
        acts = [a.end - a.submit for a in records[first:]]
        per_step.append(
            {"step": i, "step_time_s": k.now - t0, "mean_act_s": _mean(acts), "actions": len(acts)}
        )
        progress(name, (i + 1) / steps)
    out = _metrics(system, records, step_times, tokens, k.now)
    ideal = _mean([setup.ideal_s(a.spec) for a in records])
    act = out["actions"]["mean_act_s"]
    out["actions"]["ideal_mean_act_s"] = ideal
    out["actions"]["distance_to_limit"] = act / ideal - 1 if ideal > 0 else 0.0
    out["per_step"] = per_step
    return out, records


def _run_step(
    k: Kernel, system, plans: list[TrajPlan], records: list, setup: CodingSetup | MopdSetup
) -> None:
    memory = setup.env_memory_gib

    def advance(plan: TrajPlan, seg: int) -> None:
        if seg >= len(plan.segments):
            system.traj_end(plan.id)
            return
        gen, spec = plan.segments[seg]
        k.after(gen, act, plan, seg, spec)

    def act(plan: TrajPlan, seg: int, spec) -> None:
        if spec is None:
            system.traj_end(plan.id)
            return
        a = SimAction(f"{plan.id}/{seg}", plan.id, spec, k.now, lambda a: advance(plan, seg + 1))
        records.append(a)
        system.submit(a)

    for plan in plans:
        system.traj_start(plan.id, memory, lambda plan=plan: advance(plan, 0))


def _metrics(system, records: list[SimAction], step_times: list[float], tokens: int, makespan: float) -> dict:
    unfinished = [a.id for a in records if a.end is None]
    if unfinished:
        raise RuntimeError(f"{system.name}: {len(unfinished)} actions never finished, e.g. {unfinished[:3]}")
    acts = sorted(a.end - a.submit for a in records)
    cap = system.capacity()
    units = next(iter(cap.values()))
    busy = system.busy_unit_s(records)
    actions = {
        "count": len(records),
        "mean_act_s": _mean(acts),
        "p50_act_s": _pct(acts, 0.50),
        "p99_act_s": _pct(acts, 0.99),
        "mean_queue_s": _mean([a.start - a.submit for a in records]),
        "mean_exec_s": _mean([a.end - a.start for a in records]),
        "mean_step_time_s": _mean(step_times),
        **cap,
        "utilization": busy / (units * makespan) if makespan > 0 else 0.0,
        "restore_overhead_share": system.restore_busy_s() / busy if busy > 0 else 0.0,
        "by_kind": _by_kind(records),
    }
    return {
        "actions": actions,
        "throughput_tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "mean_step_time_s": _mean(step_times),
    }


def _by_kind(records: list[SimAction]) -> dict:
    kinds: dict[str, list[SimAction]] = {}
    for a in records:
        kinds.setdefault(a.spec.kind, []).append(a)
    return {
        k: {
            "count": len(v),
            "mean_act_s": _mean([a.end - a.submit for a in v]),
            "mean_units": _mean([a.units for a in v]),
        }
        for k, v in sorted(kinds.items())
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pct(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def equal_act_sweep(
    setup: CodingSetup | MopdSetup, sc: TangramScenario, results: dict, steps: int, seed: int, progress
) -> dict:
    """The fewest pooled GPUs whose mean ACT is no worse than the static baseline's."""
    eq = sc.equal_act
    for n in (eq.system, eq.baseline):
        if n not in sc.systems:
            raise ConfigError("equal_act", n, sorted(sc.systems))
    if eq.baseline in results:
        base = results[eq.baseline]
    else:
        base = simulate_system(setup, eq.baseline, sc.systems[eq.baseline], steps, seed, progress)[0]
        base.pop("per_step")
    target, base_gpus = base["actions"]["mean_act_s"], base["actions"]["gpus"]
    sweep, found = [], None
    smallest = max(min(d) for d in setup.dops.values())  # every service must fit on one node
    sizes = [
        g
        for g in range(eq.step, base_gpus + 1, eq.step)
        if max(split_nodes(g, setup.workload.hw.gpus_per_node)) >= smallest
    ]
    for i, g in enumerate(sizes):
        res, _ = simulate_system(
            setup, eq.system, sc.systems[eq.system], steps, seed, lambda *_: None, {"gpus": g}
        )
        res.pop("per_step")
        sweep.append({"gpus": g, "mean_act_s": res["actions"]["mean_act_s"]})
        progress("gpus_for_equal_act sweep", (i + 1) / len(sizes))
        if res["actions"]["mean_act_s"] <= target:
            found = g
            break
    out = {"gpus_for_equal_act": found, "equal_act_sweep": sweep, "baseline_gpus": base_gpus}
    out["gpu_saving_at_equal_act"] = None if found is None else 1.0 - found / base_gpus
    return out


def write_outputs(out: dict, records: dict[str, list[SimAction]], out_dir: Path) -> list[Path]:
    """summary.json, steps.json, the plots, and a Perfetto trace of the last system's first step."""
    paths = [*write_results(out, out_dir), *_plots(out, records, out_dir)]
    name, recs = list(records.items())[-1]
    return [*paths, write_trace(action_spans(recs), {"system": name}, out_dir / "trace.json")]


def action_spans(recs: list[SimAction], limit: int = 20000) -> list[dict]:
    """Actions as slices, one process per trajectory node or service, lanes packed greedily."""
    events, lanes = [], {}
    for a in sorted(recs, key=lambda a: a.start)[:limit]:
        pid = a.spec.service or a.spec.kind
        ends = lanes.setdefault(pid, [])
        lane = next((i for i, e in enumerate(ends) if e <= a.start), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = a.end
        events.append(span(pid, lane, a.spec.kind, a.start, a.end - a.start, {"traj": a.traj, "units": a.units,
                           "queue_s": a.start - a.submit, "restore_s": a.restore_s}))  # fmt: skip
    return events


def _plots(out: dict, records: dict[str, list[SimAction]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in records.items():
        acts = sorted(a.end - a.submit for a in recs)
        ax.plot(acts, [(i + 1) / len(acts) for i in range(len(acts))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("action completion time, s")
    ax.set_ylabel("fraction of actions")
    ax.set_title(f"{out['scenario']}: ACT distribution")
    ax.legend()
    paths.append(out_dir / "actions_act_cdf.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    if out.get("equal_act_sweep"):
        fig, ax = plt.subplots(figsize=(6, 4))
        sw = out["equal_act_sweep"]
        ax.plot([s["gpus"] for s in sw], [s["mean_act_s"] for s in sw], marker="o", label="pooled (tangram)")
        base = out["systems"].get(out.get("equal_act_baseline", "static-services"))
        if base:
            ax.axhline(base["actions"]["mean_act_s"], color="gray", ls="--", label="static services")
        ax.set_yscale("log")
        ax.set_xlabel("GPUs in the pool")
        ax.set_ylabel("mean ACT, s")
        ax.legend()
        paths.append(out_dir / "actions_equal_act_sweep.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths
